"""How the attention kernels of both dialects read a block list (``mmsparse.mask.blocks.BlockLists``). A Gluon kernel
that calls this ``triton.jit`` function compiles it with Gluon's semantics, as it does the mask rule."""

from __future__ import annotations

import triton
import triton.language as tl

from .constants import COUNT_WORDS

WORDS_PER_ROW = tl.constexpr(COUNT_WORDS)  # of a list's counts: full, partial, start, the launch order's row


@triton.jit
def block_id(idx_ptr, it):
    """Entry ``it`` of a block list, as int32: packed lists hold int16 ids up to 32,767 blocks."""
    return tl.load(idx_ptr + it).to(tl.int32)


@triton.jit
def ordered_row(COUNTS, blk, b, stride_cnt_b):
    """The row block that program ``blk`` of batch ``b`` takes: the ``blk``-th longest list of the sample's
    (:mod:`mmsparse.mask.list_order`), from the fourth word of the counts' row ``blk`` (``stride_cnt_b`` 0: lists
    shared by the batch). A (batch, head)'s programs thus start their longest lists first; the heads keep their
    launch order, so the programs running at once read the K and V (or Q and dO) of as few heads as before."""
    return tl.load(COUNTS + b.to(tl.int64) * stride_cnt_b + blk * WORDS_PER_ROW + 3)
