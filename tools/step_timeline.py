"""Where one training step's time goes: a profiled timeline of the seed's attention call or of the two-layer block,
every host op on each thread and every kernel, relative to the step's start.

    python -m tools.step_timeline --step seed --out DIR            # mbs_attention forward + backward at the seed
    python -m tools.step_timeline --step block --mode compile --out DIR   # the block compiled (eager, compile,
                                                                         # reduce-overhead; --dense: SDPA's)
    python -m tools.step_timeline --step seed --device cpu --out DIR      # CPU smoke run (the interpreter)

A host-bound step's wall time is the host time up to its last launch plus the kernels queued after it, so what
decides it is on the timeline, not in a sum: when the backward starts on autograd's thread, how long after the
forward its first launch comes, which kernels wait for the host. Steps are profiled after warm-up and one from the
middle is written out (``--step`` ``seed`` and ``block`` use ``benchmarks.host``'s shapes); the profiler adds host
time to every op, so read the gaps and the order, and time with ``benchmarks.host`` or the A/B tools. Writes
``DIR/step_timeline_<step>.txt`` (the timeline: start and duration in µs, CPU or CUDA, thread, ops indented by
depth) and prints a summary: the step's host span, its kernels, their summed time and their first and last start.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.arguments import at_least_one
from benchmarks.host import (
    BLOCK_CPU,
    BLOCK_GPU,
    CPU_SHAPES,
    GPU_SHAPES,
    _fwd_bwd,
    _inputs,
    block_steps,
)

MODES = {"eager": "eager_ms", "compile": "compile_ms", "reduce-overhead": "reduce_overhead_ms"}


def make_step(step: str, mode: str, dense: bool, device: torch.device) -> Callable[[], None]:
    """The step to profile: the seed's forward + backward, or the block's in ``mode`` (with dense SDPA: ``dense``)."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    if step == "seed":
        shape = shapes["seed"]
        q, k, v, grad = _inputs(shape, device, dtype)
        return _fwd_bwd(q, k, v, grad, topology=shape.topology, seg_lens=shape.seg_lens)
    steps, _ = block_steps(shapes["seed"].seg_lens, device, dtype, **(BLOCK_GPU if cuda else BLOCK_CPU))
    name = ("sdpa_" if dense else "") + MODES[mode]
    if name not in steps:
        raise SystemExit(f"--mode {mode}{' --dense' if dense else ''} runs on a GPU only (here: eager, mmsparse's)")
    return steps[name]


def timeline(run: Callable[[], None], steps: int, depth: int) -> tuple[list[str], dict[str, Any]]:
    """Profile ``steps`` calls of ``run`` (each in a ``STEP<i>`` range) and return the middle one's lines (host ops up
    to ``depth`` deep, every kernel) and its summary."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"STEP{i}"):
                run()
        if cuda:
            torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    middle = steps // 2
    marks = {e.name: e for e in events if e.name.startswith("STEP") and _kind(e) == "CPU"}
    start = marks[f"STEP{middle}"].time_range.start
    end = marks[f"STEP{middle + 1}"].time_range.start if middle + 1 < steps else float("inf")
    lines, kernels = [], []
    for event in events:
        at = event.time_range.start
        if not start <= at < end or (event.name.startswith("STEP") and _kind(event) != "CPU"):
            continue
        level = _depth(event)
        if _kind(event) == "CUDA":
            kernels.append((at - start, event.time_range.end - at))
        elif level > depth:
            continue
        lines.append(f"{at - start:9.1f} {event.time_range.end - at:8.1f} {_kind(event):4s} "
                     f"th{event.thread % 100000:<6d}{'  ' * level}{event.name[:120]}")
    span = marks[f"STEP{middle}"].time_range.end - start
    summary = {"host_us": span, "kernels": len(kernels), "kernel_us": sum(d for _, d in kernels),
               "first_kernel_us": min((a for a, _ in kernels), default=None),
               "last_kernel_us": max((a for a, _ in kernels), default=None)}
    return lines, summary


def _kind(event: Any) -> str:
    return str(event.device_type).rsplit(".", 1)[-1]


def _depth(event: Any) -> int:
    level, parent = 0, event.cpu_parent
    while parent is not None:
        level, parent = level + 1, parent.cpu_parent
    return level


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.step_timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=("seed", "block"), default="seed")
    p.add_argument("--mode", choices=tuple(MODES), default="eager", help="the block's mode (default eager)")
    p.add_argument("--dense", action="store_true", help="the block with dense SDPA in place of mmsparse")
    p.add_argument("--steps", type=at_least_one, default=5, help="profiled steps, the middle one written (default 5)")
    p.add_argument("--warmup", type=int, default=10, help="steps run first, unprofiled (default 10)")
    p.add_argument("--depth", type=int, default=3, help="host ops this deep and less are written (default 3)")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--out", type=Path, required=True, help="folder of step_timeline_<step>.txt")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run = make_step(args.step, args.mode, args.dense, device)
    for _ in range(args.warmup):
        run()
    lines, summary = timeline(run, args.steps, args.depth)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_timeline_{args.step}.txt"
    path.write_text("\n".join(lines) + "\n")
    print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
