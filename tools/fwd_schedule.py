"""A CPU model of the Gluon forward's launch, to weigh a persistent forward (one built and measured:
``benchmarks/results/h200/fwd_persistent.md``, where a persistent tile cost about what a launched program's start
does).

Today the forward launches a program (CTA) per (batch * head, query block), and an SM starts the next program in
launch order once one ends (one program an SM: the D=128 forward's stages take 224 KB of shared memory); each
program pays a start (launch, barrier inits, Q and the first K loads, on the matmuls' path) and its key blocks. A
persistent forward runs one program an SM over many tiles, loading a tile's first K/V under the last one's end:
- ``static``: program p takes tiles p, p + P, p + 2P, ... (no counter, but blind to the lists' lengths);
- ``dynamic``: the next tile goes to the first program free (a tile counter in global memory, reset each launch).

Each tile costs its list's length times ``--block-us`` plus ``--start-us`` (a launched program) or ``--tile-us``
(a tile of a persistent program). The lists and their order are the forward's own (the config's forward tile,
each sample's longest list first: ``kernels.lists.ordered_row``). Nothing else is modelled: not memory, not L2.

``--measure`` (a GPU) first fits the two costs of today's launch from the forward itself: packs of samples of 1, 2,
4 and 8 query blocks (``--tokens`` tokens, the config's forward tile at D=128, every sample full), where every program
has a list of that many blocks and the launch runs ``ceil(programs / SMs)`` waves; a line through the time a wave
against the blocks a list gives the start (its intercept) and a key block's cost (its slope), which then replace
``--start-us`` and ``--block-us``.

    python -m tools.fwd_schedule --configs mm13k_cyclic,mm13k_hub,transfusion_16k
    python -m tools.fwd_schedule --configs seed --sms 8 --start-us 4 --tile-us 1
    python -m tools.fwd_schedule --measure --tile-us 1     # on a GPU: the launch's costs fitted first
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys

import torch

import mmsparse  # noqa: F401  (before triton: without CUDA it turns on Triton's interpreter)
from benchmarks.arguments import config_names
from benchmarks.configs import ALL_CONFIGS, BenchConfig
from benchmarks.timing import Timing
from mmsparse import mbs_attention_varlen
from mmsparse.attention.config import cuda_kernel_config, kernel_config, use_tuning

from .ordered_waits import config_mask

SAMPLE_BLOCKS = (1, 2, 4, 8)  # --measure: the query blocks of every sample, a pack each


def tile_lengths(cfg: BenchConfig) -> list[int]:
    """The key blocks of every forward tile of ``cfg`` in launch order: each (batch, query head)'s query blocks,
    longest list first (the lists of the config's first sample stand for every sample)."""
    info, sample_len = config_mask(cfg)
    config = cuda_kernel_config(cfg.head_dim, torch.bfloat16)
    tile = config.forward_tile(cfg.seq_k, cfg.seq_k, sample_len)
    counts = info.lists(tile.block_m, tile.block_n, False, config.compact_bytes).counts[0]
    length = (counts[:, 0] + counts[:, 1]).tolist()
    return [length[row] for row in counts[:, 3].tolist()] * (cfg.batch * cfg.heads_q)


def launched_us(lengths: list[int], sms: int, block_us: float, cost_us: float) -> float:
    """The last end when each tile goes, in order, to the first SM free: the hardware's launch (``cost_us`` the
    start of a program) or a dynamic persistent forward (``cost_us`` a tile's)."""
    free = [0.0] * min(sms, max(1, len(lengths)))
    for n in lengths:
        heapq.heappush(free, heapq.heappop(free) + n * block_us + cost_us)
    return max(free)


def static_us(lengths: list[int], sms: int, block_us: float, tile_us: float) -> float:
    """The last end when program p takes tiles p, p + sms, ... (a static persistent forward)."""
    busy = [0.0] * min(sms, max(1, len(lengths)))
    for i, n in enumerate(lengths):
        busy[i % len(busy)] += n * block_us + tile_us
    return max(busy)


def model_config(cfg: BenchConfig, sms: int, block_us: float, start_us: float, tile_us: float) -> dict:
    """One config's row: the launch's modelled time, and its time over each persistent forward's (> 1: faster)."""
    lengths = tile_lengths(cfg)
    launch = launched_us(lengths, sms, block_us, start_us)
    return {"config": cfg.name, "tiles": len(lengths), "mean_blocks": sum(lengths) / max(1, len(lengths)),
            "launch_us": launch, "static": launch / static_us(lengths, sms, block_us, tile_us),
            "dynamic": launch / launched_us(lengths, sms, block_us, tile_us)}


def fit_costs(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(start_us, block_us)``: the least-squares line through ``(key blocks a list, µs a wave)`` points."""
    if len({n for n, _ in points}) < 2:
        raise ValueError(f"a line needs points at two list lengths or more; got {points}")
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = (sum((n - mean_n) * (t - mean_t) for n, t in points)
             / sum((n - mean_n) ** 2 for n, _ in points))
    return mean_t - slope * mean_n, slope


def measured_points(device: torch.device, tokens: int, heads: int, head_dim: int, sms: int,
                    sample_blocks: tuple[int, ...] = SAMPLE_BLOCKS, timing: Timing | None = None
                    ) -> list[tuple[int, float]]:
    """``(key blocks a list, µs a wave)`` of the forward over packs of ``tokens`` tokens in samples of each of
    ``sample_blocks`` query blocks (every sample full: each query block's list holds its sample's key blocks), at
    the config's forward tile (``short_samples`` 0: not the short-samples tile), ``heads`` heads, bf16 on a GPU
    (float32 elsewhere). A wave is ``ceil(programs / sms)``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timing = timing or Timing(device, warmup=25, rep=100)
    tile = kernel_config(head_dim, dtype, device).forward_tile(tokens, tokens)  # as in a pack, short_samples 0
    if tile.block_m % tile.block_n or tokens % (max(sample_blocks) * tile.block_m):
        raise ValueError(f"--tokens must be a multiple of {max(sample_blocks)} query blocks of {tile.block_m} "
                         f"(the forward tile {tile.block_m}x{tile.block_n}); got {tokens}")
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    programs = heads * (tokens // tile.block_m)
    points = []
    with use_tuning(short_samples=0), torch.no_grad():
        for blocks in sample_blocks:  # samples of that many query blocks: lists of their key blocks
            rows = [[blocks * tile.block_m]] * (tokens // (blocks * tile.block_m))
            ms = timing.kernel_ms(lambda rows=rows: mbs_attention_varlen(q, k, v, [[1]], rows))
            points.append((blocks * tile.block_m // tile.block_n, ms * 1e3 / math.ceil(programs / sms)))
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fwd_schedule", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="mm13k_cyclic,mm13k_hub,mm13k_hub_causal,mm43k_cyclic,transfusion_16k",
                    help="comma-separated benchmark config names (benchmarks/configs.py)")
    ap.add_argument("--sms", type=int, default=132, help="programs running at once (an H200's multiprocessors)")
    # the defaults: --measure on an H200 (benchmarks/results/h200/fwd_persistent.md)
    ap.add_argument("--block-us", type=float, default=1.62, help="a key block's matmuls and softmax, µs")
    ap.add_argument("--start-us", type=float, default=4.22, help="a launched program's start, µs")
    ap.add_argument("--tile-us", type=float, default=1.0, help="a persistent program's cost a tile, µs")
    ap.add_argument("--measure", action="store_true",
                    help="fit --start-us and --block-us from the forward on this machine's GPU first")
    ap.add_argument("--tokens", type=int, default=65536, help="--measure: the tokens of each pack")
    ap.add_argument("--heads", type=int, default=16, help="--measure: the heads")
    args = ap.parse_args(argv)
    names = config_names(ap, args.configs)
    if args.sms < 1 or args.block_us <= 0 or args.start_us < 0 or args.tile_us < 0:
        ap.error("--sms and --block-us take positive values, --start-us and --tile-us values of at least 0")
    if args.measure:
        if args.tokens < 1 or args.heads < 1:
            ap.error("--tokens and --heads take positive values")
        if not torch.cuda.is_available():
            print("tools.fwd_schedule --measure times the forward: it needs a GPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        try:
            points = measured_points(device, args.tokens, args.heads, 128, args.sms)
        except ValueError as err:
            ap.error(str(err))
        args.start_us, args.block_us = fit_costs(points)
        print(f"On {torch.cuda.get_device_name(device)}, µs a wave by key blocks a list: "
              + ", ".join(f"{n}: {t:.2f}" for n, t in points)
              + f"; fitted: {args.start_us:.2f} µs a program's start, {args.block_us:.3f} µs a key block")
        if args.block_us <= 0:
            ap.error("the fitted key block's cost is not positive: time again (--tokens more)")
    print("The launch's modelled time over a persistent forward's (> 1: the persistent one is faster)")
    print("| config | tiles | key blocks a tile | launch µs (model) | static persistent | dynamic persistent |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        row = model_config(ALL_CONFIGS[name], args.sms, args.block_us, args.start_us, args.tile_us)
        print(f"| {row['config']} | {row['tiles']} | {row['mean_blocks']:.1f} | {row['launch_us']:.0f} | "
              f"{row['static']:.3f} | {row['dynamic']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
