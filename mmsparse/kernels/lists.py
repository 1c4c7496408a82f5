"""How the attention kernels of both dialects read a block list (``mmsparse.mask.blocks.BlockLists``). A Gluon kernel
that calls this ``triton.jit`` function compiles it with Gluon's semantics, as it does the mask rule."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visit_slot(it, n_full, n_total, DESCENDING: tl.constexpr):
    """The list slot a program visits at its step ``it``: the list's own order (full blocks, then partial ones,
    each ascending), or with ``DESCENDING`` its full blocks from the last to the first, then its partial ones
    likewise (steps below n_full stay full blocks). The ordered one-pass backward visits its query blocks
    descending: under a causal mask every key block reaching a query block then reaches it at the same step, so
    its wait for the lower key blocks' adds there is short (ascending, key block n would reach it n steps after
    key block 0)."""
    slot = it
    if DESCENDING:
        if it < n_full:
            slot = n_full - 1 - it
        else:
            slot = n_total + n_full - 1 - it
    return slot


@triton.jit
def block_id(idx_ptr, it):
    """Entry ``it`` of a block list, as int32: packed lists hold int16 ids up to 32,767 blocks."""
    return tl.load(idx_ptr + it).to(tl.int32)
