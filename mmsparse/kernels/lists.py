"""How the attention kernels of both dialects read a block list (``mmsparse.mask.blocks.BlockLists``). A Gluon kernel
that calls this ``triton.jit`` function compiles it with Gluon's semantics, as it does the mask rule."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_id(idx_ptr, it):
    """Entry ``it`` of a block list, as int32: packed lists hold int16 ids up to 32,767 blocks."""
    return tl.load(idx_ptr + it).to(tl.int32)


@triton.jit
def ordered_program(ORDER, blk, bh, n_blocks, heads, shared):
    """``(row block, batch * head)`` of the program at ``(blk, bh)`` of an ``[n_blocks, B * heads]`` grid, longest
    list first (:mod:`mmsparse.mask.list_order`): the programs, in launch order (``blk`` fastest), take the entries
    of ``ORDER`` (``sample * n_blocks + row block``, longest list first) one after another, each for all of its
    heads in turn: ``heads`` of its sample, or every batch and head where the lists are ``shared`` by the batch."""
    per_entry = heads
    if shared:
        per_entry = tl.num_programs(1)
    linear = blk + bh * n_blocks
    entry = tl.load(ORDER + linear // per_entry)
    sample = entry // n_blocks
    return entry - sample * n_blocks, sample * per_entry + linear % per_entry
