"""Materialise the kernels' dropout keep mask, for tests and debugging (it is S x S per head: never on the
attention path, which regenerates it tile by tile)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dropout_keep


@triton.jit
def _keep_mask_kernel(SEED, OUT, seq_q, seq_k, dropout_p, BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    keep = dropout_keep(tl.load(SEED), bh, offs_m[:, None], offs_n[None, :], dropout_p)
    ptrs = OUT + bh.to(tl.int64) * seq_q * seq_k + offs_m[:, None] * seq_k + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m < seq_q)[:, None] & (offs_n < seq_k)[None, :])


def dropout_keep_mask(
    seed: torch.Tensor, batch: int, num_heads: int, seq_q: int, seq_k: int, dropout_p: float
) -> torch.Tensor:
    """bool ``[B, Hq, Sq, Sk]``: True where the kernels keep an attention weight for this seed."""
    out = torch.empty((batch, num_heads, seq_q, seq_k), dtype=torch.int8, device=seed.device)
    grid = (triton.cdiv(seq_q, 32), triton.cdiv(seq_k, 32), batch * num_heads)
    _keep_mask_kernel[grid](seed, out, seq_q, seq_k, dropout_p, BM=32, BN=32)
    return out.bool()
