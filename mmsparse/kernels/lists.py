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


# The bytes of the rows a section of heads reads that L2 should hold at once (FlashAttention-3's tile scheduler
# keeps 32 MB of an H100's 50 MB for K and V).
_L2_BYTES = tl.constexpr(32 << 20)


@triton.jit
def heads_in_l2(rows, ROW_BYTES: tl.constexpr):
    """How many heads at a time keep the rows every program of a head reads (``rows`` of ``ROW_BYTES`` each: K and
    V for the forward and the dQ pass, a group's Q and dO for the dK/dV pass) within L2's share: at least 1."""
    return tl.maximum((_L2_BYTES // ROW_BYTES) // tl.maximum(rows, 1), 1)


@triton.jit
def ordered_program(COUNTS, blk, bh, n_blocks, heads, stride_cnt_b, section):
    """``(row block, batch * head)`` of the program at ``(blk, bh)`` of an ``[n_blocks, B * heads]`` grid, in launch
    order (``blk`` fastest), longest list first (:mod:`mmsparse.mask.list_order`). Each sample's heads (``heads``;
    all of the batch's where the lists are shared, ``stride_cnt_b`` 0) go ``section`` at a time
    (:func:`heads_in_l2`): within a section the programs take the sample's rows in the order its counts' fourth
    words give, each row for every head of the section in turn."""
    per_sample = heads
    if stride_cnt_b == 0:
        per_sample = tl.num_programs(1)
    linear = blk + bh * n_blocks
    sample = linear // (n_blocks * per_sample)
    rest = linear - sample * (n_blocks * per_sample)
    first = rest // (n_blocks * section) * section  # the section's first head
    width = tl.minimum(section, per_sample - first)
    in_section = rest - first * n_blocks
    slot = COUNTS + sample.to(tl.int64) * stride_cnt_b + (in_section // width) * WORDS_PER_ROW
    return tl.load(slot + 3), sample * per_sample + first + in_section % width
