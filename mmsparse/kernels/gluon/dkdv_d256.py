"""Hopper dK/dV pass in Gluon at head dims 129-256 (padded to 256): 64 keys a CTA, dV in one consumer warpgroup and
dK in the other.

At D=256 a warpgroup cannot hold dK and dV of its own 64 keys (two 64 x 256 fp32 accumulators: 256 registers a
thread, over the 240 a consumer gets), which is how ``gluon.dkdv`` splits the work at D <= 128. Here one CTA owns 64
keys, and the four matmuls of a query block (BM rows) are split by what they feed:

- the scores warpgroup (0) computes S^T = K Q^T (64 keys x BM queries over the full head dim) and P^T from it,
  stages P^T in float32 for the other warpgroup, and adds dV += P^T dO (64 x 256: 128 registers);
- the gradients warpgroup (1) computes dP^T = V dO^T, reads the staged P^T, forms dS^T = P^T (dP^T - delta) and adds
  dK += dS^T Q (64 x 256).

Each warpgroup issues half of the tensor-core work (a 64 x BM x 256 product, then a 64 x 256 x BM one), every wgmma
is at least 64 x 64 (FlashAttention-3 at hdim 256 splits S and dP between its warpgroups by key columns, n = 40, and
dK/dV by head-dim halves), both dK/dV products read their A operand from registers and their B operand (dO or Q)
whole, and a step hands over one tile (P^T, 16 KB). The exponentials (64 x BM a step) are small next to the
4 x 64 x BM x 256 multiply-adds, so one warpgroup does them all; warpgroup 1 runs a little behind warpgroup 0, so
each one's elementwise work overlaps the other's matmuls.

Every wgmma a warpgroup issues in a step is waited for within that step (a wgmma in flight across the loop's back
edge makes ptxas serialize them all, C7512), so each releases a stage of Q and dO at the end of its step: 2 stages of
64 query rows (128 KB) fit beside K and V (64 KB) and the P^T tile, and the producer has a whole step to refill one.

A one-warp producer streams Q and dO (TMA) and the lse, delta, query indices and (partial blocks) query bits through
the stages, as in ``gluon.dkdv``, and stores dK and dV at the end. The numerics are the ``tl`` dK/dV kernel's
(``tl.backward._dkdv_tiles``): p = exp2(s * scale - lse) in float32 with the exact token mask in partial blocks (as
the initial value of S^T, as in ``gluon.dkdv``), dV += p rounded to the input dtype times dO, dS = p (dP - delta) in
float32 rounded to the input dtype, dK scaled by the softmax scale at the end. No dropout and no one-pass variant:
those stay with the ``tl`` kernel. Called only where ``mmsparse.attention.dispatch.hopper_gluon_available`` allows,
like the other Gluon passes.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..constants import DYNAMIC_ARGS, MASK_DENSE
from .common import (
    WORKER_WARPS,
    box,
    invalidate_ring,
    next_entry,
    resident_tile,
    scores_init,
    thread_barrier,
    tma_load,
    tma_store,
)
from .dkdv_rows import allocate_query_stages, key_block_lists, stage_query_blocks

_MASK_DENSE = gl.constexpr(MASK_DENSE)
# Registers a thread of warpgroup 1 and of the producer. Triton gives warpgroup 0 (the default partition) what the
# launch's 168 a thread over three warpgroups (the producer's padded to one) leave: 3 x 168 - 216 - 40 = 248, the
# same total as common.WORKER_REGS. Measured with Triton 3.6's and 3.9's ptxas: warpgroup 0 (dV, S^T and the mask of
# a partial block: a pair-table load per element with segment codes) compiles without spilling at 232, warpgroup 1
# at 200 (it spilled at 192); the producer, which issues 8 TMA copies of 128-byte-wide boxes a step beside its row
# loads, spilled in its loop at WORKER_REGS' 24.
_REGS = gl.constexpr([216, 40])
BLOCK_N = 64  # keys per CTA: one m64 wgmma of S^T and dP^T
_KEYS = gl.constexpr(BLOCK_N)
# The hand-over of P^T (``xbars``): staged by warpgroup 0, read by warpgroup 1.
_P_FULL, _P_EMPTY = gl.constexpr(0), gl.constexpr(1)
_HAND_OVERS = gl.constexpr(2)


@gluon.jit
def _producer(LSE, DELTA, descs, buffers, barriers, idx_ptr, n_full, n_total, col0, b, hk, mask_args,
              NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
              MASK_MODE: gl.constexpr):
    """K and V of the CTA's keys once, then Q and dO (TMA) and the lse, delta, query-index and (partial blocks)
    query-bit rows of every listed query block of every head of the group; dK and dV once both warpgroups have
    staged them in the K and V tiles."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem = buffers
    kv_bar, ready, empty, done, xbars = barriers
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descs
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, hk, col0, 0], kv_bar, box(k_smem.index(0)))
    tma_load(v_desc, [b, hk, col0, 0], kv_bar, box(v_smem.index(0)))
    stage_query_blocks(LSE, DELTA, q_desc, do_desc, (q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem),
                       ready, empty, idx_ptr, n_full, n_total, b, hk, q_bits_ptr, seq_q, NUM_HEADS, GROUP, BM, STAGES,
                       MASK_MODE)
    mbarrier.wait(done, 0)
    tma_store(dk_desc, [b, hk, col0, 0], box(k_smem.index(0)))
    tma_store(dv_desc, [b, hk, col0, 0], box(v_smem.index(0)))
    tma.store_wait(0)


@gluon.jit
def _scores_warpgroup(buffers, barriers, idx_ptr, n_full, n_total, col0, mask_args, qk_scale, GROUP: gl.constexpr,
                      HEAD_DIM_PAD: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr,
                      IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Warpgroup 0: S^T and P^T of every step, and dV. Step i issues S^T_i (onto the mask bias in a partial block),
    computes P^T_i, stages it once warpgroup 1 has read P^T_{i-1}, then adds dV += P^T_i dO_i."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem = buffers
    kv_bar, ready, empty, done, xbars = barriers
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype

    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    offs_n = col0 + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, st_layout))
    k_bits = offs_n  # a stand-in: only the bit and code masks read them
    if MASK_MODE != _MASK_DENSE:
        k_bits = gl.load(k_bits_ptr + offs_n, mask=offs_n < seq_k, other=0)
    dv = gl.zeros([_KEYS, HEAD_DIM_PAD], gl.float32, acc_layout)
    st_zero = gl.zeros([_KEYS, BM], gl.float32, st_layout)
    total = GROUP * n_total
    it = -1  # next_entry's predecessor of entry 0
    mbarrier.wait(kv_bar, 0)
    for i in range(total):
        stage = i % STAGES
        it = next_entry(it, n_total, GROUP)
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        st0, partial = scores_init(it, n_full, rows_smem.index(stage), qbits_smem.index(stage), offs_n, k_bits,
                                   mask_args, st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
        st = warpgroup_mma(resident_tile(k_smem, 0, HEAD_DIM_PAD), q_smem.index(stage).permute((1, 0)), st0,
                           use_acc=partial, is_async=True)
        lse = lse_smem.index(stage).load(cols)
        st = warpgroup_mma_wait(0, deps=(st,))
        pt = gl.exp2(gl.fma(st, qk_scale, -gl.expand_dims(lse, 0)))  # explicit FMA, as the tl kernels
        mbarrier.wait(xbars.index(_P_EMPTY), (i & 1) ^ 1)  # a fresh barrier: step 0 waits for nothing
        pt_smem.store(pt)
        # Generic stores read by generic loads: the arrival (a warpgroup barrier, then one release) publishes them.
        mbarrier.arrive(xbars.index(_P_FULL))
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do_smem.index(stage), dv, is_async=True)
        dv, pt_op = warpgroup_mma_wait(0, deps=(dv, pt_op))
        mbarrier.arrive(empty.index(stage))
    if total > 0:
        # Warpgroup 1 reads P^T_{total-1} once its last dP^T, the last read of V, is done.
        mbarrier.wait(xbars.index(_P_EMPTY), (total - 1) & 1)
    v_smem.index(0).store(dv.to(dtype))  # V is read by warpgroup 1's dP^T only: stage dV there
    fence_async_shared()
    thread_barrier()  # every thread's stores and fence before the one arrival
    mbarrier.arrive(done)


@gluon.jit
def _grads_warpgroup(buffers, barriers, n_total, sm_scale, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                     BM: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup 1: dP^T and dS^T of every step, and dK. Step i issues dP^T_i, reads warpgroup 0's P^T_i once dP^T_i
    is done, forms dS^T_i and adds dK += dS^T_i Q_i (dS^T from registers)."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem = buffers
    kv_bar, ready, empty, done, xbars = barriers
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype

    dk = gl.zeros([_KEYS, HEAD_DIM_PAD], gl.float32, acc_layout)
    st_zero = gl.zeros([_KEYS, BM], gl.float32, st_layout)
    total = GROUP * n_total
    mbarrier.wait(kv_bar, 0)
    for i in range(total):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        dpt = warpgroup_mma(resident_tile(v_smem, 0, HEAD_DIM_PAD), do_smem.index(stage).permute((1, 0)), st_zero,
                            use_acc=False, is_async=True)
        delta = delta_smem.index(stage).load(cols)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        mbarrier.wait(xbars.index(_P_FULL), i & 1)
        pt = pt_smem.load(st_layout)
        mbarrier.arrive(xbars.index(_P_EMPTY))  # the loads are done: warpgroup 0 may stage P^T_{i+1}
        ds_op = gl.convert_layout((pt * (dpt - gl.expand_dims(delta, 0))).to(dtype), op_layout)
        dk = warpgroup_mma(ds_op, q_smem.index(stage), dk, is_async=True)
        dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
        mbarrier.arrive(empty.index(stage))
    # K is read by warpgroup 0's S^T only: its last one was done before warpgroup 0 staged the last P^T (waited for
    # above; with no step at all K is not read). Stage dK there.
    k_smem.index(0).store((dk * sm_scale).to(dtype))
    fence_async_shared()
    thread_barrier()  # every thread's stores and fence before the one arrival
    mbarrier.arrive(done)


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def attention_dkdv_d256_gluon(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, sm_scale,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
):
    """One CTA per (64-key block, batch * kv head); arguments as ``gluon.dkdv.attention_dkdv_gluon``'s without the
    one pass: Q, K, V, dO, dK and dV come as ``host_tma`` descriptors (``[1, 1, 64, HEAD_DIM_PAD]`` boxes for K, V,
    dK and dV; ``[1, 1, BM, HEAD_DIM_PAD]`` for Q and dO), lse and delta contiguous ``[B, Hq, Sq]``."""
    gl.static_assert(STAGES >= 2, "the producer refills a stage while the consumers work on the other")
    gl.static_assert(BM >= 64, "S^T and dP^T are one m64 wgmma over BM query columns; dK/dV's k is BM")
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, HEAD_DIM_PAD], dtype)
    b, hk, col0, n_full, n_total, idx_ptr, mask_args = key_block_lists(
        COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q,
        stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window, NUM_KV_HEADS, _KEYS)

    # [1, keys, D]: resident_tile indexes them through an opaque zero, so their descriptors are not hoisted
    k_smem = gl.allocate_shared_memory(dtype, [1, _KEYS, HEAD_DIM_PAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, _KEYS, HEAD_DIM_PAD], kv_layout)
    q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = allocate_query_stages(
        dtype, STAGES, BM, HEAD_DIM_PAD, MASK_MODE)
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, BM], gl.float32)
    pt_smem = gl.allocate_shared_memory(gl.float32, [_KEYS, BM], pt_layout)  # P^T, warpgroup 0 -> 1
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    xbars = gl.allocate_shared_memory(gl.int64, [_HAND_OVERS, 1], bar_layout)  # _P_FULL, _P_EMPTY
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)  # warpgroup 0 has staged dV, warpgroup 1 dK
    for j in gl.static_range(_HAND_OVERS):
        mbarrier.init(xbars.index(j), count=1)  # one warpgroup arrives at each
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem)
    barriers = (kv_bar, ready, empty, done, xbars)
    gl.warp_specialize(
        [
            (_scores_warpgroup, (buffers, barriers, idx_ptr, n_full, n_total, col0, mask_args, qk_scale, GROUP,
                                 HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW)),
            (_grads_warpgroup, (buffers, barriers, n_total, sm_scale, GROUP, HEAD_DIM_PAD, BM, STAGES)),
            (_producer, (LSE, DELTA, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc), buffers, barriers, idx_ptr,
                         n_full, n_total, col0, b, hk, mask_args, NUM_HEADS, GROUP, BM, STAGES, MASK_MODE)),
        ],
        WORKER_WARPS,
        _REGS,
    )
    # Every partition has returned: no barrier is waited on or signalled again.
    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(done)
    invalidate_ring(xbars, _HAND_OVERS)
    invalidate_ring(ready, STAGES)
    invalidate_ring(empty, STAGES)
