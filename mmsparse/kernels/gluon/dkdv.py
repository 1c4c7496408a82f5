"""Hopper dK/dV pass in Gluon: the key block's gradients with a TMA producer warp and two consumer warpgroups.

One CTA owns 128 keys; each consumer warpgroup owns 64 of them (and their dK, dV accumulators) and walks the
query blocks of the key block's list, for every head of the GQA group, as one flat sequence of steps. A one-warp
producer streams Q and dO (TMA) and the lse and delta rows (loads, shared stores) through a ring of stages.

Each warpgroup is software-pipelined so that its exponentials overlap its own matmuls (wgmma waits are in order):
step i issues S^T_i = K Q_i^T and dP^T_i = V dO_i^T, then dK += dS^T_{i-1} Q_{i-1} from the previous step's dS
(kept in registers); computes P^T_i once S^T_i is done (dP^T_i and dK_{i-1} still running); issues
dV += P^T_i dO_i; waits for dP^T_i and dK_{i-1}, releases stage i-1, and forms dS^T_i while dV_i runs. A stage is
thus held for two steps: at least 2 stages. The numerics are those of the ``tl`` dK/dV kernel
(``tl.backward._dkdv_tiles``), save that a partial block's token mask is the initial value of S^T (0 or -inf, from
query indices and bits the producer stores per stage) rather than a where() on P^T: p = 0 all the same where the
scores and lse are finite and the scale positive; and that where ``rules.lse_in_scores`` holds -lse / scale is part of
that initial value too (p = exp2((S^T - lse / scale) scale): no load of lse waits between the matmul and the
exponentials). The producer also does the final TMA stores of dK and dV (the
consumers hold no descriptors across their loop). No dropout: that stays with the ``tl`` kernel. Called only where
``mmsparse.attention.dispatch.hopper_gluon_available`` allows, like the Gluon forward.
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

from ..constants import DYNAMIC_ARGS, MASK_SEGMENTS
from ..rules import lse_in_scores
from .common import (
    WORKER_REGS,
    WORKER_WARPS,
    box,
    count_slot,
    invalidate_ring,
    issue_scores,
    key_step_zero,
    load_resident_halves,
    next_entry,
    probabilities,
    scores_init,
    thread_barrier,
    tma_store,
    wait_for_arrival,
)
from .dkdv_rows import allocate_query_stages, key_block_lists, stage_query_blocks
from .key_runs import block_runs, key_values

_MASK_SEGMENTS = gl.constexpr(MASK_SEGMENTS)
WG_KEYS = gl.constexpr(64)  # keys per consumer warpgroup (one m64 wgmma)
BLOCK_N = 2 * WG_KEYS.value


@gluon.jit
def _producer(LSE, DELTA, descs, buffers, barriers, idx_ptr, n_full, n_total, col0, b, hk, mask_args,
              NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
              MASK_MODE: gl.constexpr, ROW_PART: gl.constexpr = 0, arrival=None, WAIT_ARRIVAL: gl.constexpr = False,
              HEADS_INNER: gl.constexpr = False, key_runs=None):
    """K and V of the key block once, then Q and dO (TMA) and the lse and delta rows (loads and shared stores) of
    every listed query block of every head of the group, with the block's query indices (for the partial blocks'
    token mask: held in registers across the consumers' loop, they spilled at D=128, BM=64); the rows ROW_PART at
    a time (``dkdv_rows.stage_query_blocks``; its step order: ``HEADS_INNER``). With ``WAIT_ARRIVAL``, ``arrival``
    is (flag, epoch, whether this key block's keys are still landing): such a block's K and V are loaded once the
    flag reads the epoch. ``key_runs``: ``dkdv_rows.stage_query_blocks``'s."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    kv_bar, ready, empty, done = barriers
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc = descs
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    if WAIT_ARRIVAL:
        flag_ptr, epoch, landing = arrival
        if landing:
            wait_for_arrival(flag_ptr, epoch)
    load_resident_halves(k_desc, k_smem, v_desc, v_smem, kv_bar, b, hk, col0, WG_KEYS)
    stage_query_blocks(LSE, DELTA, q_desc, do_desc, (q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem),
                       ready, empty, idx_ptr, n_full, n_total, b, hk, q_bits_ptr, seq_q, NUM_HEADS, GROUP, BM, STAGES,
                       MASK_MODE, ROW_PART, HEADS_INNER, key_runs)
    # The consumers leave dK and dV in the K and V buffers. Stored from here, their descriptors need no registers
    # across the consumers' loop (they spilled at D=128, BM=64).
    mbarrier.wait(done, 0)
    for half in gl.static_range(2):
        tma_store(dk_desc, [b, hk, col0 + half * WG_KEYS, 0], box(k_smem.index(half)))
        tma_store(dv_desc, [b, hk, col0 + half * WG_KEYS, 0], box(v_smem.index(half)))
    tma.store_wait(0)


@gluon.jit
def _consumer(WG: gl.constexpr, buffers, barriers, n_full, n_total, col0, mask_args, qk_scale, sm_scale,
              GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
              MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, key_runs=None):
    """One warpgroup, 64 keys: dK and dV over every listed query block of every head of the group
    (:func:`_consumer_steps`), staged in its K and V tiles for the producer's stores. ``key_runs``: None, or
    (segment codes) the key block's ``(key shifts, runs)`` (:func:`.key_runs.block_runs`): where its runs fit the
    rows' words the steps read those, else the pair table, each in a loop of its own (one loop with both kept the
    pair table's registers and spills in every step)."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    kv_bar, ready, empty, done = barriers
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    offs_n = col0 + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, st_layout))
    args = (buffers, barriers, n_full, n_total, mask_args, qk_scale, offs_n)
    if key_runs is None:
        k_bits = key_values(offs_n, k_bits_ptr, seq_k, None, WG * WG_KEYS, MASK_MODE)
        dk, dv = _consumer_steps(WG, args, k_bits, None, GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL,
                                 HAS_WINDOW)
    elif key_runs[1] > 0:
        k_bits = key_values(offs_n, k_bits_ptr, seq_k, key_runs, WG * WG_KEYS, MASK_MODE)
        dk, dv = _consumer_steps(WG, args, k_bits, key_runs, GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL,
                                 HAS_WINDOW)
    else:
        k_bits = key_values(offs_n, k_bits_ptr, seq_k, None, WG * WG_KEYS, MASK_MODE)
        dk, dv = _consumer_steps(WG, args, k_bits, None, GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL,
                                 HAS_WINDOW)
    stage_gradients(WG, k_smem, v_smem, dk, dv, sm_scale, done)


@gluon.jit
def stage_gradients(WG: gl.constexpr, k_smem, v_smem, dk, dv, sm_scale, done):
    """Warpgroup WG's dK (times the softmax scale) and dV, in the input dtype, into its K and V tiles, which it no
    longer reads, for the producer's TMA stores; then one arrival on ``done``."""
    dtype: gl.constexpr = k_smem.dtype
    k_smem.index(WG).store((dk * sm_scale).to(dtype))
    v_smem.index(WG).store(dv.to(dtype))
    fence_async_shared()
    thread_barrier()  # every thread's stores and fence before the one arrival
    mbarrier.arrive(done)


@gluon.jit
def _consumer_steps(WG: gl.constexpr, args, k_bits, key_runs, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                    BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    HAS_WINDOW: gl.constexpr):
    """:func:`_consumer`'s steps, i = g * n_total + it: step i issues S^T_i, dP^T_i and then dK += dS^T_{i-1}
    Q_{i-1}; the exponentials of step i run while dP^T_i and dK_{i-1} do, and dS^T_i while dV += P^T_i dO_i does.
    ``k_bits`` and ``key_runs``: the partial steps' mask (``common.scores_init``). Returns ``(dk, dv)`` with
    nothing in flight."""
    buffers, barriers, n_full, n_total, mask_args, qk_scale, offs_n = args
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    kv_bar, ready, empty, done = barriers
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype

    COUNTED: gl.constexpr = STAGES & (STAGES - 1) != 0  # the ring's stage and phase counted (common.count_slot)
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)
    dk = gl.zeros([WG_KEYS, HEAD_DIM_PAD], gl.float32, acc_layout)
    dv = gl.zeros([WG_KEYS, HEAD_DIM_PAD], gl.float32, acc_layout)
    st_zero = gl.zeros([WG_KEYS, BM], gl.float32, st_layout)
    total = GROUP * n_total
    inv_qk_scale = 1.0 / qk_scale
    LSE_FIRST: gl.constexpr = lse_in_scores(MASK_MODE, IS_CAUSAL, HEAD_DIM_PAD)
    mbarrier.wait(kv_bar, 0)
    if total > 0:
        # Step 0: no dK of a previous step to issue.
        mbarrier.wait(ready.index(0), 0)
        st0, partial = scores_init(0, n_full, rows_smem.index(0), qbits_smem.index(0), offs_n, k_bits, mask_args,
                                    st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW, key_runs)
        do_s = do_smem.index(0)
        st = issue_scores(k_w, q_smem.index(0), st0, partial, lse_smem.index(0), inv_qk_scale, cols, LSE_FIRST)
        dpt = warpgroup_mma(v_w, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st,))
        pt = probabilities(st, lse_smem.index(0), qk_scale, cols, LSE_FIRST)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        delta = delta_smem.index(0).load(cols)
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        dst_op = gl.convert_layout(dst, op_layout)
        dv, pt_op = warpgroup_mma_wait(0, deps=(dv, pt_op))
        stage = 0
        phase = 0
        it = 0  # step 0's entry
        for i in range(1, total):
            # Nothing in flight on entry. Stage i-1 (Q_{i-1} for dK_{i-1}) is held until dK_{i-1} is done.
            if COUNTED:
                prev = stage
                stage, phase = count_slot(stage, phase, STAGES)
            else:
                stage = i % STAGES
                prev = (i - 1) % STAGES
            it = next_entry(it, n_total, GROUP)
            mbarrier.wait(ready.index(stage), phase if COUNTED else (i // STAGES) & 1)
            st0, partial = scores_init(it, n_full, rows_smem.index(stage), qbits_smem.index(stage), offs_n, k_bits,
                                        mask_args, st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW, key_runs)
            do_s = do_smem.index(stage)
            first = key_step_zero(HEAD_DIM_PAD)  # past D=64 K's and V's descriptors are made in each step
            k_step = k_smem.index(WG + first)
            v_step = v_smem.index(WG + first)
            lse_s = lse_smem.index(stage)
            st = issue_scores(k_step, q_smem.index(stage), st0, partial, lse_s, inv_qk_scale, cols, LSE_FIRST)
            dpt = warpgroup_mma(v_step, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem.index(prev), dk, is_async=True)
            # wgmma groups complete in order: of S_i, dP_i, dK_{i-1}, the first is done.
            st = warpgroup_mma_wait(2, deps=(st,))
            pt = probabilities(st, lse_s, qk_scale, cols, LSE_FIRST)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
            # Of dP_i, dK_{i-1}, dV_i: the first two are done. Stage i-1 is free (dV_{i-1} was drained in step i-1).
            dpt, dk, dst_op = warpgroup_mma_wait(1, deps=(dpt, dk, dst_op))
            mbarrier.arrive(empty.index(prev))
            delta = delta_smem.index(stage).load(cols)
            dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            dst_op = gl.convert_layout(dst, op_layout)
            # dV_i is drained here rather than in the next step: a wgmma still in flight across the loop's back edge
            # makes ptxas serialize every wgmma of the kernel (C7512, "insufficient register resources").
            dv, pt_op = warpgroup_mma_wait(0, deps=(dv, pt_op))
        last = stage if COUNTED else (total - 1) % STAGES
        dk = warpgroup_mma(dst_op, q_smem.index(last), dk, is_async=True)
        dk, dv, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dk, dv, pt_op, dst_op))
        mbarrier.arrive(empty.index(last))
    return dk, dv


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def attention_dkdv_gluon(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, sm_scale, ARRIVAL, arrival_epoch, own_blocks,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    WAIT_ARRIVAL: gl.constexpr = False,
):
    """One CTA per (128-key block, batch * kv head); arguments as the ``tl`` dK/dV kernel's (no dropout), save that
    Q, K, V, dO, dK and dV come as ``host_tma`` descriptors. With ``WAIT_ARRIVAL`` the keys past the first
    ``own_blocks`` key blocks are still landing when the kernel starts (a context-parallel rank's fetched keys): the
    programs of the own blocks run first, and each other program loads its K and V once the int32 at ``ARRIVAL``
    reads ``arrival_epoch`` (unread otherwise)."""
    gl.static_assert(STAGES >= 2, "a stage stays in use until dK of the next step is issued")
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, HEAD_DIM_PAD], dtype)
    b, hk, col0, n_full, n_total, idx_ptr, mask_args = key_block_lists(
        COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q,
        stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window, NUM_KV_HEADS, 2 * WG_KEYS, own_blocks,
        WAIT_ARRIVAL)
    arrival = (ARRIVAL, arrival_epoch, col0 >= own_blocks * 2 * WG_KEYS)  # a block with a key past the own ones

    k_smem = gl.allocate_shared_memory(dtype, [2, WG_KEYS, HEAD_DIM_PAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, WG_KEYS, HEAD_DIM_PAD], kv_layout)
    q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = allocate_query_stages(
        dtype, STAGES, BM, HEAD_DIM_PAD, MASK_MODE)
    consumer_runs: gl.constexpr = None  # the partial steps' mask without the key block's runs (:mod:`.key_runs`)
    producer_runs: gl.constexpr = None
    if MASK_MODE == _MASK_SEGMENTS:
        consumer_runs, producer_runs = block_runs(mask_args, col0, 2 * WG_KEYS)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)  # both consumer warpgroups have staged dK and dV
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem)
    barriers = (kv_bar, ready, empty, done)
    gl.warp_specialize(
        [
            (_consumer, (0, buffers, barriers, n_full, n_total, col0, mask_args, qk_scale, sm_scale, GROUP,
                         HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, consumer_runs)),
            (_consumer, (1, buffers, barriers, n_full, n_total, col0, mask_args, qk_scale, sm_scale, GROUP,
                         HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, consumer_runs)),
            (_producer, (LSE, DELTA, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc), buffers, barriers, idx_ptr,
                         n_full, n_total, col0, b, hk, mask_args, NUM_HEADS, GROUP, BM, STAGES, MASK_MODE, 0, arrival,
                         WAIT_ARRIVAL, False, producer_runs)),
        ],
        WORKER_WARPS,
        WORKER_REGS,
    )
    # Every partition has returned: no barrier is waited on or signalled again.
    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(done)
    invalidate_ring(ready, STAGES)
    invalidate_ring(empty, STAGES)


# Shared with the warp-specialised one-pass backward (gluon.bwd_dq_writer): the same producer.
key_block_producer = _producer
