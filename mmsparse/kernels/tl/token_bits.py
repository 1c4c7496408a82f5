"""tl kernel of the per-token row and column bits of a topology mask."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_lb", "seq_len"])
def token_bits_kernel(
    LENS, ROW_TABLE, COL_TABLE, ROW_BITS, COL_BITS, stride_lb, seq_len,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (b, i) writes the bits of tokens i*BLOCK .. i*BLOCK+BLOCK-1 of sample b. A token's segment is the
    number of segment ends at or before it (``searchsorted(ends, pos, right=True)``): zero-length segments are
    skipped, and tokens past the sample's total get K, the padding entry of the tables."""
    b, i = tl.program_id(0), tl.program_id(1)
    offs_t = tl.arange(0, KP)
    lens = tl.load(LENS + b * stride_lb + offs_t, mask=offs_t < K, other=0)
    ends = tl.cumsum(lens, 0)  # [KP]; the padded entries repeat the total
    pos = i * BLOCK + tl.arange(0, BLOCK)
    seg = tl.minimum(tl.sum((pos[:, None] >= ends[None, :]).to(tl.int32), 1), K)
    inside = pos < seq_len
    out = b.to(tl.int64) * seq_len + pos
    tl.store(ROW_BITS + out, tl.load(ROW_TABLE + seg), mask=inside)
    tl.store(COL_BITS + out, tl.load(COL_TABLE + seg), mask=inside)
