"""Sweep tile settings of the kernels on one GPU, side by side with FlexAttention; prints ms and TFLOP/s.

    python -m tools.tune_tiles [--configs mm13k_cyclic,mm13k_hub] [--sweep fwd|dkdv|dq|one_pass|none] [--profile]
    python -m tools.tune_tiles --configs vlm32k_d256 --sweep dkdv --tl   # the tl kernels, as on GPUs without Gluon

``--sweep one_pass`` times the one-pass backward (``deterministic=False``) at the table's tiles (on Hopper the Gluon
kernel at ``bwd_dkdv``) and the tl one-pass kernel at each ``bwd_one_pass`` tile, after the two-pass backward at the
table's tiles.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace

import torch

from benchmarks.arguments import config_names
from benchmarks.configs import ALL_CONFIGS
from benchmarks.flex_mask import flex_mask_mod, segment_ids
from mmsparse import mbs_attention  # before triton: without CUDA it turns on Triton's interpreter
from mmsparse.attention.config import Tile, cuda_kernel_config, head_dim_pad, kernel_config, use_config, use_tuning
from mmsparse.mask.topology import count_allowed_pairs


def flex_times(q, k, v, topo, lens, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    mask_mod = flex_mask_mod(topo, segment_ids(lens, q.shape[2], q.device)[0], causal)
    s = q.shape[2]
    bm = create_block_mask(mask_mod, None, None, s, s, device=q.device)
    fn = torch.compile(flex_attention)
    gqa = q.shape[1] != k.shape[1]
    fwd = do_bench(lambda: fn(q, k, v, block_mask=bm, enable_gqa=gqa), return_mode="median")
    g = torch.randn_like(q)
    both = do_bench(lambda: fn(q, k, v, block_mask=bm, enable_gqa=gqa).backward(g), return_mode="median")
    return fwd, both - fwd


def ours(q, k, v, topo, lens, causal):
    from triton.testing import do_bench

    fwd = do_bench(lambda: mbs_attention(q, k, v, topo, lens, causal=causal), return_mode="median")
    g = torch.randn_like(q)
    both = do_bench(lambda: mbs_attention(q, k, v, topo, lens, causal=causal).backward(g), return_mode="median")
    return fwd, both - fwd


def profile_kernels(q, k, v, topo, lens, causal) -> None:
    g = torch.randn_like(q)
    for _ in range(3):
        mbs_attention(q, k, v, topo, lens, causal=causal).backward(g)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            mbs_attention(q, k, v, topo, lens, causal=causal).backward(g)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


SWEEPS = ("fwd", "dkdv", "dq", "one_pass", "none")
# Past D=128 a tl backward tile's accumulators fill the registers: these spilled least of those compiled for sm_90
# (ptxas's report), beside the 4-warp tiles the table had before.
WIDE_DKDV = [Tile(32, 64, 4, 1), Tile(16, 64, 8, 2), Tile(16, 64, 8, 3), Tile(32, 64, 8, 2), Tile(32, 64, 8, 3),
             Tile(64, 64, 8, 2)]
WIDE_DQ = [Tile(64, 32, 4, 1), Tile(64, 32, 4, 2), Tile(64, 32, 8, 2), Tile(64, 64, 8, 2), Tile(128, 32, 8, 2),
           Tile(128, 64, 8, 2)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.tune_tiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="mm13k_cyclic,mm13k_hub")
    ap.add_argument("--sweep", default="fwd", choices=SWEEPS, help="the pass whose tiles are swept (default fwd)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of one fwd+bwd (torch profiler)")
    ap.add_argument("--tl", action="store_true", help="start from the table without the Gluon kernels (other GPUs')")
    args = ap.parse_args(argv)
    names = config_names(ap, args.configs)
    # Its calls, Flex's mask and its pair count take one row of lengths, no window: a config with a window or packed
    # samples would be timed on another mask than its own.
    other_masks = [n for n in names if ALL_CONFIGS[n].window is not None or ALL_CONFIGS[n].packed]
    if other_masks:
        ap.error(f"--configs {','.join(other_masks)}: a sliding window or packed samples, which this tool does not "
                 "apply; time them with python -m benchmarks --configs NAME")
    if not torch.cuda.is_available():
        print("python -m tools.tune_tiles needs a CUDA GPU (it times the kernels' tiles); there is none here",
              file=sys.stderr)
        return 2
    for name in names:
        c = ALL_CONFIGS[name]
        b, h, hk, d, lens, causal = c.batch, c.heads_q, c.heads_kv, c.head_dim, c.seg_lens, c.causal
        topo = [list(row) for row in c.topology]
        s = sum(lens)
        q, k, v = (torch.randn(b, hh, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for hh in (h, hk, hk))
        flops = 4 * b * h * d * count_allowed_pairs(topo, lens, causal)

        def tf(ms: float, mult: float = 1.0, flops: int = flops) -> float:
            return flops * mult / ms / 1e9

        try:
            if args.no_flex:
                raise RuntimeError("skipped")
            ff, fb = flex_times(q, k, v, topo, lens, causal)
            print(f"{name:18s} flex  fwd {ff:7.3f} ms {tf(ff):6.0f} TF/s  bwd {fb:7.3f} ms {tf(fb, 2.5):6.0f}")
        except Exception as e:  # noqa: BLE001
            print(f"{name} flex failed: {e!r}"[:300])
        if args.tl:  # this GPU's own tl table: its TMA and the shared memory a block of it may take
            props = torch.cuda.get_device_properties(q.device)
            base = cuda_kernel_config(d, torch.bfloat16, (props.major, props.minor), gluon=False,
                                      shared_bytes=getattr(props, "shared_memory_per_block_optin", None))
        else:
            base = kernel_config(d, torch.bfloat16, q.device)
        wide = head_dim_pad(d) > 128
        if args.profile:
            profile_kernels(q, k, v, topo, lens, causal)
        variants = [base]
        variants.append(replace(base, use_tma=False))
        if args.sweep == "fwd":
            for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
                variants.append(replace(base, fwd=Tile(bm, bn, w, st), fwd_short=None))
        elif args.sweep == "dkdv":
            tiles = WIDE_DKDV if wide else [Tile(*t) for t in itertools.product((32, 64), (32, 64, 128), (4, 8),
                                                                               (2, 3, 4))]
            variants += [replace(base, bwd_dkdv=tile) for tile in tiles]
        elif args.sweep == "dq":
            tiles = WIDE_DQ if wide else [Tile(*t) for t in itertools.product((64, 128), (32, 64), (4, 8), (2, 3, 4))]
            variants += [replace(base, bwd_dq=tile, bwd_dq_short=None) for tile in tiles]
        one_pass = args.sweep == "one_pass"
        if one_pass:
            variants.append(base)  # the one-pass backward at the table's tile (the dQ writer's where it runs)
            tl_dkdv = replace(base.bwd_dkdv, gluon_stages=0)  # so that the plan runs the tl one-pass kernel
            for bm, bn, w, st in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
                variants.append(replace(base, bwd_one_pass=Tile(bm, bn, w, st), bwd_dkdv=tl_dkdv))
        for i, cfg in enumerate(variants):
            deterministic = not one_pass or i < 2  # the first two: the two-pass backward, with and without TMA
            try:
                with use_tuning(cfg), use_config(deterministic=deterministic):
                    f, bw = ours(q, k, v, topo, lens, causal)
                kernel = "gluon dq-writer" if cfg.one_pass_runs_dq_writer() else "tl"
                bwd_tiles = (f"dkdv{cfg.bwd_dkdv} dq{cfg.bwd_dq}" if deterministic
                             else f"one-pass {kernel}{cfg.one_pass_kernel_tile()}")
                print(f"{name:18s} tma={cfg.use_tma} fwd{cfg.fwd} {bwd_tiles}: "
                      f"fwd {f:7.3f} ms {tf(f):6.0f}  bwd {bw:7.3f} ms {tf(bw, 2.5):6.0f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {cfg}: failed {e!r}"[:300], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
