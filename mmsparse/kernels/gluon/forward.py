"""Hopper forward in Gluon: the FlashAttention-3 schedule over the listed key blocks of each query block.

Why a second forward: the ``tl`` kernel is an FA2 loop, where one warpgroup alternates between matmuls and softmax,
so the tensor cores idle while the exponentials run (docs/performance.md). Here one CTA owns 128 query rows:
- a one-warp producer streams the listed K and V tiles through a ring of shared-memory stages with TMA;
- two consumer warpgroups each own 64 of the rows. Each issues the next block's Q K^T before the current block's
  P V (both asynchronous), so its softmax runs while its own matmul does. Without ping-pong (D=64, D=256: 2
  stages) a stage's K and its V are released apart, as FlashAttention-3's two pipelines: K once the block's
  scores are done, V once its P V is, so the next block's K loads while this block's P V runs (a whole-stage
  release left each K load on the matmuls' path: 1.15x the D=256 forward, 1.02-1.04x at D=64 on an H200; the ping-pong
  tiles gained nothing or lost, docs/performance.md);
- with ``PINGPONG`` the two warpgroups take turns to issue their matmuls, so one's softmax overlaps the other's
  matmuls. ``TURNS`` picks how (``constants.TURNS_*``). Gluon lowers each ``mbarrier.arrive`` of a warpgroup to a
  warpgroup-wide ``bar.sync`` and one thread's arrive, so the arrives per key block count: twice without ping-pong
  (K's and V's releases); with turn mbarriers (``TURNS_MBARRIER``) twice as well, handing the turn over and
  releasing the stage;
  with ``TURNS_NAMED_RELEASE`` the turns go through hardware named barriers, as in FlashAttention-3
  (``bar.sync`` / ``bar.arrive`` of both warpgroups' 256 threads: no mbarrier, no extra bar.sync), and so do the
  stage releases (the consumers' ``bar.arrive``, the producer's ``bar.sync``), which leaves no mbarrier arrive
  in the consumer loop.

The numerics are the ``tl`` kernel's: scores and the running max in raw units, the exact token mask applied only
in partial blocks, lse = +inf for a row that sees nothing; save that the exponent is one FMA, ``p = exp2(s * scale -
m * scale)``, where the ``tl`` kernel computes ``(s - m) * scale`` (one FP32 op an element more: the Gluon forward
was 1.02-1.04x faster with the FMA at head dims 64 and 128 on an H200, equal at 256). This module imports
Triton's Gluon API, which is experimental: it is only launched where
``mmsparse.attention.dispatch.hopper_gluon_available`` says so; an error in it raises.
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

from ..constants import DYNAMIC_ARGS, MASK_DENSE, TURNS_MBARRIER, TURNS_NAMED_RELEASE
from ..lists import block_id, ordered_row
from .common import (
    FIRST_FREE_BARRIER_ID,
    WG_ROWS,
    WORKER_REGS,
    WORKER_WARPS,
    allocate_barriers,
    allocate_kv_ring,
    box,
    init_barriers,
    invalidate_barriers,
    invalidate_ring,
    masked_scores,
    named_barrier,
    named_barrier_asm,
    named_barrier_at,
    program_lists,
    resident_tile,
    stream_kv_ring,
    tma_load,
    tma_store,
)

_MASK_DENSE = gl.constexpr(MASK_DENSE)
_TURNS_MBARRIER = gl.constexpr(TURNS_MBARRIER)
_TURNS_NAMED_RELEASE = gl.constexpr(TURNS_NAMED_RELEASE)
# TURNS_NAMED_RELEASE: warpgroup w's turn is named barrier TURN_BARRIER_IDS[w], counted over both consumer warpgroups: w
# waits there (bar.sync) before issuing its matmuls, the other warpgroup arrives (bar.arrive) once it issued its own.
TURN_BARRIER_IDS = (FIRST_FREE_BARRIER_ID, FIRST_FREE_BARRIER_ID + 1)
_CONSUMER_THREADS = 2 * 4 * 32  # the two consumer warpgroups
_SYNC_TURN_0 = named_barrier_asm("sync", TURN_BARRIER_IDS[0], _CONSUMER_THREADS)
_SYNC_TURN_1 = named_barrier_asm("sync", TURN_BARRIER_IDS[1], _CONSUMER_THREADS)
_ARRIVE_TURN_0 = named_barrier_asm("arrive", TURN_BARRIER_IDS[0], _CONSUMER_THREADS)
_ARRIVE_TURN_1 = named_barrier_asm("arrive", TURN_BARRIER_IDS[1], _CONSUMER_THREADS)
# Stage s is released through named barrier RELEASE_BARRIER_ID + s, counted over both consumer
# warpgroups and the producer warp: the consumers arrive once they no longer read the stage, the producer waits
# there (bar.sync) before refilling it.
RELEASE_BARRIER_ID = gl.constexpr(TURN_BARRIER_IDS[1] + 1)
_RELEASE_THREADS = _CONSUMER_THREADS + 32
_ARRIVE_RELEASE = named_barrier_asm("arrive", None, _RELEASE_THREADS)
_SYNC_RELEASE = named_barrier_asm("sync", None, _RELEASE_THREADS)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, idx_ptr, n_total,
              row0, b, h, hk, BN: gl.constexpr, STAGES: gl.constexpr, NAMED_RELEASE: gl.constexpr,
              V_APART: gl.constexpr):
    """One warp: Q once, then K and V of every listed key block into the stage ring (separate barriers, so Q K^T
    can start before V lands). A stage is free again once both warpgroups released it (``kv_empty``, its K and its V
    apart with ``V_APART``, or with ``NAMED_RELEASE`` its named barrier)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, row0, 0], q_bar, box(q_smem.index(0)))
    tma_load(q_desc, [b, h, row0 + WG_ROWS, 0], q_bar, box(q_smem.index(1)))
    if NAMED_RELEASE:
        _stream_kv_named(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, idx_ptr, n_total, b, hk, BN, STAGES)
    else:
        stream_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, idx_ptr, n_total, b, hk, BN,
                       STAGES, V_APART)


@gluon.jit
def _stream_kv_named(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, idx_ptr, n_total, b, hk, BN: gl.constexpr,
                     STAGES: gl.constexpr):
    """``stream_kv_ring`` with each stage's release a named barrier (TURNS_NAMED_RELEASE): block it >= STAGES waits
    for both warpgroups to arrive there after block it - STAGES. Hardware barriers count threads, not phases: a
    warpgroup cannot arrive for the stage's next block before this wait completes, as that block is loaded only
    after it. A lap of STAGES at a time, so that every stage is a constant."""
    for first in range(0, n_total, STAGES):
        for stage in gl.static_range(STAGES):
            it = first + stage
            if it < n_total:
                n_blk = block_id(idx_ptr, it)
                if first > 0:
                    named_barrier_at(_SYNC_RELEASE, RELEASE_BARRIER_ID + stage)
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                tma_load(k_desc, [b, hk, n_blk * BN, 0], k_ready.index(stage), box(k_smem.index(stage)))
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                tma_load(v_desc, [b, hk, n_blk * BN, 0], v_ready.index(stage), box(v_smem.index(stage)))


@gluon.jit
def _init_turns(turn):
    """The turn mbarriers of ``TURNS_MBARRIER`` (``turn`` is ``[2, 1]``), warpgroup 0 first. Only that variant
    initialises them: an unused barrier would still have to be invalidated before its bytes hold anything else."""
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0))


@gluon.jit
def _take_turn(turn, WG: gl.constexpr, e, PINGPONG: gl.constexpr, TURNS: gl.constexpr):
    """With PINGPONG, wait until warpgroup WG may issue the matmuls of its turn e (0 .. n_total): warpgroup 0 after
    warpgroup 1's turn e - 1, warpgroup 1 after warpgroup 0's turn e."""
    if PINGPONG:
        if TURNS == _TURNS_NAMED_RELEASE:
            if WG == 0:
                named_barrier(_SYNC_TURN_0)
            else:
                named_barrier(_SYNC_TURN_1)
        else:
            mbarrier.wait(turn.index(WG), e & 1)


@gluon.jit
def _hand_off(turn, WG: gl.constexpr, e, PINGPONG: gl.constexpr, TURNS: gl.constexpr, LAST: gl.constexpr = False):
    """With PINGPONG, end turn e of warpgroup WG once its matmuls are issued (LAST: turn n_total, the last)."""
    if PINGPONG:
        if TURNS == _TURNS_NAMED_RELEASE:
            if WG == 0:
                named_barrier(_ARRIVE_TURN_1)
            elif not LAST:
                # Warpgroup 0 takes no turn after its last: an arrive nobody syncs with would stay counted.
                named_barrier(_ARRIVE_TURN_0)
        else:
            mbarrier.arrive(turn.index(1 - WG))  # the other warpgroup's turn


@gluon.jit
def _release_keys(kv_empty, stage, PINGPONG: gl.constexpr):
    """Without ping-pong: this warpgroup's scores of the block in ``stage`` are done, so it no longer reads the
    stage's K: release it (``kv_empty`` ``stage``), and the producer loads the next block's K there while this
    block's P V runs. Ping-pong tiles release the whole stage at once (:func:`_release_stage`)."""
    if not PINGPONG:
        mbarrier.arrive(kv_empty.index(stage))


@gluon.jit
def _release_stage(kv_empty, stage, block, n_total, PINGPONG: gl.constexpr, TURNS: gl.constexpr,
                   STAGES: gl.constexpr):
    """This warpgroup no longer reads the K/V stage of ``block``: release it to the producer (without ping-pong
    its V, ``kv_empty`` STAGES + ``stage``: :func:`_release_keys` released its K). A named release only where the
    producer waits for it (a block STAGES later exists): an arrive nobody syncs with would stay counted."""
    if PINGPONG and TURNS == _TURNS_NAMED_RELEASE:
        if block + STAGES < n_total:
            named_barrier_at(_ARRIVE_RELEASE, RELEASE_BARRIER_ID + stage)
    elif PINGPONG:
        mbarrier.arrive(kv_empty.index(stage))
    else:
        mbarrier.arrive(kv_empty.index(STAGES + stage))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax of one score tile: (p, alpha, m, l) with alpha the factor for what was accumulated before."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf: 0 as the exponent base gives p = 0, not NaN.
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(gl.fma(s, qk_scale, -gl.expand_dims(m_base * qk_scale, 1)))
    alpha = gl.exp2((m_i - m_base) * qk_scale)
    l_i = gl.fma(l_i, alpha, gl.sum(p, axis=1))
    return p, alpha, m_new, l_i


@gluon.jit
def _consumer(WG: gl.constexpr, buffers, barriers, o_desc, lse_ptr, blocks, mask_args, qk_scale, BN: gl.constexpr,
              HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr,
              HAS_WINDOW: gl.constexpr, PINGPONG: gl.constexpr, TURNS: gl.constexpr, NUM_HEADS: gl.constexpr):
    """One warpgroup, 64 query rows. Iteration j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, and does the
    softmax of S_j while the second matmul runs. Its turn (with PINGPONG) is turn j: turn 0 issues S_0 alone,
    turn n_total the last P V alone."""
    q_smem, k_smem, v_smem = buffers
    q_bar, k_ready, v_ready, kv_empty, turn = barriers
    idx_ptr, n_full, n_total, row0 = blocks
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM_PAD, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    offs_m = row0 + WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=rows)
    q_bits = offs_m  # a stand-in: only the bit and code masks read them
    if MASK_MODE != _MASK_DENSE:
        q_bits = gl.load(q_bits_ptr + offs_m, mask=offs_m < seq_q, other=0)
    q = q_smem.index(WG)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([WG_ROWS], gl.float32, rows)
    acc = gl.zeros([WG_ROWS, HEAD_DIM_PAD], gl.float32, o_layout)
    s_zero = gl.zeros([WG_ROWS, BN], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    if n_total > 0:
        if PINGPONG and TURNS == _TURNS_NAMED_RELEASE and WG == 1:
            named_barrier(_ARRIVE_TURN_0)  # warpgroup 0 goes first; matched by its sync of turn 0
        # Block 0: its scores alone.
        _take_turn(turn, WG, 0, PINGPONG, TURNS)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _hand_off(turn, WG, 0, PINGPONG, TURNS)
        s = warpgroup_mma_wait(0, deps=(s,))
        _release_keys(kv_empty, 0, PINGPONG)
        if n_full == 0:
            s = masked_scores(s, offs_m, q_bits, block_id(idx_ptr, 0), mask_args, BN, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        for it in range(1, n_total):
            stage = it % STAGES
            prev = (it - 1) % STAGES
            _take_turn(turn, WG, it, PINGPONG, TURNS)
            mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)
            s = warpgroup_mma(resident_tile(q_smem, WG, HEAD_DIM_PAD), k_smem.index(stage).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
            _hand_off(turn, WG, it, PINGPONG, TURNS)
            s = warpgroup_mma_wait(1, deps=(s,))
            _release_keys(kv_empty, stage, PINGPONG)
            if it >= n_full:
                s = masked_scores(s, offs_m, q_bits, block_id(idx_ptr, it), mask_args, BN, MASK_MODE, IS_CAUSAL,
                                  HAS_WINDOW)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
            _release_stage(kv_empty, prev, it - 1, n_total, PINGPONG, TURNS, STAGES)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            p_prev = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_total - 1) % STAGES
        _take_turn(turn, WG, n_total, PINGPONG, TURNS)
        mbarrier.wait(v_ready.index(last), ((n_total - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
        _hand_off(turn, WG, n_total, PINGPONG, TURNS, LAST=True)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        if not (PINGPONG and TURNS == _TURNS_NAMED_RELEASE):  # no block comes STAGES after the last
            _release_stage(kv_empty, last, n_total - 1, n_total, PINGPONG, TURNS, STAGES)

    # Rows that attend nothing: l = 0, output 0, lse = +inf (the backward's exp2(s - lse) is then 0).
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    gl.store(lse_ptr + offs_m, gl.where(empty, float("inf"), m_i * qk_scale + gl.log2(l_safe)), mask=offs_m < seq_q)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
    q.store(out.to(dtype))  # this warpgroup's Q rows are no longer read: stage the output there
    fence_async_shared()
    pid_bh = gl.program_id(1)  # (b, h) recomputed here, not held across the loop
    tma_store(o_desc, [pid_bh // NUM_HEADS, pid_bh % NUM_HEADS, row0 + WG * WG_ROWS, 0], box(q))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def attention_fwd_gluon(
    q_desc, k_desc, v_desc, o_desc, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale,
    NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BN: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    PINGPONG: gl.constexpr, TURNS: gl.constexpr = _TURNS_MBARRIER,
):
    """One CTA per (128-row query block, batch*head); arguments as the ``tl`` forward's (no dropout, no splits),
    save that Q, K, V and O come as ``host_tma`` descriptors. Tiles are HEAD_DIM_PAD wide: TMA reads the columns
    past the head dim as zeros and drops writes there. ``TURNS`` (read with PINGPONG): how the warpgroups take
    turns, ``constants.TURNS_*``."""
    gl.static_assert(STAGES >= 2, "a stage stays in use until the next block's Q K^T is issued")
    pid_bh = gl.program_id(1)
    b = pid_bh // NUM_HEADS
    h = pid_bh % NUM_HEADS
    pid_m = ordered_row(COUNTS, gl.program_id(0), b, stride_cnt_b)
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM_PAD], dtype)
    lse_ptr = LSE + pid_bh.to(gl.int64) * seq_q
    named_release: gl.constexpr = PINGPONG and TURNS == _TURNS_NAMED_RELEASE
    turn_mbarriers: gl.constexpr = PINGPONG and TURNS == _TURNS_MBARRIER
    gl.static_assert(not named_release or RELEASE_BARRIER_ID + STAGES <= 16, "a CTA has 16 named barriers")

    n_full, n_total, idx_ptr, mask_args = program_lists(
        b, pid_m, COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b,
        stride_mask_q, stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window)
    row0 = pid_m * (2 * WG_ROWS)

    q_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM_PAD], q_layout)
    k_smem, v_smem = allocate_kv_ring(dtype, STAGES, BN, HEAD_DIM_PAD)
    # Without ping-pong a stage's K and its V are released apart (2 barriers a stage); named releases need none
    v_apart: gl.constexpr = not PINGPONG
    kv_sets: gl.constexpr = 2 if v_apart else 1
    releases: gl.constexpr = 0 if named_release else kv_sets
    q_bar, k_ready, v_ready, kv_empty = allocate_barriers(STAGES, kv_sets)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    init_barriers(q_bar, k_ready, v_ready, kv_empty, STAGES, releases)
    if turn_mbarriers:
        _init_turns(turn)
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (q_smem, k_smem, v_smem)
    barriers = (q_bar, k_ready, v_ready, kv_empty, turn)
    blocks = (idx_ptr, n_full, n_total, row0)
    gl.warp_specialize(
        [
            (_consumer, (0, buffers, barriers, o_desc, lse_ptr, blocks, mask_args, qk_scale, BN, HEAD_DIM_PAD, STAGES,
                         MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG, TURNS, NUM_HEADS)),
            (_consumer, (1, buffers, barriers, o_desc, lse_ptr, blocks, mask_args, qk_scale, BN, HEAD_DIM_PAD, STAGES,
                         MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG, TURNS, NUM_HEADS)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, idx_ptr,
                         n_total, row0, b, h, h // GROUP, BN, STAGES, named_release, v_apart)),
        ],
        WORKER_WARPS,
        WORKER_REGS,
    )
    # Every partition has returned: no barrier is waited on or signalled again.
    invalidate_barriers(q_bar, k_ready, v_ready, kv_empty, STAGES, releases)
    if turn_mbarriers:
        invalidate_ring(turn, 2)
