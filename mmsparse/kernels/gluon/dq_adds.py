"""The one-pass dK/dV pass's dQ step (``gluon.dkdv`` with ``ONE_PASS``): the key block's contribution dQ = dS K
to one query block, added into the float32 dQ accumulator.

Each consumer warpgroup stages its dS^T (its 64 keys x BM queries, in registers as the A operand of dK += dS^T Q)
in a shared tile of its own; once both are staged, warpgroup w computes columns [w D/2, (w + 1) D/2) of dQ over all
128 keys (A: the staged tiles seen transposed, B: column slices of the K tiles already in shared memory), with the
numerics of the ``tl`` one-pass kernel's dQ (``tl.backward._dkdv_tiles``): dS rounded to the input dtype, the
product times the softmax scale. Split by columns, each dQ element is added once per key block (not once per
warpgroup), and a warpgroup holds half of dQ's accumulator.

A warpgroup stores its half (times the scale) in a float32 staging tile of its own and issues one TMA bulk
reduce-add of it (``cp.reduce.async.bulk.tensor``, FlashAttention-3's dQ writer) through a descriptor of the float32
dQ: the adds run in the TMA unit while the warpgroup goes on with the next step, and the warpgroup waits for the tile
to be read only before it stages the next step's dQ there.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma, warpgroup_mma

from .common import thread_barrier, tma_atomic_add


@gluon.jit
def stage_ds(dst, ds_w):
    """Store dS^T (``[keys, BM]``, the input dtype) in the warpgroup's tile ``ds_w``, visible to its wgmmas. No
    wgmma may still read ``ds_w``. Also wait until the warpgroup's last bulk reduce-add has read its dQ staging
    tile: the barrier that follows orders that wait (by the issuing thread) before every thread's next store into
    the tile, so the wait needs no barrier of its own."""
    ds_w.store(dst)
    fence_async_shared()  # the generic-proxy stores, before the async proxy (wgmma) reads them
    tma.store_wait(0)
    thread_barrier()  # every thread's part of the tile, before the warpgroup's wgmma reads all of it


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


@gluon.jit
def bulk_add_dq(dq, dq_stage, dq_desc, bh, row0, sm_scale, COL0: gl.constexpr):
    """Add ``dq * sm_scale`` (``[BM, N]``) into rows row0 .. row0 + BM - 1, columns COL0 .. COL0 + N - 1 of head
    ``bh`` (batch * Hq + head) of the float32 dQ behind ``dq_desc`` (``[B * Hq, Sq, D]``, ``[1, BM, N]`` boxes:
    rows past Sq and columns past D are dropped, per head; 32-bit coordinates, so no offset passes 2^31): staged
    in ``dq_stage``, this warpgroup's ``[BM, N]`` float32 tile, then one asynchronous TMA bulk reduce-add. No
    earlier reduce may still read ``dq_stage`` (:func:`stage_ds` waits)."""
    dq_stage.store(dq * sm_scale)
    fence_async_shared()  # the generic-proxy stores, before the async proxy (TMA) reads them
    thread_barrier()  # every thread's part of the tile, before the one thread that issues the reduce
    tma_atomic_add(dq_desc, [bh, row0, COL0], dq_stage.reshape([1, dq_stage.shape[0], dq_stage.shape[1]]))
