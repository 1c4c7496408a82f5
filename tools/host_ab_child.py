"""One process of a host A/B (``tools.host_ab``, ``tools.block_ab``): mmsparse from one tree, the host figures of
``benchmarks.host`` (or, with ``--block``, its two-layer block's step in each mode and a checksum of its output).

Started by the parent as ``python <this file> --tree DIR --device D --calls N``, never imported. It imports mmsparse
from ``--tree`` first and only then this checkout's ``benchmarks`` package (as ``tools.ab_worker`` does), so that the
two sides differ in mmsparse alone. Prints one JSON line on stdout: where mmsparse came from and each figure, the
median host time of ``--calls`` calls in µs (a sync every 10 calls, outside the timed region)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_ROOT = Path(__file__).resolve().parent.parent  # the checkout whose harness both sides run


def host_figures(device_name: str, calls: int) -> dict[str, float]:
    """The seed's and small_2k's forward, forward + backward (on autograd's device thread and on the calling
    thread), the seed's forward + backward with new device lengths every call (both threads), and one call of the
    compiled graph's forward and backward ops at the seed (``benchmarks.host``)."""
    import torch

    from benchmarks.host import (
        CPU_SHAPES,
        GPU_SHAPES,
        _fwd_bwd,
        _inputs,
        host_us,
        new_lengths_step,
        one_thread_host_us,
        op_calls,
    )
    from mmsparse import mbs_attention

    device = torch.device(device_name)
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    def shape_figures(name: str) -> dict[str, float]:
        shape = shapes[name]
        q, k, v, grad = _inputs(shape, device, dtype)
        kw = dict(topology=shape.topology, seg_lens=shape.seg_lens)
        step = _fwd_bwd(q, k, v, grad, **kw)
        for _ in range(3):
            step()
        figures = {f"{name}_fwd": host_us(lambda: mbs_attention(q.detach(), k.detach(), v.detach(), **kw), device,
                                           calls),
                   f"{name}_fwd_bwd": host_us(step, device, calls),
                   f"{name}_fwd_bwd_one_thread": one_thread_host_us(step, device, calls)}
        if name == "seed":  # the mask and its lists built in every call
            new_lengths = new_lengths_step(q, k, v, grad, shape, calls)
            figures["seed_fwd_bwd_new_lengths"] = host_us(new_lengths, device, calls)
            figures["seed_fwd_bwd_new_lengths_one_thread"] = one_thread_host_us(new_lengths, device, calls)
        return figures

    figures = {**shape_figures("seed"), **shape_figures("small_2k")}
    ops = op_calls(shapes["seed"], device, dtype, calls)
    figures["seed_fwd_op"], figures["seed_bwd_op"] = ops["host_us_fwd_op"], ops["host_us_bwd_op"]
    return figures


def block_figures(device_name: str, calls: int) -> tuple[dict[str, float], list[float]]:
    """The two-layer block's step in µs per mode (``benchmarks.host.block_steps``: eager, and on a GPU compiled,
    reduce-overhead and dense SDPA's eager and compiled, by turns in 5 rounds), and the compiled step's checksum."""
    import torch

    from benchmarks.host import BLOCK_CPU, BLOCK_GPU, CPU_SHAPES, GPU_SHAPES, block_steps, interleaved_ms

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    shapes, sizes = (GPU_SHAPES, BLOCK_GPU) if cuda else (CPU_SHAPES, BLOCK_CPU)
    steps, checksum = block_steps(shapes["seed"].seg_lens, device, torch.bfloat16 if cuda else torch.float32,
                                  **sizes)
    sums = checksum()
    # through the interpreter (a smoke run) one warm-up call and one round: its times mean nothing
    times = interleaved_ms(steps, device, calls=calls, **({} if cuda else {"rounds": 1, "warmup": 1}))
    return {f"block_{name.removesuffix('_ms')}_us": ms * 1e3 for name, ms in times.items()}, sums


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--block", action="store_true", help="the block's step instead of the host figures")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree))
    import mmsparse  # before triton: on a machine without CUDA it turns on Triton's interpreter

    where = Path(mmsparse.__file__).resolve()
    if args.tree.resolve() not in where.parents:
        raise SystemExit(f"mmsparse came from {where}, not from {args.tree}")
    sys.path.insert(0, str(BENCH_ROOT))  # after mmsparse is cached: only the harness comes from here
    if args.block:
        figures, sums = block_figures(args.device, args.calls)
        print(json.dumps({"mmsparse": str(where.parent), "figures": figures, "sums": sums}), flush=True)
    else:
        print(json.dumps({"mmsparse": str(where.parent), "figures": host_figures(args.device, args.calls)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
