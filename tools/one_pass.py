"""The one-pass backward (``deterministic=False``) against the default two-pass one, config by config: both checked
against the float32 reference, their gradients against each other, the one-pass dQ's run-to-run differences, and
the backward's time and peak memory of each, in interleaved rounds. The one-pass kernel runs at every length here
(``use_config(one_pass_max_keys=...)``); a call alone runs it only below that many keys.

``--dq-adds`` picks how the Gluon one pass (Hopper) adds dQ, one side each, all timed in the same rounds:
``atomic`` (the default config: relaxed float32 atomics from registers; the side "one-pass") and ``bulk`` (TMA bulk
reduce-adds from a staging tile, ``config.GLUON_ONE_PASS_BULK``'s tile through ``KernelConfig.gluon_one_pass``; the
side "one-pass-bulk"). Where the one pass is not the Gluon kernel (no Hopper, dropout) both run the tl kernel.

    python -m tools.one_pass                                   # the GPU configs below, 5 rounds
    python -m tools.one_pass --configs mm13k_hub,seed --rounds 9 --out /tmp/one_pass.json
    python -m tools.one_pass --dq-adds atomic,bulk --out /tmp/one_pass_bulk.json   # both ways to add dQ
    python -m tools.one_pass --configs tiny_ab,tiny_pack --rounds 1   # CPU smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter
from benchmarks.baselines import call_topology
from benchmarks.cases import Case
from benchmarks.check import check
from benchmarks.configs import ALL_CONFIGS, BenchConfig
from benchmarks.devices import free_memory
from benchmarks.env import git_commit, versions
from benchmarks.impl import Impl, TensorFn
from benchmarks.runner import peak_mib
from benchmarks.timing import Timing, time_passes
from mmsparse.attention.config import GLUON_ONE_PASS_BULK, head_dim_pad, kernel_config

GPU_DEFAULT = ("seed", "mm13k_cyclic", "mm13k_hub", "mm13k_hub_causal", "mm13k_hub_d64", "mm13k_hub_gqa",
               "mm43k_cyclic", "pack_64k_x512", "transfusion_16k")
CPU_DEFAULT = ("tiny_ab", "tiny_hub_causal_gqa", "tiny_pack")
DQ_ADDS = {"atomic": "one-pass", "bulk": "one-pass-bulk"}  # --dq-adds: the side's name


def side_config(side: str, cfg: BenchConfig, device: torch.device, dtype: torch.dtype) -> AbstractContextManager[Any]:
    """The config a side runs under, forward and backward (the backward reads it when it runs): the default, or
    for "one-pass-bulk" the device's config with the bulk one-pass tile (none at a head dim without Gluon
    kernels)."""
    bulk = GLUON_ONE_PASS_BULK.get(head_dim_pad(cfg.head_dim))
    if side != DQ_ADDS["bulk"] or bulk is None:
        return contextlib.nullcontext()
    return mmsparse.use_config(dataclasses.replace(kernel_config(cfg.head_dim, dtype, device), gluon_one_pass=bulk))


def one_pass_tile(cfg: BenchConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The tile the one pass runs at under the current config, as the record shows it."""
    x = kernel_config(cfg.head_dim, dtype, device).one_pass_kernel_tile()
    return f"{x.block_m}x{x.block_n}" + (f" gluon s{x.gluon_stages} {x.dq_adds}" if x.gluon else " tl")


def attention_fn(cfg: BenchConfig, deterministic: bool) -> TensorFn:
    """mmsparse as a user calls it for ``cfg`` (as the benchmark's), with ``deterministic``."""
    topology = call_topology(cfg)
    if cfg.packed:
        rows = [list(r) for r in cfg.seg_lens]
        return lambda q, k, v: mmsparse.mbs_attention_varlen(q, k, v, topology, rows, causal=cfg.causal,
                                                             deterministic=deterministic)
    return lambda q, k, v: mmsparse.mbs_attention(q, k, v, topology, cfg.seg_lens, causal=cfg.causal,
                                                  deterministic=deterministic)


def grads(case: Case, fn: TensorFn) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of one forward and backward."""
    case.clear_grads()
    out = fn(case.q, case.k, case.v)
    out.backward(case.dout)
    result = (out.detach(), case.q.grad, case.k.grad, case.v.grad)
    case.clear_grads()
    return result


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |a| (0 for equal tensors)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max()) / max(float(a.abs().max()), 1e-30)


def compare_config(cfg: BenchConfig, device: torch.device, dtype: torch.dtype, timing: Timing,
                   dq_adds: tuple[str, ...] = ("atomic",)) -> dict[str, Any]:
    """One config's row: correctness of every side (the two passes, and the one pass with each way of adding dQ in
    ``dq_adds``), each one pass's differences from the two passes, and the backward's time and memory of each.
    Keys of a one-pass side start with its name ("one-pass", "one-pass-bulk"); "bwd_speedup" is the first one
    pass's."""
    case = Case.make(cfg, device, dtype)
    one_sides = [DQ_ADDS[a] for a in dq_adds]
    sides = ["two-pass", *one_sides]
    fns = {side: attention_fn(cfg, side == "two-pass") for side in sides}

    def under(side: str) -> AbstractContextManager[Any]:
        return side_config(side, cfg, device, dtype)

    row: dict[str, Any] = {"config": cfg.name}
    for side, fn in fns.items():
        with under(side):
            res = check(case, Impl(fn), grads=True)
            if side != "two-pass":
                row[f"{side}_tile"] = one_pass_tile(cfg, device, dtype)
        row[f"{side}_check"] = res["check"]
        row[f"{side}_grad_rel_err"] = res.get("grad_rel_err")
    two = grads(case, fns["two-pass"])
    for side in one_sides:
        with under(side):
            one, again = grads(case, fns[side]), grads(case, fns[side])
        row[f"{side}_out_equal"] = bool(torch.equal(two[0], one[0]))
        for i, name in enumerate(("dq", "dk", "dv"), start=1):
            row[f"{side}_{name}_rel_diff"] = rel_diff(two[i], one[i])
        row[f"{side}_dq_bits_changed"] = int((one[1] != again[1]).sum())  # run to run: the adds' order
        if side == one_sides[0]:  # the first one pass also under the record's older keys
            row.update({k: row[f"{side}_{k}"] for k in ("out_equal", "dq_rel_diff", "dk_rel_diff", "dv_rel_diff")})
            row["one_pass_dq_bits_changed"] = row[f"{side}_dq_bits_changed"]
        del one, again
    del two
    times: dict[str, list[dict[str, float]]] = {side: [] for side in fns}
    for r in range(timing.rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # who goes first alternates
        for side in order:
            with under(side):
                times[side].append(time_passes(fns[side], case.q, case.k, case.v, case.dout, timing))
    for side in fns:
        row[f"{side}_fwd_ms"] = statistics.median(t["fwd_ms"] for t in times[side])
        row[f"{side}_bwd_ms"] = statistics.median(t["fwdbwd_ms"] - t["fwd_ms"] for t in times[side])
        with under(side):
            row[f"{side}_peak_mib"] = peak_mib(case, fns[side])
    for side in one_sides:  # > 1: the one pass is faster
        row[f"{side}_speedup"] = row["two-pass_bwd_ms"] / max(row[f"{side}_bwd_ms"], 1e-9)
    row["bwd_speedup"] = row[f"{one_sides[0]}_speedup"]
    if len(one_sides) > 1:  # > 1: the bulk adds are faster than the atomics
        row["bulk_vs_atomic"] = row["one-pass_bwd_ms"] / max(row["one-pass-bulk_bwd_ms"], 1e-9)
    del case
    free_memory(device)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table: the two passes against each one pass (a line each)."""
    head = ("| config | one pass (tile) | check two / one | out equal | dq / dk / dv rel diff | dq bits changed | "
            "bwd ms two / one | speedup | peak MiB two / one |")
    lines = [head, "|" + "---|" * 9]

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        for side in DQ_ADDS.values():
            if f"{side}_bwd_ms" not in r:
                continue
            lines.append(
                f"| {r['config']} | {side} ({r.get(f'{side}_tile', '-')}) | {r['two-pass_check']} / "
                f"{r[f'{side}_check']} | {r[f'{side}_out_equal']} | {r[f'{side}_dq_rel_diff']:.1e} / "
                f"{r[f'{side}_dk_rel_diff']:.1e} / {r[f'{side}_dv_rel_diff']:.1e} | "
                f"{r[f'{side}_dq_bits_changed']} | {r['two-pass_bwd_ms']:.3f} / "
                f"{r[f'{side}_bwd_ms']:.3f} | {r[f'{side}_speedup']:.3f} | {mib(r['two-pass_peak_mib'])} / "
                f"{mib(r[f'{side}_peak_mib'])} |")
        if "bulk_vs_atomic" in r:
            lines.append(f"| {r['config']} | bulk vs atomic | | | | | one pass {r['one-pass_bwd_ms']:.3f} / "
                         f"{r['one-pass-bulk_bwd_ms']:.3f} | {r['bulk_vs_atomic']:.3f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m tools.one_pass", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(GPU_DEFAULT if cuda else CPU_DEFAULT),
                    help="comma-separated benchmark config names (benchmarks/configs.py)")
    ap.add_argument("--rounds", type=int, default=5 if cuda else 1, help="interleaved timing rounds (median)")
    ap.add_argument("--dtype", default="bf16" if cuda else "fp32", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--dq-adds", default="atomic",
                    help="comma-separated ways the Gluon one pass adds dQ, a timed side each: atomic, bulk")
    ap.add_argument("--out", type=Path, help="also write the rows, versions and commit as JSON here")
    args = ap.parse_args(argv)
    dq_adds = tuple(dict.fromkeys(a for a in args.dq_adds.split(",") if a))
    if not dq_adds or set(dq_adds) - set(DQ_ADDS):
        ap.error(f"--dq-adds: a comma-separated list of {', '.join(DQ_ADDS)}; got {args.dq_adds!r}")
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; see benchmarks/configs.py")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timing = Timing(device, warmup=25 if cuda else 0, rep=100 if cuda else 0, cpu_warmup=1, cpu_reps=1,
                    rounds=args.rounds)
    rows = []
    # The kernel at every length: deterministic=False alone runs it only below one_pass_max_keys keys.
    with mmsparse.use_config(one_pass_max_keys=1 << 62):
        for name in names:
            rows.append(compare_config(ALL_CONFIGS[name], device, dtype, timing, dq_adds))
            ones = ", ".join(f"{DQ_ADDS[a]} {rows[-1][DQ_ADDS[a] + '_bwd_ms']:.3f} ms" for a in dq_adds)
            print(f"{name}: bwd two-pass {rows[-1]['two-pass_bwd_ms']:.3f} ms, {ones}", flush=True)
    print(table(rows))
    if args.out is not None:
        record = {"rows": rows, "versions": versions(device), "commit": git_commit(), "dtype": args.dtype,
                  "rounds": args.rounds, "timing": timing.method, "dq_adds": list(dq_adds)}
        args.out.write_text(json.dumps(record, indent=1))
        args.out.with_suffix(".md").write_text(f"{record['versions']}, commit {record['commit']}, {args.dtype}; "
                                               f"{record['timing']}\n\n{table(rows)}")
    bad = [r["config"] for r in rows
           if "FAIL" in [r[f"{s}_check"] for s in ("two-pass", *(DQ_ADDS[a] for a in dq_adds))]
           or not all(r[f"{DQ_ADDS[a]}_out_equal"] for a in dq_adds)]
    if bad:
        print(f"failed checks: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
