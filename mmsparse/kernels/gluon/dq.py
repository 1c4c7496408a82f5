"""Hopper dQ pass in Gluon: the query block's gradient with a TMA producer warp and two consumer warpgroups.

The schedule is the Gluon forward's (``gluon.forward``): one CTA owns 128 query rows, a one-warp producer streams
the listed K and V tiles through a ring of shared-memory stages, and each consumer warpgroup owns 64 rows and their
dQ accumulator. Iteration j issues S_j = Q K_j^T and dP_j = dO V_j^T, then dQ += dS_{j-1} K_{j-1}, all
asynchronous, and forms dS_j while that last matmul runs, so the exponentials overlap the tensor cores within a
warpgroup (the ``tl`` dQ kernel alternates between them).

The numerics are the ``tl`` dQ kernel's (``tl.backward._dq_tiles``): p = exp2(s * scale - lse) with the exact token
mask in partial blocks only (save that where ``rules.lse_in_scores`` says so, -lse / scale is S's initial value, as in
the dK/dV passes), dS = p (dP - delta), dQ scaled by the softmax scale at the end. No dropout: that stays
with the ``tl`` kernel. Called only where ``mmsparse.attention.dispatch.hopper_gluon_available`` allows.
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
from ..lists import block_id, ordered_row
from ..rules import lse_in_scores
from .common import (
    WG_ROWS,
    WORKER_REGS,
    WORKER_WARPS,
    allocate_barriers,
    allocate_kv_ring,
    box,
    init_barriers,
    invalidate_barriers,
    load_resident_halves,
    masked_scores,
    program_lists,
    resident_tile,
    stream_kv_ring,
    tma_store,
)

_MASK_DENSE = gl.constexpr(MASK_DENSE)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, buffers, barriers, idx_ptr, n_total, row0, b, h, hk,
              BN: gl.constexpr, STAGES: gl.constexpr):
    """One warp: Q and dO of both warpgroups once, then the K/V ring."""
    q_smem, do_smem, k_smem, v_smem = buffers
    qdo_bar, k_ready, v_ready, kv_empty = barriers
    load_resident_halves(q_desc, q_smem, do_desc, do_smem, qdo_bar, b, h, row0, WG_ROWS)
    stream_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, idx_ptr, n_total, b, hk, BN, STAGES)


@gluon.jit
def _score_grads(s, dp, neg_lse, delta, masked, offs_m, q_bits, n_blk, mask_args, qk_scale, BN: gl.constexpr,
                 MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, LSE_FIRST: gl.constexpr):
    """dS = P (dP - delta) of one tile. Rows past the end (lse = +inf) and disallowed pairs (s = -inf) get
    p = 0. ``LSE_FIRST``: S already holds -lse / scale (:func:`_issue_scores`)."""
    if masked:
        s = masked_scores(s, offs_m, q_bits, n_blk, mask_args, BN, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
    if LSE_FIRST:
        p = gl.exp2(s * qk_scale)
    else:
        p = gl.exp2(gl.fma(s, qk_scale, gl.expand_dims(neg_lse, 1)))  # explicit FMA, as the tl kernels
    return p * (dp - gl.expand_dims(delta, 1))


@gluon.jit
def _issue_scores(q, k_tile, s_zero, neg_lse, inv_qk_scale, LSE_FIRST: gl.constexpr):
    """Issue S = Q K^T; where ``LSE_FIRST`` (``rules.lse_in_scores``) onto -lse / scale, as the dK/dV passes issue S^T,
    so that the passes compute P alike."""
    if LSE_FIRST:
        s = warpgroup_mma(q, k_tile.permute((1, 0)), s_zero + gl.expand_dims(neg_lse * inv_qk_scale, 1),
                          is_async=True)
    else:
        s = warpgroup_mma(q, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s


@gluon.jit
def _consumer(WG: gl.constexpr, buffers, barriers, dq_desc, b, h, row_ptrs, blocks, mask_args, qk_scale, sm_scale,
              BN: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr,
              IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """One warpgroup, 64 query rows: dQ over the listed key blocks."""
    q_smem, do_smem, k_smem, v_smem = buffers
    qdo_bar, k_ready, v_ready, kv_empty = barriers
    lse_ptr, delta_ptr = row_ptrs
    idx_ptr, n_full, n_total, row0 = blocks
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    offs_m = row0 + WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=rows)
    in_rows = offs_m < seq_q
    q_bits = offs_m  # a stand-in: only the bit and code masks read them
    if MASK_MODE != _MASK_DENSE:
        q_bits = gl.load(q_bits_ptr + offs_m, mask=in_rows, other=0)
    neg_lse = -gl.load(lse_ptr + offs_m, mask=in_rows, other=float("inf"))
    delta = gl.load(delta_ptr + offs_m, mask=in_rows, other=0.0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    dq = gl.zeros([WG_ROWS, HEAD_DIM_PAD], gl.float32, dq_layout)
    s_zero = gl.zeros([WG_ROWS, BN], gl.float32, s_layout)
    inv_qk_scale = 1.0 / qk_scale
    LSE_FIRST: gl.constexpr = lse_in_scores(MASK_MODE, IS_CAUSAL, HEAD_DIM_PAD)
    mbarrier.wait(qdo_bar, 0)
    if n_total > 0:
        # Block 0: its dS alone.
        mbarrier.wait(k_ready.index(0), 0)
        s = _issue_scores(q, k_smem.index(0), s_zero, neg_lse, inv_qk_scale, LSE_FIRST)
        mbarrier.wait(v_ready.index(0), 0)
        dp = warpgroup_mma(do, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        ds = _score_grads(s, dp, neg_lse, delta, n_full == 0, offs_m, q_bits, block_id(idx_ptr, 0), mask_args,
                          qk_scale, BN, MASK_MODE, IS_CAUSAL, HAS_WINDOW, LSE_FIRST)
        ds_prev = gl.convert_layout(ds.to(dtype), op_layout)
        for it in range(1, n_total):
            stage = it % STAGES
            prev = (it - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)
            s = _issue_scores(resident_tile(q_smem, WG, HEAD_DIM_PAD), k_smem.index(stage), s_zero, neg_lse,
                              inv_qk_scale, LSE_FIRST)
            mbarrier.wait(v_ready.index(stage), (it // STAGES) & 1)
            dp = warpgroup_mma(resident_tile(do_smem, WG, HEAD_DIM_PAD), v_smem.index(stage).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_prev, k_smem.index(prev), dq, is_async=True)
            # Waits complete in issue order: S_j and dP_j are done, dQ += dS_{j-1} K_{j-1} may still run.
            s, dp = warpgroup_mma_wait(1, deps=(s, dp))
            ds = _score_grads(s, dp, neg_lse, delta, it >= n_full, offs_m, q_bits, block_id(idx_ptr, it), mask_args,
                              qk_scale, BN, MASK_MODE, IS_CAUSAL, HAS_WINDOW, LSE_FIRST)
            dq, ds_prev = warpgroup_mma_wait(0, deps=(dq, ds_prev))
            mbarrier.arrive(kv_empty.index(prev))
            ds_prev = gl.convert_layout(ds.to(dtype), op_layout)
        last = (n_total - 1) % STAGES
        dq = warpgroup_mma(ds_prev, k_smem.index(last), dq, is_async=True)
        dq, ds_prev = warpgroup_mma_wait(0, deps=(dq, ds_prev))
        mbarrier.arrive(kv_empty.index(last))

    q.store((dq * sm_scale).to(dtype))  # this warpgroup's Q rows are no longer read: stage dQ there
    fence_async_shared()
    tma_store(dq_desc, [b, h, row0 + WG * WG_ROWS, 0], box(q))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def attention_dq_gluon(
    q_desc, k_desc, v_desc, do_desc, LSE, DELTA, dq_desc, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, sm_scale,
    NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BN: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
):
    """One CTA per (128-row query block, batch*head); arguments as the ``tl`` dQ kernel's (no dropout), save that
    Q, K, V, dO and dQ come as ``host_tma`` descriptors. lse and delta are contiguous ``[B, Hq, Sq]``; tiles are
    HEAD_DIM_PAD wide (TMA zero-fills the columns past the head dim)."""
    gl.static_assert(STAGES >= 2, "a stage stays in use until the next block's S and dP are issued")
    pid_bh = gl.program_id(1)
    b = pid_bh // NUM_HEADS
    pid_m = ordered_row(COUNTS, gl.program_id(0), b, stride_cnt_b)
    h = pid_bh % NUM_HEADS
    bh_rows = pid_bh.to(gl.int64) * seq_q
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM_PAD], dtype)

    n_full, n_total, idx_ptr, mask_args = program_lists(
        b, pid_m, COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b,
        stride_mask_q, stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window)
    row0 = pid_m * (2 * WG_ROWS)

    q_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM_PAD], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM_PAD], q_layout)
    k_smem, v_smem = allocate_kv_ring(dtype, STAGES, BN, HEAD_DIM_PAD)
    qdo_bar, k_ready, v_ready, kv_empty = allocate_barriers(STAGES)
    init_barriers(qdo_bar, k_ready, v_ready, kv_empty, STAGES)
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (q_smem, do_smem, k_smem, v_smem)
    barriers = (qdo_bar, k_ready, v_ready, kv_empty)
    row_ptrs = (LSE + bh_rows, DELTA + bh_rows)
    blocks = (idx_ptr, n_full, n_total, row0)
    gl.warp_specialize(
        [
            (_consumer, (0, buffers, barriers, dq_desc, b, h, row_ptrs, blocks, mask_args, qk_scale, sm_scale, BN,
                         HEAD_DIM_PAD, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW)),
            (_consumer, (1, buffers, barriers, dq_desc, b, h, row_ptrs, blocks, mask_args, qk_scale, sm_scale, BN,
                         HEAD_DIM_PAD, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, buffers, barriers, idx_ptr, n_total, row0, b, h, h // GROUP,
                         BN, STAGES)),
        ],
        WORKER_WARPS,
        WORKER_REGS,
    )
    # Every partition has returned: no barrier is waited on or signalled again.
    invalidate_barriers(qdo_bar, k_ready, v_ready, kv_empty, STAGES)
