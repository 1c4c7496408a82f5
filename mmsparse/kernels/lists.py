"""How the attention kernels of both dialects read a block list (``mmsparse.mask.blocks.BlockLists``). A Gluon kernel
that calls this ``triton.jit`` function compiles it with Gluon's semantics, as it does the mask rule."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_id(idx_ptr, it):
    """Entry ``it`` of a block list, as int32: packed lists hold int16 ids up to 32,767 blocks."""
    return tl.load(idx_ptr + it).to(tl.int32)
