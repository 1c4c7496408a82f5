"""A CPU model of the Gluon forward's launch, to weigh a persistent forward before building it.

Today the forward launches a program (CTA) per (batch * head, query block), and an SM starts the next program in
launch order once one ends (one program an SM: the D=128 forward's stages take 224 KB of shared memory); each
program pays a start (launch, barrier inits, Q and the first K loads, on the matmuls' path) and its key blocks. A
persistent forward runs one program an SM over many tiles, loading a tile's first K/V under the last one's end:
- ``static``: program p takes tiles p, p + P, p + 2P, ... (no counter, but blind to the lists' lengths);
- ``dynamic``: the next tile goes to the first program free (a tile counter in global memory, reset each launch).

Each tile costs its list's length times ``--block-us`` plus ``--start-us`` (a launched program) or ``--tile-us``
(a tile of a persistent program). The lists and their order are the forward's own (the config's forward tile,
each sample's longest list first: ``kernels.lists.ordered_row``). Nothing else is modelled: not memory, not L2.

    python -m tools.fwd_schedule --configs mm13k_cyclic,mm13k_hub,transfusion_16k
    python -m tools.fwd_schedule --configs seed --sms 8 --start-us 4 --tile-us 1
"""

from __future__ import annotations

import argparse
import heapq

import torch

import mmsparse  # noqa: F401  (before triton: without CUDA it turns on Triton's interpreter)
from benchmarks.arguments import config_names
from benchmarks.configs import ALL_CONFIGS, BenchConfig
from mmsparse.attention.config import cuda_kernel_config
from mmsparse.mask.build import build_mask_info


def tile_lengths(cfg: BenchConfig) -> list[int]:
    """The key blocks of every forward tile of ``cfg`` in launch order: each (batch, query head)'s query blocks,
    longest list first (the lists of the config's first sample stand for every sample)."""
    seq = cfg.seq_k
    lens = [list(r) for r in cfg.seg_lens] if cfg.packed else list(cfg.seg_lens)
    info = build_mask_info([list(r) for r in cfg.topology], lens, seq, seq, cfg.causal, torch.device("cpu"),
                           packed=cfg.packed, window=cfg.window)
    sample_len = seq // len(cfg.seg_lens) if cfg.packed else None
    config = cuda_kernel_config(cfg.head_dim, torch.bfloat16)
    tile = config.forward_tile(seq, seq, sample_len)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fwd_schedule", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="mm13k_cyclic,mm13k_hub,mm13k_hub_causal,mm43k_cyclic,transfusion_16k",
                    help="comma-separated benchmark config names (benchmarks/configs.py)")
    ap.add_argument("--sms", type=int, default=132, help="programs running at once (an H200's multiprocessors)")
    ap.add_argument("--block-us", type=float, default=2.4, help="a key block's matmuls and softmax, µs")
    ap.add_argument("--start-us", type=float, default=3.0, help="a launched program's start, µs")
    ap.add_argument("--tile-us", type=float, default=1.0, help="a persistent program's cost a tile, µs")
    args = ap.parse_args(argv)
    names = config_names(ap, args.configs)
    if args.sms < 1 or args.block_us <= 0 or args.start_us < 0 or args.tile_us < 0:
        ap.error("--sms and --block-us take positive values, --start-us and --tile-us values of at least 0")
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
