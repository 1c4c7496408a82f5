"""tl kernel that materialises the dropout keep mask (tests and debugging)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import dropout_keep, load_seed


@triton.jit(do_not_specialize=["bh0", "row0", "seq_q", "seq_k"])
def dropout_keep_mask_kernel(SEED, OUT, Q_START, bh0, row0, seq_q, seq_k, dropout_p, NUM_HEADS: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr):
    """Program (i, j, r) writes tile (i, j) of the keep mask of (batch * head) bh0 + r, query rows row0 + ..."""
    pid_m, pid_n, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = bh0 + pid_bh
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    q_start = tl.load(Q_START + bh // NUM_HEADS)
    keep = dropout_keep(load_seed(SEED), bh, q_start + row0 + offs_m[:, None], offs_n[None, :], dropout_p)
    # 64-bit: Sq * Sk passes 2^31 from 46341 tokens on
    ptrs = OUT + pid_bh.to(tl.int64) * seq_q * seq_k + offs_m.to(tl.int64)[:, None] * seq_k + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m < seq_q)[:, None] & (offs_n < seq_k)[None, :])
