"""`python -m mmsparse`: the seed's example end to end, on the GPU if there is one, else through the interpreter.

Prints the block mask as a picture, its density and skipped tiles, the errors of the output and of dq/dk/dv
against dense float64 attention, and the time. Exits 1 when an error exceeds the stated tolerance.

With --topology and --seg-lens it draws that mask instead (density and skipped tiles; nothing runs): pair types
0/1/2 (none, full, causal), any number of segments, packs of samples (--packed, one row of lengths per sample):

    python -m mmsparse --topology '[[1,1,0],[0,1,1],[1,0,1]]' --seg-lens 1024,8192,4096 --causal --tile 128
    python -m mmsparse --topology '[[2,0,0],[1,1,0],[1,1,2]]' --seg-lens '10,20,5;12,30,0' --packed --tile 16
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import time
from pathlib import Path

import torch

from . import TritonMBSAttnKernel, interpreter_active, reference_attention, reference_mask
from .attention.config import kernel_config
from .mask.topology import count_allowed_pairs
from .picture import TileMap, parse_tile, tile_map

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
SEED_LENS = (50, 375, 500)
README_TILE = (64, 32)  # the tile of the seed's picture in README.md (the bf16 forward tile at D=64 on a GPU)
# Largest relative L2 error against float64 accepted per dtype: the test suite's bounds for the same comparison.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _timeit(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _parse_topology(text: str) -> list:
    try:
        return ast.literal_eval(text)  # JSON's nested lists are Python literals too
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--topology must be a nested list such as '[[1,1,0],[0,1,1],[1,0,1]]'; got {text!r}") from e


def _parse_seg_lens(text: str) -> list[tuple[int, ...]]:
    """Rows of lengths: ``1024,8192,4096``, or ``10,20,5;12,30,0`` (one row per sample, for --packed)."""
    rows = []
    for part in text.split(";"):
        cells = [p.strip() for p in part.strip("()[] ").split(",") if p.strip()]
        if not cells or not all(c.isdigit() for c in cells):
            raise ValueError("--seg-lens must be comma-separated non-negative ints such as 1024,8192,4096, rows "
                             f"separated by ';' with --packed (10,20,5;12,30,0); got {text!r}")
        rows.append(tuple(int(c) for c in cells))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmsparse",
        description="Without --topology: run the seed example (cyclic topology, segments 50/375/500) forward and "
        "backward, compare it with float64 attention and exit 1 if an error exceeds the tolerance. With "
        "--topology and --seg-lens: draw that mask's tiles and report density and skipped tiles.",
    )
    parser.add_argument("--causal", action="store_true", help="combine the topology with a causal mask")
    parser.add_argument("--topology", help="k x k matrix of pair types as a nested list: 0 none, 1 full, 2 causal "
                        "(the keys at or before the query's position); any number of segments. E.g. "
                        "'[[1,1,0],[0,1,1],[1,0,1]]' or '[[2,0],[1,2]]'")
    parser.add_argument("--seg-lens", help="k segment lengths, comma-separated, e.g. 1024,8192,4096; with --packed "
                        "one row per sample, rows separated by ';', e.g. '10,20,5;12,30,0'")
    parser.add_argument("--packed", action="store_true", help="the rows of --seg-lens are samples packed end to "
                        "end, each seeing only itself (as mbs_attention_varlen takes them)")
    parser.add_argument("--tile", help="tile to draw, e.g. 128 or 128x64 (default: 128 for --topology; the "
                        "forward kernel's tile for the seed example)")
    parser.add_argument("--width", type=int, default=64, help="most characters per line of the picture "
                        "(larger maps are downsampled; default 64)")
    parser.add_argument("--png", type=Path, help="also write the tiles as a PNG here (needs matplotlib)")
    parser.add_argument("--window", type=int, help="a sliding window with --topology: keys at positions greater "
                        "than the query's minus WINDOW only")
    return parser


def draw(args: argparse.Namespace, tiles: TileMap, topology: list, seg_lens: list[tuple[int, ...]]) -> int:
    """Draw a user's topology: picture, density and tile counts. Builds no S x S tensor and runs no kernel."""
    k = len(topology)
    topo = str(topology) if k <= 8 else f"of {k} x {k} pair types"
    if args.packed:
        lens = f"{len(seg_lens)} samples packed" if len(seg_lens) > 4 else f"packed seg_lens {seg_lens}"
    else:
        lens = f"seg_lens {seg_lens[0]}" if k <= 8 else f"{k} segments"
    window = "" if args.window is None else f", window={args.window}"
    print(f"topology {topo}, {lens} (S = {tiles.seq_len}), causal={args.causal}{window}")
    return _show(tiles, args)


def _show(tiles: TileMap, args: argparse.Namespace) -> int:
    print(tiles.picture(args.width))
    print(tiles.summary())
    if args.png is not None:
        try:
            print(f"PNG: {tiles.save_png(args.png)}")
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


def run_seed_example(args: argparse.Namespace, tile: tuple[int, int] | None) -> int:
    """The seed example forward and backward against float64 attention; 0 when every error is within TOLERANCE."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    batch, heads, head_dim, dtype = (8, 16, 64, torch.bfloat16) if on_gpu else (1, 1, 16, torch.float32)
    seq = sum(SEED_LENS)
    where = torch.cuda.get_device_name() if on_gpu else "CPU through Triton's interpreter"
    print(f"mmsparse demo: topology {CYCLIC}, segments (text, vision, audio) = {SEED_LENS}, causal={args.causal}")
    print(f"device: {where}; B={batch} H={heads} S={seq} D={head_dim} {str(dtype)[6:]}")
    if not on_gpu and not interpreter_active():
        print("error: no CUDA device and Triton's interpreter is off: run with TRITON_INTERPRET=1 in the "
              "environment", file=sys.stderr)
        return 1

    attn = TritonMBSAttnKernel(CYCLIC, SEED_LENS, causal_mask=args.causal, names=("text", "vision", "audio"))
    if tile is None:
        fwd = kernel_config(head_dim, dtype, device).fwd
        tile = (fwd.block_m, fwd.block_n)
        if tile != README_TILE:  # a reader compares this picture with the README's
            print(f"tiles: {tile[0]}x{tile[1]}, this device's forward tile for D={head_dim} {str(dtype)[6:]}; "
                  f"README.md shows the seed at {README_TILE[0]}x{README_TILE[1]} (a GPU's): "
                  f"--tile {README_TILE[0]}x{README_TILE[1]} draws that")
    live, full = (t[0].cpu() for t in attn._info(seq, seq, device).classes(*tile))
    density = count_allowed_pairs(CYCLIC, SEED_LENS, causal=args.causal) / seq**2
    print()
    if _show(TileMap(live, full, tile, seq, density), args):
        return 1

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, dtype).requires_grad_()
               for _ in range(3))
    start = time.perf_counter()
    out = attn(q, k, v)
    grad_out = torch.randn(out.shape, generator=gen).to(device, dtype)
    out.backward(grad_out)
    first_ms = (time.perf_counter() - start) * 1e3
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, reference_mask(CYCLIC, SEED_LENS, seq, causal=args.causal))
    ref.backward(grad_out.double())
    tol = TOLERANCE[dtype]
    print(f"\nerror vs dense float64 attention (relative L2; tolerance {tol:.0e} for {str(dtype)[6:]}):")
    failed = []
    for name, a, e in (("out", out, ref), ("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        rel = ((a.double() - e).norm() / e.norm()).item()
        ok = rel <= tol  # NaN fails too
        failed += [] if ok else [name]
        print(f"  {name}: {rel:.2e}{'' if ok else '  > tolerance'}")

    if on_gpu:
        with torch.no_grad():
            fwd_ms = _timeit(lambda: attn(q, k, v), device, 50)
        both_ms = _timeit(lambda: attn(q, k, v).backward(grad_out), device, 50)
        print(f"\ntime: forward {fwd_ms:.3f} ms, forward+backward {both_ms:.3f} ms (mean of 50 after warm-up)")
    else:
        print(f"\ntime: forward+backward {first_ms / 1e3:.1f} s through the interpreter (a functional check, "
              "not a speed figure)")
    if failed:
        print(f"FAILED: {', '.join(failed)} beyond the tolerance {tol:.0e}", file=sys.stderr)
        return 1
    print(f"ok: every error within {tol:.0e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.topology is None) != (args.seg_lens is None):
        parser.error("--topology and --seg-lens go together (the k lengths of the k segments)")
    if args.window is not None and args.topology is None:
        parser.error("--window goes with --topology and --seg-lens (it draws that mask under the window)")
    if args.packed and args.topology is None:
        parser.error("--packed goes with --topology and --seg-lens (it draws the rows of --seg-lens as samples "
                     "packed end to end)")
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:  # before drawing, not after
        parser.error("--png needs matplotlib: pip install matplotlib (or mmsparse[examples]), or leave out --png")
    if args.width < 1:
        parser.error(f"--width must be at least 1; got {args.width}")
    try:  # only the user's arguments: errors of the run itself keep their traceback
        tile = parse_tile(args.tile) if args.tile else None
        if args.topology is not None:
            topology, seg_lens = _parse_topology(args.topology), _parse_seg_lens(args.seg_lens)
            if len(seg_lens) > 1 and not args.packed:
                raise ValueError(f"--seg-lens has {len(seg_lens)} rows (separated by ';'): add --packed to draw them "
                                 "as samples packed end to end")
            tiles = tile_map(topology, seg_lens if args.packed else seg_lens[0], tile or 128, causal=args.causal,
                             packed=args.packed, window=args.window)
    except (TypeError, ValueError) as e:
        parser.error(str(e))  # exits 2 with the usage line
    if args.topology is not None:
        return draw(args, tiles, topology, seg_lens)
    return run_seed_example(args, tile)


if __name__ == "__main__":
    sys.exit(main())
