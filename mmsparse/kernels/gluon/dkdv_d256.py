"""Hopper dK/dV pass in Gluon at head dims 129-256 (padded to 256): 64 keys a CTA, the head dim split between the
two consumer warpgroups.

At D=256 a warpgroup cannot hold dK and dV of its own 64 keys (two 64 x 256 fp32 accumulators: 256 registers a
thread, over the 240 a consumer gets), which is how ``gluon.dkdv`` splits the work at D <= 128. Here one CTA owns
64 keys and warpgroup w owns columns [w D/2, (w + 1) D/2) of their dK and dV (2 x 64 x 128 fp32: 128 registers).
The four matmuls of a query block are split so that each warpgroup issues half of the tensor-core work and every
wgmma is at least 64 x 64:

- the scores warpgroup (0) computes S^T = K Q^T (64 keys x BM queries, the full head dim) and P^T from it, stages
  P^T in float32 for the other warpgroup, and adds dV[:, :D/2] += P^T dO[:, :D/2] (P^T from registers) and
  dK[:, :D/2] += dS^T Q[:, :D/2] (dS^T staged by the other warpgroup);
- the gradients warpgroup (1) computes dP^T = V dO^T, reads the staged P^T, forms dS^T = P^T (dP^T - delta) and
  adds dK[:, D/2:] += dS^T Q[:, D/2:] and dV[:, D/2:] += P^T dO[:, D/2:] (both from registers), then stages dS^T
  for warpgroup 0.

FlashAttention-3 at hdim 256 splits S and dP between its warpgroups by key columns (n = 40) and transposes dK/dV
(dKV_swapAB) so that each warpgroup holds half of the head dim; giving each warpgroup a whole 64 x 64 S^T or dP^T
instead keeps every wgmma at n >= 64 and lets three of the four dK/dV matmuls read their A operand from registers,
for one float32 hand-over of P^T (16 KB) a step. The exponentials (64 x BM per step) are small next to the 4 x 64 x
BM x 256 multiply-adds, so having one warpgroup do them all costs little.

Warpgroup 0 adds dK += dS^T_{i-1} Q_{i-1} of the previous step in step i, just before S^T_i (dS^T_{i-1} comes from
warpgroup 1 late in step i-1); every wgmma a warpgroup issues in a step is waited for within that step (a wgmma in
flight across the loop's back edge makes ptxas serialize them all, C7512). A stage of Q and dO is thus held until
that dK is done, early in the next step: 2 stages of 64 query rows (128 KB) fit beside K and V (64 KB) and the
hand-over tiles (24 KB), and the producer gets most of a step to refill a stage. Issued after S^T_i instead, dK would
overlap warpgroup 0's exponentials but hold the stage until late in step i+1, leaving the producer a few hundred
cycles for 64 KB of loads.

A one-warp producer streams Q and dO (TMA) and the lse, delta, query indices and (partial blocks) query bits through
the stages, as in ``gluon.dkdv``, and stores dK and dV at the end. The numerics are the ``tl`` dK/dV kernel's
(``tl.backward._dkdv_tiles``): p = exp2(s * scale - lse) in float32 with the exact token mask in partial blocks (as
the initial value of S^T, as in ``gluon.dkdv``), dS = p (dP - delta) in float32 rounded to the input dtype, dK
scaled by the softmax scale at the end. No dropout and no one-pass variant: those stay with the ``tl`` kernel.
Called only where ``mmsparse.attention.dispatch.hopper_gluon_available`` allows, like the other Gluon passes.
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
from ..lists import block_id
from .common import (
    WORKER_WARPS,
    box,
    invalidate_ring,
    program_lists,
    resident_tile,
    scores_init,
    thread_barrier,
    tma_load,
    tma_store,
)

_MASK_DENSE = gl.constexpr(MASK_DENSE)
# Registers a thread of the second consumer warpgroup and of the producer (the first consumer gets the first's): the
# consumers compile without spilling down to 208; the producer issues 8 TMA copies of 128-byte-wide boxes a step
# beside its row loads and spilled in its loop at common.WORKER_REGS' 24. 2 x 128 x 232 + 32 x 40 = 60,672 of an
# SM's 64K: fewer than WORKER_REGS take (62,208).
_REGS = gl.constexpr([232, 40])
BLOCK_N = 64  # keys per CTA: one m64 wgmma of S^T and dP^T
_KEYS = gl.constexpr(BLOCK_N)
# The hand-over barriers (``xbars``): P^T_i staged by warpgroup 0; dS^T_i staged by warpgroup 1; dS^T_i read by
# warpgroup 0's dK. The P^T tile needs no "read" barrier: warpgroup 1 reads P^T_i before it stages dS^T_i, which
# warpgroup 0 waits for before it stages P^T_{i+1}.
_P_FULL, _DS_FULL, _DS_EMPTY = (gl.constexpr(j) for j in range(3))
_HAND_OVERS = gl.constexpr(3)


@gluon.jit
def _producer(LSE, DELTA, descs, buffers, barriers, idx_ptr, n_full, n_total, col0, b, hk, mask_args,
              NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
              MASK_MODE: gl.constexpr):
    """K and V of the CTA's keys once, then Q and dO (TMA) and the lse, delta, query-index and (partial blocks)
    query-bit rows of every listed query block of every head of the group; dK and dV once both warpgroups have
    staged them in the K and V tiles."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem, ds_smem = buffers
    kv_bar, ready, empty, done, xbars = barriers
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descs
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, hk, col0, 0], kv_bar, box(k_smem.index(0)))
    tma_load(v_desc, [b, hk, col0, 0], kv_bar, box(v_smem.index(0)))
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    for g in range(GROUP):
        h = hk * GROUP + g
        row0 = (b.to(gl.int64) * NUM_HEADS + h) * seq_q
        for it in range(n_total):
            i = g * n_total + it
            stage = i % STAGES
            m_blk = block_id(idx_ptr, it)
            offs_m = m_blk * BM + gl.arange(0, BM, layout=rows)
            # Rows past the end get lse = +inf, hence p = 0.
            lse = gl.load(LSE + row0 + offs_m, mask=offs_m < seq_q, other=float("inf"))
            delta = gl.load(DELTA + row0 + offs_m, mask=offs_m < seq_q, other=0.0)
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            lse_smem.index(stage).store(lse)
            delta_smem.index(stage).store(delta)
            rows_smem.index(stage).store(offs_m)
            if MASK_MODE != _MASK_DENSE:
                if it >= n_full:
                    # Rows past the end get no bits (code 0 is masked by the row bound), hence no allowed pair.
                    qbits_smem.index(stage).store(gl.load(q_bits_ptr + offs_m, mask=offs_m < seq_q, other=0))
            # The arrival (expect) releases these stores to the consumers, which acquire them with the wait on ready.
            mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma_load(q_desc, [b, h, m_blk * BM, 0], ready.index(stage), box(q_smem.index(stage)))
            tma_load(do_desc, [b, h, m_blk * BM, 0], ready.index(stage), box(do_smem.index(stage)))
    mbarrier.wait(done, 0)
    tma_store(dk_desc, [b, hk, col0, 0], box(k_smem.index(0)))
    tma_store(dv_desc, [b, hk, col0, 0], box(v_smem.index(0)))
    tma.store_wait(0)


@gluon.jit
def _probabilities_and_dv(st, lse, dv, do_s, pt_smem, xbars, qk_scale, op_layout: gl.constexpr, HALF: gl.constexpr):
    """P^T_i = exp2(S^T_i * scale - lse) (float32, ``[keys, BM]``), staged for warpgroup 1 (which has read P^T_{i-1}:
    the caller waited for dS^T_{i-1}), then dV[:, :D/2] += P^T_i dO_i[:, :D/2], drained."""
    pt = gl.exp2(gl.fma(st, qk_scale, -gl.expand_dims(lse, 0)))
    pt_smem.store(pt)
    # Generic stores read by generic loads: the arrival (a warpgroup barrier, then one release) publishes them.
    mbarrier.arrive(xbars.index(_P_FULL))
    pt_op = gl.convert_layout(pt.to(do_s.dtype), op_layout)
    dv = warpgroup_mma(pt_op, do_s.slice(0, HALF, dim=1), dv, is_async=True)
    dv, pt_op = warpgroup_mma_wait(0, deps=(dv, pt_op))
    return dv


@gluon.jit
def _scores_warpgroup(buffers, barriers, idx_ptr, n_full, n_total, col0, mask_args, qk_scale, sm_scale,
                      GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                      MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Warpgroup 0: S^T and P^T of every step, and columns [0, D/2) of dK and dV. Step i issues
    dK += dS^T_{i-1} Q_{i-1} (dS^T from warpgroup 1's tile), then S^T_i, releases stage i-1 once that dK is done,
    computes and stages P^T_i once S^T_i is, then issues dV += P^T_i dO_i and drains it before the next step."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem, ds_smem = buffers
    kv_bar, ready, empty, done, xbars = barriers
    HALF: gl.constexpr = HEAD_DIM_PAD // 2
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype

    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    offs_n = col0 + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, st_layout))
    k_bits = offs_n  # a stand-in: only the bit and code masks read them
    if MASK_MODE != _MASK_DENSE:
        k_bits = gl.load(k_bits_ptr + offs_n, mask=offs_n < seq_k, other=0)
    dk = gl.zeros([_KEYS, HALF], gl.float32, acc_layout)
    dv = gl.zeros([_KEYS, HALF], gl.float32, acc_layout)
    st_zero = gl.zeros([_KEYS, BM], gl.float32, st_layout)
    total = GROUP * n_total
    mbarrier.wait(kv_bar, 0)
    if total > 0:
        # Step 0: no dK of a previous step to issue.
        mbarrier.wait(ready.index(0), 0)
        st0, partial = scores_init(0, n_full, rows_smem.index(0), qbits_smem.index(0), offs_n, k_bits, mask_args,
                                   st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
        st = warpgroup_mma(resident_tile(k_smem, 0, HEAD_DIM_PAD), q_smem.index(0).permute((1, 0)), st0,
                           use_acc=partial, is_async=True)
        lse = lse_smem.index(0).load(cols)
        st = warpgroup_mma_wait(0, deps=(st,))
        dv = _probabilities_and_dv(st, lse, dv, do_smem.index(0), pt_smem, xbars, qk_scale, op_layout, HALF)
        for i in range(1, total):
            # Nothing in flight on entry. Stage i-1 (Q_{i-1} for dK_{i-1}) is held until dK_{i-1} is done.
            stage = i % STAGES
            prev = (i - 1) % STAGES
            it = i % n_total
            mbarrier.wait(xbars.index(_DS_FULL), (i - 1) & 1)  # dS^T_{i-1} is staged
            dk = warpgroup_mma(ds_smem, q_smem.index(prev).slice(0, HALF, dim=1), dk, is_async=True)
            # The token mask of a partial block (loads from global memory with codes or a dense mask) is built
            # while dK_{i-1} runs.
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            st0, partial = scores_init(it, n_full, rows_smem.index(stage), qbits_smem.index(stage), offs_n, k_bits,
                                       mask_args, st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
            st = warpgroup_mma(resident_tile(k_smem, 0, HEAD_DIM_PAD), q_smem.index(stage).permute((1, 0)), st0,
                               use_acc=partial, is_async=True)
            # wgmma groups complete in order: of dK_{i-1}, S^T_i, the first is done. The dS^T tile and stage i-1
            # are free (on this side).
            dk = warpgroup_mma_wait(1, deps=(dk,))
            mbarrier.arrive(xbars.index(_DS_EMPTY))
            mbarrier.arrive(empty.index(prev))
            lse = lse_smem.index(stage).load(cols)
            st = warpgroup_mma_wait(0, deps=(st,))
            dv = _probabilities_and_dv(st, lse, dv, do_smem.index(stage), pt_smem, xbars, qk_scale, op_layout, HALF)
        last = (total - 1) % STAGES
        mbarrier.wait(xbars.index(_DS_FULL), (total - 1) & 1)
        dk = warpgroup_mma(ds_smem, q_smem.index(last).slice(0, HALF, dim=1), dk, is_async=True)
        dk = warpgroup_mma_wait(0, deps=(dk,))
        mbarrier.arrive(empty.index(last))
    # K is read by this warpgroup's S^T only, V by warpgroup 1's dP^T, whose last one was done before warpgroup 1
    # staged the last dS^T (waited for above; with no step at all neither is read): stage dK and dV there.
    k_smem.index(0).slice(0, HALF, dim=1).store((dk * sm_scale).to(dtype))
    v_smem.index(0).slice(0, HALF, dim=1).store(dv.to(dtype))
    fence_async_shared()
    thread_barrier()  # every thread's stores and fence before the one arrival
    mbarrier.arrive(done)


@gluon.jit
def _grads_warpgroup(buffers, barriers, n_total, sm_scale, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                     BM: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup 1: dP^T and dS^T of every step, and columns [D/2, D) of dK and dV. Step i issues dP^T_i, reads
    warpgroup 0's P^T_i once dP^T_i is done, forms dS^T_i, issues dK += dS^T_i Q_i and dV += P^T_i dO_i (both from
    registers), stages dS^T_i for warpgroup 0 while they run, and drains them before the next step."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem, ds_smem = buffers
    kv_bar, ready, empty, done, xbars = barriers
    HALF: gl.constexpr = HEAD_DIM_PAD // 2
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype

    dk = gl.zeros([_KEYS, HALF], gl.float32, acc_layout)
    dv = gl.zeros([_KEYS, HALF], gl.float32, acc_layout)
    st_zero = gl.zeros([_KEYS, BM], gl.float32, st_layout)
    total = GROUP * n_total
    mbarrier.wait(kv_bar, 0)
    for i in range(total):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        dpt = warpgroup_mma(resident_tile(v_smem, 0, HEAD_DIM_PAD), do_smem.index(stage).permute((1, 0)), st_zero,
                            use_acc=False, is_async=True)
        dpt = warpgroup_mma_wait(0, deps=(dpt,))
        mbarrier.wait(xbars.index(_P_FULL), i & 1)
        pt = pt_smem.load(st_layout)  # read before dS^T_i is staged below (_HAND_OVERS)
        delta = delta_smem.index(stage).load(cols)
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        ds_op = gl.convert_layout(dst, op_layout)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dk = warpgroup_mma(ds_op, q_smem.index(stage).slice(HALF, HALF, dim=1), dk, is_async=True)
        dv = warpgroup_mma(pt_op, do_smem.index(stage).slice(HALF, HALF, dim=1), dv, is_async=True)
        # Warpgroup 0's dK_{i-1} has read dS^T_{i-1} (a fresh barrier: step 0 waits for nothing).
        mbarrier.wait(xbars.index(_DS_EMPTY), (i & 1) ^ 1)
        ds_smem.store(dst)
        fence_async_shared()  # the generic-proxy stores, before warpgroup 0's wgmma (async proxy) reads them
        mbarrier.arrive(xbars.index(_DS_FULL))
        dk, dv, ds_op, pt_op = warpgroup_mma_wait(0, deps=(dk, dv, ds_op, pt_op))
        mbarrier.arrive(empty.index(stage))
    # K is read by warpgroup 0's S^T only: its last one was done before warpgroup 0 staged the last P^T (waited for
    # above). V is read by this warpgroup's dP^T only. Stage dK and dV there.
    k_smem.index(0).slice(HALF, HALF, dim=1).store((dk * sm_scale).to(dtype))
    v_smem.index(0).slice(HALF, HALF, dim=1).store(dv.to(dtype))
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
    gl.static_assert(STAGES >= 2, "a stage stays in use until dK of the next step is done")
    gl.static_assert(BM >= 64, "S^T and dP^T are one m64 wgmma over BM query columns; dK/dV's k is BM")
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    hk = pid_bh % NUM_KV_HEADS
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, HEAD_DIM_PAD], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_DIM_PAD], dtype)

    n_full, n_total, idx_ptr, mask_args = program_lists(
        b, pid_n, COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b,
        stride_mask_q, stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window)
    col0 = pid_n * _KEYS

    # [1, keys, D]: resident_tile indexes them through an opaque zero, so their descriptors are not hoisted
    k_smem = gl.allocate_shared_memory(dtype, [1, _KEYS, HEAD_DIM_PAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, _KEYS, HEAD_DIM_PAD], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, HEAD_DIM_PAD], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, HEAD_DIM_PAD], q_layout)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_layout)
    rows_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BM], row_layout)
    qbits_smem = gl.allocate_shared_memory(gl.int32, [STAGES if MASK_MODE != _MASK_DENSE else 1, BM], row_layout)
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, BM], gl.float32)
    pt_smem = gl.allocate_shared_memory(gl.float32, [_KEYS, BM], pt_layout)  # P^T, warpgroup 0 -> 1
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, BM], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [_KEYS, BM], ds_layout)  # dS^T, warpgroup 1 -> 0 (wgmma A)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    xbars = gl.allocate_shared_memory(gl.int64, [_HAND_OVERS, 1], bar_layout)  # _P_FULL, _DS_FULL, _DS_EMPTY
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)  # both consumer warpgroups have staged their halves of dK and dV
    for j in gl.static_range(_HAND_OVERS):
        mbarrier.init(xbars.index(j), count=1)  # one warpgroup arrives at each
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem, pt_smem, ds_smem)
    barriers = (kv_bar, ready, empty, done, xbars)
    gl.warp_specialize(
        [
            (_scores_warpgroup, (buffers, barriers, idx_ptr, n_full, n_total, col0, mask_args, qk_scale, sm_scale,
                                 GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW)),
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
