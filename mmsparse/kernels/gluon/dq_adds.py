"""The dQ-writer backward's dQ matmul (``gluon.bwd_dq_writer``): a key block's contribution dQ = dS K to one query
block, over both MMA warpgroups' keys.

Each MMA warpgroup stages its dS^T (its 64 keys x BM queries) in a shared tile of its own; once both are staged,
warpgroup w computes columns [w D/2, (w + 1) D/2) of dQ over all 128 keys (A: the staged tiles seen transposed, B:
column slices of the K tiles already in shared memory). Split by columns, each dQ element is added once per key
block (not once per warpgroup), and a warpgroup holds half of dQ's accumulator.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma


@gluon.jit
def issue_dq(ds_smem, k_smem, BM: gl.constexpr, COL0: gl.constexpr, N: gl.constexpr, first=0):
    """Issue columns COL0 .. COL0 + N - 1 of the block's dQ = dS_0 K_0 + dS_1 K_1 (``[BM, N]`` fp32, asynchronous)
    over both warpgroups' keys: A is each staged dS^T seen transposed, B a column slice of that warpgroup's K.
    ``first``: the index of warpgroup 0's tiles, 0 (``common.opaque_zero()`` inside a loop: the tiles' descriptors
    are then made where they are used)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    zero = gl.zeros([BM, N], gl.float32, layout)
    dq = warpgroup_mma(ds_smem.index(first).permute((1, 0)), k_smem.index(first).slice(COL0, N, dim=1), zero,
                       use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(first + 1).permute((1, 0)), k_smem.index(first + 1).slice(COL0, N, dim=1), dq,
                         is_async=True)
