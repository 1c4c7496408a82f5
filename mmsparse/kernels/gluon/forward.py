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

With ``PERSISTENT`` a CTA stays on its SM and takes tiles (query block, batch * head) from a counter in global
memory, zeroed by the launcher, in the launch order of the CTAs it replaces (the first SM free takes the next tile,
as the hardware starts CTAs). Q has two slots of shared tiles, so that a tile's Q loads while the tile before runs:
the producer fetches the next tile as soon as it has issued the last K/V block of the one before, hands its id, list
and query offset to the consumers in the slot's words, loads its Q into the slot and streams its K/V blocks on
through the ring (stages, turns and releases run on across tiles). A consumer warpgroup stages its output in its
slot's Q tile, stores it by TMA and releases the slot (``q_empty``) once the store has read it, after it has taken
the next tile. A launched CTA pays its start on the matmuls' path (launch, barrier inits, the list's loads, Q and the
first K): 4.2 µs on an H200 against 1.6 µs a key block (``python -m tools.fwd_schedule --measure``); a persistent
CTA with one Q slot, whose Q waited for the output's store, paid about as much a tile.

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
from ..lists import WORDS_PER_ROW, block_id, ordered_row
from .common import (
    FIRST_FREE_BARRIER_ID,
    WG_ROWS,
    WORKER_REGS,
    WORKER_WARPS,
    allocate_barriers,
    allocate_kv_ring,
    box,
    init_barriers,
    init_kv_ring,
    invalidate_barriers,
    invalidate_kv_ring,
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
# there (bar.sync) before refilling it. A persistent CTA releases a stage's K there and its V at
# RELEASE_BARRIER_ID + STAGES + s.
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
def _next_tile(counter):
    """The next tile of a persistent CTA: one atomic add on the launch's counter by lane 0 of the calling warp, its
    old value shared with the other lanes."""
    return gl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .b32 lane, taken;\n\tmov.u32 lane, %laneid;\n\t"
        "setp.eq.u32 first, lane, 0;\n\tmov.u32 taken, 0;\n\t@first atom.global.add.u32 taken, [$1], 1;\n\t"
        "shfl.sync.idx.b32 $0, taken, 0, 31, -1;\n\t}",
        "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_place(t, seq_q, NUM_HEADS: gl.constexpr):
    """Tile t's (batch, head, query block's launch place): the places of a (batch, head) are consecutive tiles, as
    the CTAs of the launch without ``PERSISTENT`` (``program_id(0)`` the place, ``program_id(1)`` batch * head)."""
    places = gl.cdiv(seq_q, 2 * WG_ROWS)
    bh = t // places
    return bh // NUM_HEADS, bh % NUM_HEADS, t % places


@gluon.jit
def _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, idx_ptr, j, g, b, hk,
                BN: gl.constexpr, STAGES: gl.constexpr, NAMED_RELEASE: gl.constexpr):
    """A persistent CTA's producer: list entry j of its tile as the CTA's block g (stage ``g % STAGES``), its K
    once the block STAGES before it released the stage's K, its V once that block released its V (mbarriers, or
    named barriers with ``NAMED_RELEASE``)."""
    stage = g % STAGES
    n_blk = block_id(idx_ptr, j)
    if NAMED_RELEASE:
        if g >= STAGES:
            named_barrier_at(_SYNC_RELEASE, RELEASE_BARRIER_ID + stage)
    else:
        mbarrier.wait(kv_empty.index(stage), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma_load(k_desc, [b, hk, n_blk * BN, 0], k_ready.index(stage), box(k_smem.index(stage)))
    if NAMED_RELEASE:
        if g >= STAGES:
            named_barrier_at(_SYNC_RELEASE, RELEASE_BARRIER_ID + STAGES + stage)
    else:
        mbarrier.wait(kv_empty.index(STAGES + stage), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
    tma_load(v_desc, [b, hk, n_blk * BN, 0], v_ready.index(stage), box(v_smem.index(stage)))


# A tile's words in its Q slot (the producer's hand-over; the consumers read them from shared memory, not global):
# the tile's id (-1: none left), its row block, its list's full and total blocks, the list's first entry, and the
# sample's query offset.
_TILE_WORDS = gl.constexpr(8)


@gluon.jit
def _hand_over(words, t, row, n_full, n_total, first, q_start):
    """Write a tile's words (``_TILE_WORDS``) into ``words``, one Q slot's: from the producer's one warp."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    i = gl.arange(0, _TILE_WORDS, layout=layout)
    vals = gl.where(i == 0, t, gl.where(i == 1, row, gl.where(i == 2, n_full, gl.where(i == 3, n_total, gl.where(
        i == 4, first, q_start)))))
    words.store(vals)


@gluon.jit
def _taken(words, j: gl.constexpr):
    """Word j of a tile's words (:func:`_hand_over`), read by a consumer warpgroup."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    vals = words.load(layout)
    return gl.sum(gl.where(gl.arange(0, _TILE_WORDS, layout=layout) == j, vals, 0), axis=0)


@gluon.jit
def _persistent_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, tile_smem, k_ready,
                         v_ready, kv_empty, tiles, lists, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr,
                         BN: gl.constexpr, STAGES: gl.constexpr, NAMED_RELEASE: gl.constexpr):
    """One warp of a persistent CTA: per tile from the counter, once the consumers have released its Q slot (slot
    k % 2 of the CTA's k-th tile, free once the output of tile k - 2 was read out of it), the tile's words and its
    Q into the slot, then its K/V blocks (each once the block STAGES before it released its stage). At the end a -1
    for the consumers, and with ``NAMED_RELEASE`` the releases of the last STAGES blocks, which the consumers arrive
    at as at every block."""
    counter, n_tiles, seq_q = tiles
    COUNTS, stride_cnt_b, INDICES, stride_idx_b, Q_START, stride_qstart_b = lists
    g = 0  # the CTA's blocks so far: the ring's stage and phase run on across its tiles
    k = 0  # its tiles so far
    t = _next_tile(counter)
    while t < n_tiles:
        slot = k % 2
        b, h, place = _tile_place(t, seq_q, NUM_HEADS)
        b64 = b.to(gl.int64)
        row = ordered_row(COUNTS, place, b, stride_cnt_b)
        cnt_ptr = COUNTS + b64 * stride_cnt_b + row * WORDS_PER_ROW
        n_full = gl.load(cnt_ptr)
        n_total = n_full + gl.load(cnt_ptr + 1)
        first = gl.load(cnt_ptr + 2)
        q_start = gl.load(Q_START + b * stride_qstart_b)
        mbarrier.wait(q_empty.index(slot), ((k // 2) & 1) ^ 1)
        _hand_over(tile_smem.index(slot), t, row, n_full, n_total, first, q_start)
        row0 = row * (2 * WG_ROWS)
        mbarrier.expect(q_ready.index(slot), 2 * q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, row0, 0], q_ready.index(slot), box(q_smem.index(2 * slot)))
        tma_load(q_desc, [b, h, row0 + WG_ROWS, 0], q_ready.index(slot), box(q_smem.index(2 * slot + 1)))
        idx_ptr = INDICES + b64 * stride_idx_b + first
        hk = h // GROUP
        for j in range(n_total):
            _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, idx_ptr, j, g + j, b, hk, BN,
                        STAGES, NAMED_RELEASE)
        g += n_total
        k += 1
        t = _next_tile(counter)
    slot = k % 2
    mbarrier.wait(q_empty.index(slot), ((k // 2) & 1) ^ 1)
    _hand_over(tile_smem.index(slot), -1, 0, 0, 0, 0, 0)
    mbarrier.arrive(q_ready.index(slot))  # no tile: the consumers read -1 and end
    if NAMED_RELEASE:
        for j in range(gl.maximum(g - STAGES, 0), g):
            named_barrier_at(_SYNC_RELEASE, RELEASE_BARRIER_ID + j % STAGES)
            named_barrier_at(_SYNC_RELEASE, RELEASE_BARRIER_ID + STAGES + j % STAGES)


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
def _release_keys(kv_empty, stage, PINGPONG: gl.constexpr, TURNS: gl.constexpr = _TURNS_MBARRIER,
                  PERSISTENT: gl.constexpr = False):
    """This warpgroup's scores of the block in ``stage`` are done, so it no longer reads the stage's K: without
    ping-pong, and in a persistent CTA (whose 2 stages at D=128 left each K load on the matmuls' path with
    whole-stage releases), release it (``kv_empty`` ``stage``, or its named barrier), and the producer loads the
    next block's K there while this block's P V runs. Other ping-pong tiles release the whole stage at once
    (:func:`_release_stage`)."""
    if not PINGPONG:
        mbarrier.arrive(kv_empty.index(stage))
    elif PERSISTENT:
        if TURNS == _TURNS_NAMED_RELEASE:
            named_barrier_at(_ARRIVE_RELEASE, RELEASE_BARRIER_ID + stage)
        else:
            mbarrier.arrive(kv_empty.index(stage))


@gluon.jit
def _release_stage(kv_empty, stage, block, n_total, PINGPONG: gl.constexpr, TURNS: gl.constexpr,
                   STAGES: gl.constexpr, PERSISTENT: gl.constexpr = False):
    """This warpgroup no longer reads the K/V stage of ``block``: release it to the producer (without ping-pong and
    in a persistent CTA its V, ``kv_empty`` STAGES + ``stage`` or the named barrier after the K ones:
    :func:`_release_keys` released its K). A named release only where the producer waits for it (a block STAGES
    later exists): an arrive nobody syncs with would stay counted; in a persistent CTA, whose producer syncs with
    the last blocks' releases at its end, at every block."""
    if PINGPONG and TURNS == _TURNS_NAMED_RELEASE:
        if PERSISTENT:
            named_barrier_at(_ARRIVE_RELEASE, RELEASE_BARRIER_ID + STAGES + stage)
        elif block + STAGES < n_total:
            named_barrier_at(_ARRIVE_RELEASE, RELEASE_BARRIER_ID + stage)
    elif PINGPONG and not PERSISTENT:
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
    """One warpgroup, 64 query rows of the CTA's query block (:func:`_consumer_tile`)."""
    _consumer_tile(WG, buffers, barriers, o_desc, lse_ptr, blocks, mask_args, qk_scale, 0, 0, WG, None, BN,
                   HEAD_DIM_PAD, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG, TURNS, False, 0, NUM_HEADS)


@gluon.jit
def _persistent_consumer(WG: gl.constexpr, buffers, barriers, o_desc, LSE, tile_smem, q_empty, lists, qk_scale,
                         BN: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
                         MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                         PINGPONG: gl.constexpr, TURNS: gl.constexpr, NUM_HEADS: gl.constexpr):
    """One warpgroup of a persistent CTA: :func:`_consumer_tile` of each tile the producer hands over, its Q in slot
    k % 2 of the CTA's k-th tile, the ring's blocks and the turns counted on across tiles. The slot is released once
    the next tile's words are read and the output's store has read the slot's Q tile. The named turns run on across
    tiles too: warpgroup 1 arrives at warpgroup 0's first turn once, and after each of its turns, the last of a tile
    included; warpgroup 0 syncs once more at the end to match the last."""
    (INDICES, Q_BITS, K_BITS, MASK, stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_idx_b, seq_q,
     seq_k, window) = lists
    q_ready = barriers[0]
    if PINGPONG and TURNS == _TURNS_NAMED_RELEASE and WG == 1:
        named_barrier(_ARRIVE_TURN_0)  # warpgroup 0 goes first; matched by its sync of turn 0
    first_block = 0
    first_turn = 0
    k = 0
    mbarrier.wait(q_ready.index(0), 0)
    t = _taken(tile_smem.index(0), 0)
    while t >= 0:
        slot = k % 2
        words = tile_smem.index(slot)
        n_full = _taken(words, 2)
        n_total = _taken(words, 3)
        b = t // gl.cdiv(seq_q, 2 * WG_ROWS) // NUM_HEADS
        b64 = b.to(gl.int64)
        mask_args = (Q_BITS + b64 * stride_qbits_b, K_BITS + b64 * stride_kbits_b, MASK + b64 * stride_mask_b,
                     stride_mask_q, seq_q, seq_k, _taken(words, 5), window)
        blocks = (INDICES + b64 * stride_idx_b + _taken(words, 4), n_full, n_total, _taken(words, 1) * (2 * WG_ROWS))
        _consumer_tile(WG, buffers, barriers, o_desc, LSE, blocks, mask_args, qk_scale, first_block, first_turn,
                       2 * slot + WG, words, BN, HEAD_DIM_PAD, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG,
                       TURNS, True, seq_q, NUM_HEADS)
        first_block += n_total
        first_turn += gl.where(n_total > 0, n_total + 1, 0)
        k += 1
        mbarrier.wait(q_ready.index(k % 2), (k // 2) & 1)
        t = _taken(tile_smem.index(k % 2), 0)
        tma.store_wait(0)  # the output's store has read this slot's Q tile
        mbarrier.arrive(q_empty.index(slot))
    if PINGPONG and TURNS == _TURNS_NAMED_RELEASE and WG == 0:
        named_barrier(_SYNC_TURN_0)  # warpgroup 1's last arrive (its first, where the CTA took no tile)


@gluon.jit
def _consumer_tile(WG: gl.constexpr, buffers, barriers, o_desc, lse_ptr, blocks, mask_args, qk_scale, first_block,
                   first_turn, q_index, words, BN: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, STAGES: gl.constexpr,
                   MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                   PINGPONG: gl.constexpr, TURNS: gl.constexpr, PERSISTENT: gl.constexpr, seq_q=0,
                   NUM_HEADS: gl.constexpr = 1):
    """One warpgroup, 64 query rows of a tile (its Q landed, or about to), Q in ``q_smem.index(q_index)``.
    Iteration j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, and does the softmax of S_j while the second
    matmul runs. Its turn (with PINGPONG) is turn j: turn 0 issues S_0 alone, turn n_total the last P V alone. The
    tile's blocks are the CTA's ``first_block`` on (the ring's stages and phases) and its turns ``first_turn`` on:
    both 0 but in a persistent CTA (``PERSISTENT``: ``lse_ptr`` is then LSE, the tile's batch and head are read
    again from its ``words`` after the loop rather than held across it, and the caller waits for the output's
    store)."""
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
    q = q_smem.index(q_index)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([WG_ROWS], gl.float32, rows)
    acc = gl.zeros([WG_ROWS, HEAD_DIM_PAD], gl.float32, o_layout)
    s_zero = gl.zeros([WG_ROWS, BN], gl.float32, s_layout)
    if not PERSISTENT:  # a persistent CTA waited for Q before it read the tile's id
        mbarrier.wait(q_bar, 0)
    if n_total > 0:
        if PINGPONG and TURNS == _TURNS_NAMED_RELEASE and WG == 1 and not PERSISTENT:
            named_barrier(_ARRIVE_TURN_0)  # warpgroup 0 goes first; matched by its sync of turn 0
        # Block 0: its scores alone.
        first_stage = first_block % STAGES
        _take_turn(turn, WG, first_turn, PINGPONG, TURNS)
        mbarrier.wait(k_ready.index(first_stage), (first_block // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(first_stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _hand_off(turn, WG, first_turn, PINGPONG, TURNS)
        s = warpgroup_mma_wait(0, deps=(s,))
        _release_keys(kv_empty, first_stage, PINGPONG, TURNS, PERSISTENT)
        if n_full == 0:
            s = masked_scores(s, offs_m, q_bits, block_id(idx_ptr, 0), mask_args, BN, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        for it in range(1, n_total):
            g = first_block + it  # the CTA's block
            stage = g % STAGES
            prev = (g - 1) % STAGES
            _take_turn(turn, WG, first_turn + it, PINGPONG, TURNS)
            mbarrier.wait(k_ready.index(stage), (g // STAGES) & 1)
            q_tile = q_smem.index(q_index) if PERSISTENT else resident_tile(q_smem, WG, HEAD_DIM_PAD)
            s = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
            _hand_off(turn, WG, first_turn + it, PINGPONG, TURNS)
            s = warpgroup_mma_wait(1, deps=(s,))
            _release_keys(kv_empty, stage, PINGPONG, TURNS, PERSISTENT)
            if it >= n_full:
                s = masked_scores(s, offs_m, q_bits, block_id(idx_ptr, it), mask_args, BN, MASK_MODE, IS_CAUSAL,
                                  HAS_WINDOW)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
            _release_stage(kv_empty, prev, it - 1, n_total, PINGPONG, TURNS, STAGES, PERSISTENT)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
            p_prev = gl.convert_layout(p.to(dtype), p_layout)
        last = (first_block + n_total - 1) % STAGES
        _take_turn(turn, WG, first_turn + n_total, PINGPONG, TURNS)
        mbarrier.wait(v_ready.index(last), ((first_block + n_total - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
        # a persistent CTA's turns run on into its next tile: warpgroup 1 hands the turn over after its last too
        _hand_off(turn, WG, first_turn + n_total, PINGPONG, TURNS, LAST=not PERSISTENT)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        if PERSISTENT or not (PINGPONG and TURNS == _TURNS_NAMED_RELEASE):  # else no block comes STAGES after
            _release_stage(kv_empty, last, n_total - 1, n_total, PINGPONG, TURNS, STAGES, PERSISTENT)

    # Rows that attend nothing: l = 0, output 0, lse = +inf (the backward's exp2(s - lse) is then 0).
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    if PERSISTENT:  # the tile's (b, h), read again rather than held across the loop
        b, h, place = _tile_place(_taken(words, 0), seq_q, NUM_HEADS)
        lse_ptr = lse_ptr + (b * NUM_HEADS + h).to(gl.int64) * seq_q
    gl.store(lse_ptr + offs_m, gl.where(empty, float("inf"), m_i * qk_scale + gl.log2(l_safe)), mask=offs_m < seq_q)
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
    q.store(out.to(dtype))  # this warpgroup's Q rows are no longer read: stage the output there
    fence_async_shared()
    if not PERSISTENT:
        pid_bh = gl.program_id(1)  # (b, h) recomputed here, not held across the loop
        b = pid_bh // NUM_HEADS
        h = pid_bh % NUM_HEADS
    tma_store(o_desc, [b, h, row0 + WG * WG_ROWS, 0], box(q))
    if not PERSISTENT:
        tma.store_wait(0)


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def attention_fwd_gluon(
    q_desc, k_desc, v_desc, o_desc, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, TILE_COUNTER, n_tiles,
    NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BN: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    PINGPONG: gl.constexpr, TURNS: gl.constexpr = _TURNS_MBARRIER, PERSISTENT: gl.constexpr = False,
):
    """One CTA per (128-row query block, batch*head); arguments as the ``tl`` forward's (no dropout, no splits),
    save that Q, K, V and O come as ``host_tma`` descriptors. Tiles are HEAD_DIM_PAD wide: TMA reads the columns
    past the head dim as zeros and drops writes there. ``TURNS`` (read with PINGPONG): how the warpgroups take
    turns, ``constants.TURNS_*``. ``PERSISTENT``: the CTAs take the ``n_tiles`` tiles from TILE_COUNTER, a zeroed
    int32 (:func:`_persistent_forward`); without it neither is read."""
    gl.static_assert(STAGES >= 2, "a stage stays in use until the next block's Q K^T is issued")
    if PERSISTENT:
        _persistent_forward(q_desc, k_desc, v_desc, o_desc, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
                            stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
                            seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, TILE_COUNTER, n_tiles,
                            NUM_HEADS, GROUP, HEAD_DIM_PAD, BN, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG,
                            TURNS)
    else:
        _one_tile_forward(q_desc, k_desc, v_desc, o_desc, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
                          stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
                          seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, NUM_HEADS, GROUP, HEAD_DIM_PAD,
                          BN, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG, TURNS)


@gluon.jit
def _persistent_forward(q_desc, k_desc, v_desc, o_desc, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
                        stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
                        seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, TILE_COUNTER, n_tiles,
                        NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BN: gl.constexpr,
                        STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr,
                        HAS_WINDOW: gl.constexpr, PINGPONG: gl.constexpr, TURNS: gl.constexpr):
    """A persistent CTA (the module's docstring): two slots of Q's shared tiles and of the tile's words, each with a
    ``q_ready`` (Q landed, the words written) and a ``q_empty`` barrier (both consumer warpgroups are done with the
    slot), beside the one-tile CTA's ring."""
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM_PAD], dtype)
    named_release: gl.constexpr = PINGPONG and TURNS == _TURNS_NAMED_RELEASE
    turn_mbarriers: gl.constexpr = PINGPONG and TURNS == _TURNS_MBARRIER
    gl.static_assert(not named_release or RELEASE_BARRIER_ID + 2 * STAGES <= 16, "a CTA has 16 named barriers")
    q_smem = gl.allocate_shared_memory(dtype, [4, WG_ROWS, HEAD_DIM_PAD], q_layout)  # slot * 2 + warpgroup
    k_smem, v_smem = allocate_kv_ring(dtype, STAGES, BN, HEAD_DIM_PAD)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, _TILE_WORDS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # A stage's K and its V are released apart, with or without ping-pong (named releases: 2 barrier ids a stage)
    kv_sets: gl.constexpr = 2
    releases: gl.constexpr = 0 if named_release else kv_sets
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [kv_sets * STAGES, 1], layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    for slot in gl.static_range(2):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(q_empty.index(slot), count=2)  # one arrival per consumer warpgroup
    init_kv_ring(k_ready, v_ready, kv_empty, STAGES, releases)
    if turn_mbarriers:
        _init_turns(turn)
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (q_smem, k_smem, v_smem)
    barriers = (q_ready, k_ready, v_ready, kv_empty, turn)
    lists = (INDICES, Q_BITS, K_BITS, MASK, stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_idx_b,
             seq_q, seq_k, window)
    gl.warp_specialize(
        [
            (_persistent_consumer, (0, buffers, barriers, o_desc, LSE, tile_smem, q_empty, lists, qk_scale, BN,
                                    HEAD_DIM_PAD, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG, TURNS,
                                    NUM_HEADS)),
            (_persistent_consumer, (1, buffers, barriers, o_desc, LSE, tile_smem, q_empty, lists, qk_scale, BN,
                                    HEAD_DIM_PAD, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, PINGPONG, TURNS,
                                    NUM_HEADS)),
            (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, tile_smem,
                                    k_ready, v_ready, kv_empty, (TILE_COUNTER, n_tiles, seq_q),
                                    (COUNTS, stride_cnt_b, INDICES, stride_idx_b, Q_START, stride_qstart_b),
                                    NUM_HEADS, GROUP, BN, STAGES, named_release)),
        ],
        WORKER_WARPS,
        WORKER_REGS,
    )
    # Every partition has returned: no barrier is waited on or signalled again.
    invalidate_ring(q_ready, 2)
    invalidate_ring(q_empty, 2)
    invalidate_kv_ring(k_ready, v_ready, kv_empty, STAGES, releases)
    if turn_mbarriers:
        invalidate_ring(turn, 2)


@gluon.jit
def _one_tile_forward(q_desc, k_desc, v_desc, o_desc, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
                      stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
                      seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, NUM_HEADS: gl.constexpr,
                      GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                      MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                      PINGPONG: gl.constexpr, TURNS: gl.constexpr):
    """A CTA per tile: its query block ``program_id(0)``-th longest of batch * head ``program_id(1)``."""
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
