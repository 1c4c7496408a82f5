"""The one-pass backward (``deterministic=False``) against the default two-pass one, config by config: both checked
against the float32 reference, their gradients against each other, the one-pass dQ's run-to-run differences, and
the backward's time and peak memory of each, in interleaved rounds. The one-pass kernel runs at every length here
(``use_config(one_pass_max_keys=...)``); a call alone runs it only below that many keys.

    python -m tools.one_pass                                   # the GPU configs below, 5 rounds
    python -m tools.one_pass --configs mm13k_hub,seed --rounds 9 --out /tmp/one_pass.json
    python -m tools.one_pass --configs tiny_ab,tiny_pack --rounds 1   # CPU smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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

GPU_DEFAULT = ("seed", "mm13k_cyclic", "mm13k_hub", "mm13k_hub_causal", "mm13k_hub_d64", "mm13k_hub_gqa",
               "mm43k_cyclic", "pack_64k_x512", "transfusion_16k")
CPU_DEFAULT = ("tiny_ab", "tiny_hub_causal_gqa", "tiny_pack")
SIDES = {"two-pass": True, "one-pass": False}  # name: deterministic


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


def compare_config(cfg: BenchConfig, device: torch.device, dtype: torch.dtype, timing: Timing) -> dict[str, Any]:
    """One config's row: correctness of both sides, their differences, and the backward's time and memory."""
    case = Case.make(cfg, device, dtype)
    fns = {side: attention_fn(cfg, det) for side, det in SIDES.items()}
    row: dict[str, Any] = {"config": cfg.name}
    for side, fn in fns.items():
        res = check(case, Impl(fn), grads=True)
        row[f"{side}_check"] = res["check"]
        row[f"{side}_grad_rel_err"] = res.get("grad_rel_err")
    two, one, again = grads(case, fns["two-pass"]), grads(case, fns["one-pass"]), grads(case, fns["one-pass"])
    row["out_equal"] = bool(torch.equal(two[0], one[0]))
    for i, name in enumerate(("dq", "dk", "dv"), start=1):
        row[f"{name}_rel_diff"] = rel_diff(two[i], one[i])
    row["one_pass_dq_bits_changed"] = int((one[1] != again[1]).sum())  # run-to-run, the atomics' order
    del two, one, again
    times: dict[str, list[dict[str, float]]] = {side: [] for side in fns}
    for r in range(timing.rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]  # who goes first alternates
        for side in order:
            times[side].append(time_passes(fns[side], case.q, case.k, case.v, case.dout, timing))
    for side in fns:
        row[f"{side}_fwd_ms"] = statistics.median(t["fwd_ms"] for t in times[side])
        row[f"{side}_bwd_ms"] = statistics.median(t["fwdbwd_ms"] - t["fwd_ms"] for t in times[side])
        row[f"{side}_peak_mib"] = peak_mib(case, fns[side])
    row["bwd_speedup"] = row["two-pass_bwd_ms"] / max(row["one-pass_bwd_ms"], 1e-9)  # > 1: one pass is faster
    del case
    free_memory(device)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = ("| config | check two / one | out equal | dq / dk / dv rel diff | one-pass dq bits changed | bwd ms two / "
            "one | speedup | peak MiB two / one |")
    lines = [head, "|" + "---|" * 8]

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        lines.append(
            f"| {r['config']} | {r['two-pass_check']} / {r['one-pass_check']} | {r['out_equal']} | "
            f"{r['dq_rel_diff']:.1e} / {r['dk_rel_diff']:.1e} / {r['dv_rel_diff']:.1e} | "
            f"{r['one_pass_dq_bits_changed']} | {r['two-pass_bwd_ms']:.3f} / {r['one-pass_bwd_ms']:.3f} | "
            f"{r['bwd_speedup']:.3f} | {mib(r['two-pass_peak_mib'])} / {mib(r['one-pass_peak_mib'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m tools.one_pass", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(GPU_DEFAULT if cuda else CPU_DEFAULT),
                    help="comma-separated benchmark config names (benchmarks/configs.py)")
    ap.add_argument("--rounds", type=int, default=5 if cuda else 1, help="interleaved timing rounds (median)")
    ap.add_argument("--dtype", default="bf16" if cuda else "fp32", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--out", type=Path, help="also write the rows, versions and commit as JSON here")
    args = ap.parse_args(argv)
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
            rows.append(compare_config(ALL_CONFIGS[name], device, dtype, timing))
            print(f"{name}: bwd two-pass {rows[-1]['two-pass_bwd_ms']:.3f} ms, one-pass "
                  f"{rows[-1]['one-pass_bwd_ms']:.3f} ms", flush=True)
    print(table(rows))
    if args.out is not None:
        record = {"rows": rows, "versions": versions(device), "commit": git_commit(), "dtype": args.dtype,
                  "rounds": args.rounds, "timing": timing.method}
        args.out.write_text(json.dumps(record, indent=1))
        args.out.with_suffix(".md").write_text(f"{record['versions']}, commit {record['commit']}, {args.dtype}; "
                                               f"{record['timing']}\n\n{table(rows)}")
    bad = [r["config"] for r in rows if "FAIL" in (r["two-pass_check"], r["one-pass_check"]) or not r["out_equal"]]
    if bad:
        print(f"failed checks: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
