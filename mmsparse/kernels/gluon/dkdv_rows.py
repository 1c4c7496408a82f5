"""What the kernels by key block (the D <= 128 dK/dV kernel, the D=256 one, the one pass with a dQ writer) share: the
program's key block and its list, the ring of query-side tiles, and the producer's query side: for every listed
query block of every head of the KV group, its lse, delta and query-index rows (and, in a partial block, its query
bits or codes, or under segment codes its words over the key block's runs: :mod:`.key_runs`) stored into the stage,
then Q and dO by TMA onto the stage's ready barrier."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..constants import MASK_DENSE
from ..lists import block_id, ordered_row
from .common import box, program_lists, thread_barrier, tma_load
from .key_runs import row_words

_MASK_DENSE = gl.constexpr(MASK_DENSE)


@gluon.jit
def key_block_lists(COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b,
                    stride_mask_q, stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window,
                    NUM_KV_HEADS: gl.constexpr, KEYS: gl.constexpr, own_blocks=0, OWN_FIRST: gl.constexpr = False,
                    SHORTEST_FIRST: gl.constexpr = False, HEADS_SECTION: gl.constexpr = 1):
    """This program's ``(b, hk, col0, n_full, n_total, idx_ptr, mask_args)``: of batch ``b`` and KV head ``hk``
    (``program_id(1)`` = b * NUM_KV_HEADS + hk), key block ``program_id(0)``'s place in the lists' launch order,
    longest list first (``lists.ordered_row``; ``KEYS`` keys from ``col0``), and its list
    (``common.program_lists``). With ``OWN_FIRST`` the programs take the key blocks in launch order so that the
    first ``own_blocks`` key blocks of every (batch, KV head) come before any other: those keys are present at the
    launch, the others are still landing (:func:`.common.wait_for_arrival`). With ``SHORTEST_FIRST`` the programs
    take the launch order backwards: shortest list first (the ordered dQ adds, ``mask.add_order``). Past 1,
    ``HEADS_SECTION`` (batch, KV head)s take each place in that order in turn (:func:`_heads_in_sections`)."""
    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if OWN_FIRST:
        pid_n, pid_bh = _own_first(pid_n, pid_bh, own_blocks)
    if HEADS_SECTION > 1:
        pid_n, pid_bh = _heads_in_sections(pid_n, pid_bh, HEADS_SECTION)
    b = pid_bh // NUM_KV_HEADS
    hk = pid_bh % NUM_KV_HEADS
    if SHORTEST_FIRST:
        pid_n = ordered_row(COUNTS, gl.num_programs(0) - 1 - pid_n, b, stride_cnt_b)
    elif not OWN_FIRST:
        pid_n = ordered_row(COUNTS, pid_n, b, stride_cnt_b)
    n_full, n_total, idx_ptr, mask_args = program_lists(
        b, pid_n, COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b,
        stride_mask_q, stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window)
    return b, hk, pid_n * KEYS, n_full, n_total, idx_ptr, mask_args


@gluon.jit
def _heads_in_sections(pid_n, pid_bh, SECTION: gl.constexpr):
    """(place in the key blocks' order, batch * KV head) of the program at launch position pid_n + pid_bh * blocks
    when the (batch, KV head)s go in sections of SECTION (the last may hold fewer), each section place by place,
    its heads in turn at each place: a head's programs still start in its own order, SECTION times further apart
    (the ordered dQ writer's ranks group its rows accordingly: ``mask.add_order``)."""
    blocks = gl.num_programs(0)
    linear = pid_n + pid_bh * blocks
    first = (linear // (blocks * SECTION)) * SECTION  # the section's first (batch, KV head)
    within = linear - first * blocks
    heads = gl.minimum(gl.num_programs(1) - first, SECTION)
    return within // heads, first + within % heads


@gluon.jit
def _own_first(pid_n, pid_bh, own_blocks):
    """(key block, batch * KV head) of the program at launch position pid_n + pid_bh * blocks: the own blocks of
    every (batch, KV head) first, then the others, each part with the key block fastest."""
    blocks = gl.num_programs(0)
    linear = pid_n + pid_bh * blocks
    own_programs = own_blocks * gl.num_programs(1)
    if linear < own_programs:
        pid_n = linear % own_blocks
        pid_bh = linear // own_blocks
    else:
        others = linear - own_programs
        pid_n = own_blocks + others % (blocks - own_blocks)
        pid_bh = others // (blocks - own_blocks)
    return pid_n, pid_bh


@gluon.jit
def allocate_query_stages(dtype: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                          MASK_MODE: gl.constexpr):
    """The ring that :func:`stage_query_blocks` fills: ``(q, do, lse, delta, rows, qbits)`` shared tiles of
    ``STAGES`` query blocks of ``BM`` rows (one qbits tile for a dense mask, which reads none)."""
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_DIM_PAD], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, HEAD_DIM_PAD], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, HEAD_DIM_PAD], q_layout)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], row_layout)
    rows_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BM], row_layout)
    qbits_smem = gl.allocate_shared_memory(gl.int32, [STAGES if MASK_MODE != _MASK_DENSE else 1, BM], row_layout)
    return q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem


@gluon.jit
def _part(row_smem, part, PART: gl.constexpr, BM: gl.constexpr):
    """Rows part * PART .. (part + 1) * PART - 1 of a stage's ``[BM]`` row tile (the tile itself when PART is BM)."""
    if PART == BM:
        return row_smem
    return row_smem.slice(part * PART, PART)


@gluon.jit
def stage_query_blocks(LSE, DELTA, q_desc, do_desc, stages, ready, empty, idx_ptr, n_full, n_total, b, hk, q_bits_ptr,
                       seq_q, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr,
                       STAGES: gl.constexpr, MASK_MODE: gl.constexpr, ROW_PART: gl.constexpr = 0,
                       HEADS_INNER: gl.constexpr = False, key_runs=None):
    """``stages``: the ring's (q, do, lse, delta, rows, qbits) shared tiles; step ``g * n_total + it`` (head g of
    the group, list entry it; with ``HEADS_INNER`` step ``it * GROUP + g``: every head of an entry in turn) takes
    stage ``step % STAGES`` once the consumers have released it (``empty``). ``ROW_PART``: the rows are loaded and
    stored ROW_PART at a time (0: all BM at once), a warp barrier between parts; the first part's lse and delta
    are loaded before the wait for the stage, as whole rows are. At BM = 128 the one warp's whole rows (4
    registers each a lane) spilled at its 24 registers, and so did 64-row parts, whose loads ptxas hoisted above
    the first part's stores without the barrier. ``key_runs`` (segment codes): ``(run_codes, n_runs, pair table,
    its row stride)`` of :mod:`.key_runs`; where ``n_runs`` is not 0 a partial block's rows get their words over the
    key block's runs instead of their codes."""
    if HEADS_INNER:
        for it in range(n_total):
            for g in range(GROUP):
                h = hk * GROUP + g
                _stage_step(LSE, DELTA, q_desc, do_desc, stages, ready, empty, idx_ptr, n_full, it * GROUP + g, h,
                            (b.to(gl.int64) * NUM_HEADS + h) * seq_q, it, b, q_bits_ptr, seq_q, BM, STAGES,
                            MASK_MODE, ROW_PART, key_runs)
    else:
        for g in range(GROUP):
            h = hk * GROUP + g
            row0 = (b.to(gl.int64) * NUM_HEADS + h) * seq_q
            for it in range(n_total):
                _stage_step(LSE, DELTA, q_desc, do_desc, stages, ready, empty, idx_ptr, n_full, g * n_total + it, h,
                            row0, it, b, q_bits_ptr, seq_q, BM, STAGES, MASK_MODE, ROW_PART, key_runs)


@gluon.jit
def _stage_step(LSE, DELTA, q_desc, do_desc, stages, ready, empty, idx_ptr, n_full, i, h, row0, it, b, q_bits_ptr,
                seq_q, BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, ROW_PART: gl.constexpr,
                key_runs=None):
    """Step i of :func:`stage_query_blocks`: head h's rows of list entry it (its lse and delta rows from ``row0``),
    into stage ``i % STAGES``."""
    q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = stages
    PART: gl.constexpr = BM if ROW_PART == 0 else ROW_PART
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    stage = i % STAGES
    m_blk = block_id(idx_ptr, it)
    for part in gl.static_range(BM // PART):
        offs_m = m_blk * BM + part * PART + gl.arange(0, PART, layout=rows)
        # Rows past the end get lse = +inf, hence p = 0.
        lse = gl.load(LSE + row0 + offs_m, mask=offs_m < seq_q, other=float("inf"))
        delta = gl.load(DELTA + row0 + offs_m, mask=offs_m < seq_q, other=0.0)
        if part == 0:
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        _part(lse_smem.index(stage), part, PART, BM).store(lse)
        _part(delta_smem.index(stage), part, PART, BM).store(delta)
        _part(rows_smem.index(stage), part, PART, BM).store(offs_m)
        if MASK_MODE != _MASK_DENSE:
            if it >= n_full:
                # Rows past the end get no bits (code 0 is masked by the row bound), hence no allowed pair.
                bits = gl.load(q_bits_ptr + offs_m, mask=offs_m < seq_q, other=0)
                if key_runs is not None:
                    run_codes, n_runs, table_ptr, stride_table = key_runs
                    if n_runs > 0:
                        bits = row_words(bits, offs_m < seq_q, run_codes, n_runs, table_ptr, stride_table)
                _part(qbits_smem.index(stage), part, PART, BM).store(bits)
        if part < BM // PART - 1:
            thread_barrier()  # the next part's loads after these stores (bar.warp.sync)
    # The arrival (expect) releases these stores to the consumers, which acquire them with the wait on ready.
    mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, m_blk * BM, 0], ready.index(stage), box(q_smem.index(stage)))
    tma_load(do_desc, [b, h, m_blk * BM, 0], ready.index(stage), box(do_smem.index(stage)))
