"""The one-pass backward against the default two-pass one, config by config: the tl one pass (side ``one-pass``: the tl
dK/dV kernel adding dQ by atomics), on Hopper also the warp-specialised one-pass kernel with a dQ writer warp (side
``dq-writer``: ``kernels/gluon/bwd_dq_writer.py``, D=64's default, turned on here per call at every head dim), each
checked against the float32 reference, the one-pass sides' gradients against the first side's, their dQ's run-to-run
differences, and the backward's time and peak memory of each, in interleaved rounds. The one-pass kernels run at every
length here (``use_tuning(one_pass_max_keys=...)``); a call alone runs the tl one only below that many keys.

    python -m tools.one_pass                                   # the GPU configs below, 5 rounds, every side
    python -m tools.one_pass --configs mm13k_hub,seed --rounds 9 --out /tmp/one_pass.json
    python -m tools.one_pass --sides one-pass,two-pass     # the one pass as the baseline
    python -m tools.one_pass --sides two-pass,dq-writer --configs mm13k_hub_d64
    python -m tools.one_pass --sides two-pass,dq-writer-s3,dq-writer-s5 --configs mm13k_hub --head-dim 64
    python -m tools.one_pass --sides two-pass,dq-writer,dq-writer-m128-s3 --configs transfusion_16k --head-dim 64
    python -m tools.one_pass --sides two-pass,two-pass-s3,two-pass-s5 --configs mm13k_hub_d64
    python -m tools.one_pass --sides two-pass,dq-writer-ordered,dq-writer-ordered-h4 --configs mm13k_cyclic
    python -m tools.one_pass --configs tiny_ab,tiny_pack --rounds 1   # CPU smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter
from benchmarks.arguments import config_names
from benchmarks.baselines import call_topology
from benchmarks.cases import Case
from benchmarks.check import check
from benchmarks.configs import ALL_CONFIGS, BenchConfig
from benchmarks.devices import free_memory
from benchmarks.env import git_commit, versions
from benchmarks.impl import Impl, TensorFn
from benchmarks.runner import peak_mib
from benchmarks.timing import Timing, time_passes
from mmsparse.attention.config import (
    EVERY_LENGTH,
    KernelConfig,
    Tile,
    cuda_kernel_config,
    gluon_tile_problem,
    head_dim_pad,
    kernel_config,
)

GPU_DEFAULT = ("seed", "mm13k_cyclic", "mm13k_hub", "mm13k_hub_causal", "mm13k_hub_d64", "mm13k_hub_gqa",
               "mm43k_cyclic", "pack_64k_x512", "transfusion_16k")
CPU_DEFAULT = ("tiny_ab", "tiny_hub_causal_gqa", "tiny_pack")
# name: the deterministic argument; the first side given is the baseline of the others
SIDES = {"two-pass": True, "one-pass": False, "dq-writer": False, "dq-writer-ordered": True}
# The sides that run the dQ-writer kernel (a Gluon kernel: on a Hopper GPU only); "dq-writer-m<M>-s<N>" runs it
# at M-query blocks and N stages instead of its table's (either part may be left out: a sweep of one of them), and
# "two-pass-m<M>-s<N>" the two passes with the dK/dV pass's tile so changed.
WRITER_SIDES = ("dq-writer", "dq-writer-ordered")  # "-ordered": deterministic, its adds in order
_SIDE_TILE = re.compile(r"(dq-writer|two-pass)(?:-m(\d+))?(?:-s(\d+))?")
# "dq-writer-ordered-h<K>": the ordered writer's programs taking each key block in turn for the (batch, KV head)s of
# K query heads (KernelConfig.ordered_head_section; "dq-writer-ordered": the config's)
_SIDE_SECTION = re.compile(r"dq-writer-ordered-h(\d+)")


def side_kind(side: str) -> str:
    """The entry of SIDES a side name runs: itself, or "dq-writer" for "dq-writer-m<M>-s<N>" (and "two-pass" for
    "two-pass-m<M>-s<N>", "dq-writer-ordered" for "dq-writer-ordered-h<K>")."""
    if _SIDE_SECTION.fullmatch(side):
        return "dq-writer-ordered"
    found = _SIDE_TILE.fullmatch(side)
    return found.group(1) if found else side


def side_head_section(side: str) -> int | None:
    """The query heads whose (batch, KV head)s a "dq-writer-ordered-h<K>" side's programs take each key block for
    (None: the config's)."""
    found = _SIDE_SECTION.fullmatch(side)
    return int(found.group(1)) if found else None


def side_stages(side: str) -> int | None:
    """The stage count a "dq-writer-s<N>" or "two-pass-s<N>" side asks for (None: the table's)."""
    found = _SIDE_TILE.fullmatch(side)
    return int(found.group(3)) if found and found.group(3) else None


def side_block_m(side: str) -> int | None:
    """The query rows a block of a "dq-writer-m<M>" or "two-pass-m<M>" side asks for (None: the table's)."""
    found = _SIDE_TILE.fullmatch(side)
    return int(found.group(2)) if found and found.group(2) else None


def gluon_dkdv_side(side: str) -> bool:
    """Whether a side is the two passes at a dK/dV tile of its own ("two-pass-m<M>-s<N>"), a Gluon kernel's."""
    found = _SIDE_TILE.fullmatch(side)
    return bool(found and found.group(1) == "two-pass" and (found.group(2) or found.group(3)))


def side_config(cfg: BenchConfig, side: str, device: torch.device, dtype: torch.dtype) -> KernelConfig | None:
    """The config a side runs under: the dQ-writer sides the device's config with ``gluon_dq_writer`` set (the
    table's tiles: ``cuda_kernel_config(..., gluon_dq_writer=True)``, or the side's query rows and stages at every
    length where it names them); for the two passes the device's config (with the side's dK/dV query rows and
    stages where it names them) without the ordered dQ writer, which is deterministic=True's default over packs of
    short samples and masks it launches longest list first; the one-pass side the device's config without the dQ
    writer (the one pass it runs then: the tl one)."""
    device_config = kernel_config(cfg.head_dim, dtype, device)
    if gluon_dkdv_side(side):  # the Gluon dK/dV kernel at the side's tile
        dkdv = _side_tile(cuda_kernel_config(cfg.head_dim, dtype).bwd_dkdv, "dkdv", side, cfg.head_dim, dtype)
        return replace(device_config, bwd_dkdv=dkdv, ordered_samples=0, ordered_max_keys=0)
    if side_kind(side) not in WRITER_SIDES:
        if SIDES[side_kind(side)]:
            return replace(device_config, ordered_samples=0, ordered_max_keys=0)
        return replace(device_config, gluon_dq_writer=None)
    writer = cuda_kernel_config(cfg.head_dim, dtype, gluon_dq_writer=True).gluon_dq_writer
    if writer is None:
        raise ValueError(f"{cfg.name}: no dQ-writer kernel at head dim {cfg.head_dim} in {dtype}")
    if side_stages(side) is not None or side_block_m(side) is not None:
        writer = _side_tile(writer, "dq_writer", side, cfg.head_dim, dtype)
        # the side's tile at every length (the table's longer-call tile would take over there)
        return replace(device_config, gluon_dq_writer=writer, gluon_dq_writer_long=None)
    section = side_head_section(side)
    return replace(device_config, gluon_dq_writer=writer,
                   ordered_dq_writer=side_kind(side) == "dq-writer-ordered",
                   ordered_head_section=device_config.ordered_head_section if section is None else section)


def _side_tile(tile: Tile, kind: str, side: str, head_dim: int, dtype: torch.dtype) -> Tile:
    """``tile`` with the query rows and stages the side names (``-m<M>``, ``-s<N>``), refused with the reason where
    the Gluon kernel of ``kind`` cannot run it (``gluon_tile_problem``)."""
    stages, block_m = side_stages(side), side_block_m(side)
    tile = replace(tile, gluon_stages=stages or tile.gluon_stages, block_m=block_m or tile.block_m)
    problem = gluon_tile_problem(kind, tile, head_dim_pad(head_dim), dtype.itemsize)
    if problem is not None:
        raise ValueError(f"side {side}: {problem}")
    return tile


def attention_fn(cfg: BenchConfig, side: str, config: KernelConfig | None = None) -> TensorFn:
    """mmsparse as a user calls it for ``cfg`` (as the benchmark's), with the ``deterministic`` of ``side``
    (``SIDES``), under ``config`` where given (``use_tuning``: the thresholds set outside stay)."""
    deterministic = SIDES[side_kind(side)]
    topology = call_topology(cfg)
    if cfg.packed:
        rows = [list(r) for r in cfg.seg_lens]

        def call(q, k, v):
            return mmsparse.mbs_attention_varlen(q, k, v, topology, rows, causal=cfg.causal, window=cfg.window,
                                                 deterministic=deterministic)
    else:
        def call(q, k, v):
            return mmsparse.mbs_attention(q, k, v, topology, cfg.seg_lens, causal=cfg.causal, window=cfg.window,
                                          deterministic=deterministic)
    if config is None:
        return call

    def tuned(q, k, v):
        with mmsparse.tuning.use_tuning(config):  # read by the forward, carried to its backward
            return call(q, k, v)
    return tuned


def one_pass_tile(cfg: BenchConfig, device: torch.device, dtype: torch.dtype, config: KernelConfig | None = None
                  ) -> str:
    """The tile the one pass runs at under the current config (or ``config``), as the record shows it."""
    c = config if config is not None else kernel_config(cfg.head_dim, dtype, device)
    x = c.one_pass_kernel_tile(seq_k=cfg.seq_k, sample_len=cfg.seq_k // len(cfg.rows) if cfg.packed else None)
    return f"{x.block_m}x{x.block_n}" + (f" gluon s{x.gluon_stages} dq-writer" if x.gluon else " tl")


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
                   sides: tuple[str, ...] = tuple(SIDES)) -> dict[str, Any]:
    """One config's row: correctness of each side, the other side's differences from the first, the one pass's dQ
    run-to-run differences, and the backward's time and memory of each."""
    case = Case.make(cfg, device, dtype)
    configs = {side: side_config(cfg, side, device, dtype) for side in sides}
    fns = {side: attention_fn(cfg, side, configs[side]) for side in sides}
    row: dict[str, Any] = {"config": cfg.name}
    results = {}
    for side, fn in fns.items():
        res = check(case, Impl(fn), grads=True)
        results[side] = grads(case, fn)
        one_pass = not SIDES[side_kind(side)] or side_kind(side) in WRITER_SIDES
        again = grads(case, fn) if one_pass else None
        if one_pass:
            row[f"{side}_tile"] = one_pass_tile(cfg, device, dtype, configs[side])
        row[f"{side}_check"] = res["check"]
        row[f"{side}_grad_rel_err"] = res.get("grad_rel_err")
        if again is not None:  # run to run: the adds' order (none changes where they are ordered)
            row[f"{side}_dq_bits_changed"] = int((results[side][1] != again[1]).sum())
        del again
    base = results[sides[0]]
    for side in sides[1:]:
        row[f"{side}_out_equal"] = bool(torch.equal(base[0], results[side][0]))
        for i, name in enumerate(("dq", "dk", "dv"), start=1):
            row[f"{side}_{name}_rel_diff"] = rel_diff(base[i], results[side][i])
    del results, base
    times: dict[str, list[dict[str, float]]] = {side: [] for side in fns}
    for r in range(timing.rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]  # who goes first alternates
        for side in order:
            times[side].append(time_passes(fns[side], case.q, case.k, case.v, case.dout, timing))
    for side in fns:
        row[f"{side}_fwd_ms"] = statistics.median(t["fwd_ms"] for t in times[side])
        row[f"{side}_bwd_ms"] = statistics.median(t["fwdbwd_ms"] - t["fwd_ms"] for t in times[side])
        row[f"{side}_peak_mib"] = peak_mib(case, fns[side])
    for side in sides[1:]:  # > 1: the side's backward is faster than the first side's
        row[f"{side}_bwd_speedup"] = row[f"{sides[0]}_bwd_ms"] / max(row[f"{side}_bwd_ms"], 1e-9)
    del case
    free_memory(device)
    return row


def table(rows: list[dict[str, Any]], sides: tuple[str, ...] = tuple(SIDES)) -> str:
    """The rows as a markdown table: a column group per side, the first side the baseline."""
    others = sides[1:]
    head = ("| config | check " + " / ".join(sides) + " | " + "".join(
        f"{side}: out equal, dq / dk / dv rel diff, speedup | " for side in others)
        + "dq bits changed " + " / ".join(others) + " | bwd ms " + " / ".join(sides) + " | peak MiB "
        + " / ".join(sides) + " |")
    lines = [head, "|" + "---|" * (5 + len(others))]

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        diffs = "".join(
            f"{r[f'{s}_out_equal']}, {r[f'{s}_dq_rel_diff']:.1e} / {r[f'{s}_dk_rel_diff']:.1e} / "
            f"{r[f'{s}_dv_rel_diff']:.1e}, {r[f'{s}_bwd_speedup']:.3f} | " for s in others)
        lines.append(
            f"| {r['config']} | {' / '.join(r[f'{s}_check'] for s in sides)} | {diffs}"
            f"{' / '.join(str(r.get(f'{s}_dq_bits_changed', '-')) for s in others)} | "
            f"{' / '.join(format(r[f'{s}_bwd_ms'], '.3f') for s in sides)} | "
            f"{' / '.join(mib(r[f'{s}_peak_mib']) for s in sides)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m tools.one_pass", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(GPU_DEFAULT if cuda else CPU_DEFAULT),
                    help="comma-separated benchmark config names (benchmarks/configs.py)")
    ap.add_argument("--rounds", type=int, default=5 if cuda else 1, help="interleaved timing rounds (median)")
    ap.add_argument("--dtype", default="bf16" if cuda else "fp32", choices=("bf16", "fp16", "fp32"))
    default_sides = SIDES if cuda else [s for s in SIDES if s not in WRITER_SIDES]
    ap.add_argument("--sides", default=",".join(default_sides),
                    help=f"comma-separated backwards, the first the baseline (of {', '.join(SIDES)})")
    ap.add_argument("--head-dim", type=int, help="run every config at this head dim instead of its own (the row's "
                    "name gets _d<N>)")
    ap.add_argument("--out", type=Path, help="also write the rows, versions and commit as JSON here")
    args = ap.parse_args(argv)
    names = config_names(ap, args.configs)
    sides = tuple(dict.fromkeys(n for n in args.sides.split(",") if n))
    if len(sides) < 2 or any(side_kind(side) not in SIDES for side in sides):
        ap.error(f"--sides takes two or more of {', '.join(SIDES)} (or dq-writer-m<M>-s<N>, two-pass-m<M>-s<N>: at M "
                 f"query rows and N stages; dq-writer-ordered-h<K>: sections of K query heads), the baseline "
                 f"first; got {args.sides!r}")
    if args.head_dim is not None and args.head_dim < 1:
        ap.error(f"--head-dim takes a positive head dim; got {args.head_dim}")
    if not cuda and any(side_kind(side) in WRITER_SIDES or gluon_dkdv_side(side) for side in sides):
        ap.error(f"the {', '.join(WRITER_SIDES)} and two-pass-m<M>-s<N> sides run Gluon kernels: they need a Hopper "
                 "GPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timing = Timing(device, warmup=25 if cuda else 0, rep=100 if cuda else 0, cpu_warmup=1, cpu_reps=1,
                    rounds=args.rounds)
    rows = []
    # The kernel at every length: deterministic=False alone runs it only below one_pass_max_keys keys.
    with mmsparse.tuning.use_tuning(one_pass_max_keys=EVERY_LENGTH):
        for name in names:
            cfg = ALL_CONFIGS[name]
            if args.head_dim is not None and args.head_dim != cfg.head_dim:
                cfg = replace(cfg, name=f"{name}_d{args.head_dim}", head_dim=args.head_dim)
            rows.append(compare_config(cfg, device, dtype, timing, sides))
            print(f"{cfg.name}: bwd " + ", ".join(f"{s} {rows[-1][f'{s}_bwd_ms']:.3f} ms" for s in sides), flush=True)
    print(table(rows, sides))
    if args.out is not None:
        record = {"rows": rows, "sides": sides, "versions": versions(device), "commit": git_commit(),
                  "dtype": args.dtype, "rounds": args.rounds, "timing": timing.method}
        args.out.write_text(json.dumps(record, indent=1))
        args.out.with_suffix(".md").write_text(f"{record['versions']}, commit {record['commit']}, {args.dtype}; "
                                               f"{record['timing']}\n\n{table(rows, sides)}")
    # a failed check or an output that differs
    bad = [r["config"] for r in rows if any(r[f"{s}_check"] == "FAIL" for s in sides)
           or not all(r[f"{s}_out_equal"] for s in sides[1:])]
    if bad:
        print(f"failed checks: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
