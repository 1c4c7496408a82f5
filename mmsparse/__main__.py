"""`python -m mmsparse`: the seed's example end to end, on the GPU if there is one, else through the interpreter.

Prints the block mask as a picture, its density and skipped tiles, the errors of the output and of dq/dk/dv
against dense float64 attention, and the time.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import TritonMBSAttnKernel, interpreter_active, reference_attention, reference_mask
from .ops.config import kernel_config
from .topology import count_allowed_pairs

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
SEED_LENS = (50, 375, 500)


def block_picture(live: torch.Tensor, full: torch.Tensor, max_side: int = 48) -> str:
    """One character per tile: '#' full (no mask needed), '+' partial (exact mask), '.' skipped."""
    step = max(1, -(-live.shape[0] // max_side))
    rows = []
    for i in range(0, live.shape[0], step):
        row = ""
        for j in range(0, live.shape[1], step):
            lv, fl = live[i : i + step, j : j + step], full[i : i + step, j : j + step]
            row += "#" if bool(fl.all()) else "+" if bool(lv.any()) else "."
        rows.append(row)
    return "\n".join(rows)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--causal", action="store_true", help="combine the topology with a causal mask")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    batch, heads, head_dim, dtype = (8, 16, 64, torch.bfloat16) if on_gpu else (1, 1, 16, torch.float32)
    seq = sum(SEED_LENS)
    where = torch.cuda.get_device_name() if on_gpu else "CPU through Triton's interpreter"
    print(f"mmsparse demo: topology {CYCLIC}, segments (text, vision, audio) = {SEED_LENS}, causal={args.causal}")
    print(f"device: {where}; B={batch} H={heads} S={seq} D={head_dim} {str(dtype)[6:]}")
    if not on_gpu:
        assert interpreter_active(), "no GPU and no interpreter: set TRITON_INTERPRET=1"

    attn = TritonMBSAttnKernel(CYCLIC, SEED_LENS, causal_mask=args.causal, names=("text", "vision", "audio"))
    tile = kernel_config(head_dim, dtype, device).fwd
    info = attn._info(seq, seq, device)
    live, full = (t[0].cpu() for t in info.classes(tile.block_m, tile.block_n))
    print(f"\nblock mask at {tile.block_m}x{tile.block_n} tiles ('#' full, '+' partial, '.' skipped):")
    print(block_picture(live, full))
    pairs = count_allowed_pairs(CYCLIC, SEED_LENS, causal=args.causal)
    print(f"\ndensity {pairs / seq**2:.3f} of token pairs; tiles: {int(full.sum())} full, {int((live & ~full).sum())} "
          f"partial, {int((~live).sum())} skipped ({(~live).float().mean().item():.1%})")

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
    print("\nerror vs dense float64 attention (relative L2):")
    for name, a, e in (("out", out, ref), ("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        rel = ((a.double() - e).norm() / e.norm()).item()
        print(f"  {name}: {rel:.2e}")

    if on_gpu:
        with torch.no_grad():
            fwd_ms = _timeit(lambda: attn(q, k, v), device, 50)
        both_ms = _timeit(lambda: attn(q, k, v).backward(grad_out), device, 50)
        print(f"\ntime: forward {fwd_ms:.3f} ms, forward+backward {both_ms:.3f} ms (mean of 50 after warm-up)")
    else:
        print(f"\ntime: forward+backward {first_ms / 1e3:.1f} s through the interpreter (a functional check, "
              "not a speed figure)")

if __name__ == "__main__":
    main()
