"""tl kernel of the block lists from segment-code runs (see mmsparse.mask.code_lists)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import CAUSAL, SEG_BITS
from ..lists import WORDS_PER_ROW
from .bit_lists import PHASE_COUNT, PHASE_WRITE, count_chunk, list_rows, store_chunk, store_counts

_SEG_BITS = tl.constexpr(SEG_BITS)
_SEG_MASK = tl.constexpr((1 << SEG_BITS) - 1)
_CAUSAL = tl.constexpr(CAUSAL)


@triton.jit(do_not_specialize=["stride_cb", "stride_tb", "stride_sb", "seq"])
def code_runs_kernel(CODES, RUN, STARTS, RUN_CODES, stride_cb, stride_tb, stride_sb, seq, CHUNK: tl.constexpr):
    """Program b cuts row b of the codes into runs, CHUNK tokens a step: ``RUN[b, t]`` the run of token t,
    ``STARTS[b, r]`` the first token of run r (and ``STARTS[b, n_runs] = seq``), ``RUN_CODES[b, r]`` its code."""
    b64 = tl.program_id(0).to(tl.int64)
    codes = CODES + b64 * stride_cb
    run_ptr, starts, run_codes = RUN + b64 * stride_tb, STARTS + b64 * stride_sb, RUN_CODES + b64 * stride_sb
    n_runs = 0
    for c0 in range(0, seq, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        m = offs < seq
        cur = tl.load(codes + offs, mask=m, other=0)
        before = tl.load(codes + offs - 1, mask=m & (offs > 0), other=0)
        change = m & ((offs == 0) | (cur != before))
        run = n_runs + tl.cumsum(change.to(tl.int32), 0) - 1
        tl.store(run_ptr + offs, run, mask=m)
        tl.store(starts + run, offs, mask=change)
        tl.store(run_codes + run, cur, mask=change)
        n_runs += tl.sum(change.to(tl.int32), 0)
    tl.store(starts + n_runs, seq)


@triton.jit(do_not_specialize=["stride_cb", "stride_rb", "stride_ob", "seq", "n_blocks"])
def run_summary_kernel(CODES, RUN, OUT, stride_cb, stride_rb, stride_ob, seq, n_blocks, BLOCK: tl.constexpr,
                       G: tl.constexpr):
    """Program (g, b) writes ``OUT[b, blk] = (first run, last run, lowest doc, highest doc)`` of the blocks
    blk = g*G .. g*G+G-1 of BLOCK tokens (the words ``_classify_runs`` reads)."""
    i_g, b64 = tl.program_id(0), tl.program_id(1).to(tl.int64)
    blk = i_g * G + tl.arange(0, G)  # [G]
    m_b = blk < n_blocks
    tok = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [G, BLOCK]
    m_t = m_b[:, None] & (tok < seq)
    run, codes = RUN + b64 * stride_rb, CODES + b64 * stride_cb
    docs = tl.load(codes + tok, mask=m_t, other=0) >> _SEG_BITS
    p_out = OUT + b64 * stride_ob + blk * 4
    tl.store(p_out, tl.load(run + blk * BLOCK, mask=m_b, other=0), mask=m_b)
    tl.store(p_out + 1, tl.load(run + tl.minimum(blk * BLOCK + BLOCK, seq) - 1, mask=m_b, other=0), mask=m_b)
    tl.store(p_out + 2, tl.min(tl.where(m_t, docs, 2**31 - 1), 1), mask=m_b)
    tl.store(p_out + 3, tl.max(tl.where(m_t, docs, -1), 1), mask=m_b)


@triton.jit
def _classify_runs(
    qb, kb, valid, q_sum, k_sum, q_firsts, q_codes, k_firsts, k_codes, table, stride_table, q_start, seq_q, seq_k,
    window, BM: tl.constexpr, BN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """(full, live) of the tiles (query block qb, key block kb), broadcastable block-id tiles, where valid. With
    HAS_WINDOW a run pair's pairs must also have key position > query position - window."""
    q_lo = tl.load(q_sum + qb * 4, mask=valid, other=0)
    q_hi = tl.load(q_sum + qb * 4 + 1, mask=valid, other=-1)
    k_lo = tl.load(k_sum + kb * 4, mask=valid, other=0)
    k_hi = tl.load(k_sum + kb * 4 + 1, mask=valid, other=-1)
    meet = valid & (tl.load(q_sum + qb * 4 + 2, mask=valid, other=0) <= tl.load(k_sum + kb * 4 + 3, mask=valid,
                                                                                 other=0))
    meet = meet & (tl.load(k_sum + kb * 4 + 2, mask=valid, other=0) <= tl.load(q_sum + qb * 4 + 3, mask=valid,
                                                                                other=0))
    q0 = qb * BM
    q1 = tl.minimum(q0 + BM, seq_q)
    k0 = kb * BN
    k1 = tl.minimum(k0 + BN, seq_k)
    if HAS_WINDOW:  # tiles wholly before the band skip their runs
        meet = meet & (k1 - 1 > q0 + q_start - window)
    full = meet & (k0 + BN <= seq_k)  # a key block running past the keys is never full
    live = meet != meet
    n_x = tl.max(tl.max(tl.where(meet, q_hi - q_lo + 1, 0), 1), 0)
    n_y = tl.max(tl.max(tl.where(meet, k_hi - k_lo + 1, 0), 1), 0)
    for dx in range(0, n_x):
        x = q_lo + dx
        in_x = meet & (x <= q_hi)
        x_first = tl.maximum(tl.load(q_firsts + x, mask=in_x, other=0), q0) + q_start  # positions of the run's rows
        x_last = tl.minimum(tl.load(q_firsts + x + 1, mask=in_x, other=0), q1) - 1 + q_start
        x_code = tl.load(q_codes + x, mask=in_x, other=0)
        for dy in range(0, n_y):
            y = k_lo + dy
            v = in_x & (y <= k_hi)
            y_first = tl.maximum(tl.load(k_firsts + y, mask=v, other=0), k0)
            y_last = tl.minimum(tl.load(k_firsts + y + 1, mask=v, other=0), k1) - 1
            y_code = tl.load(k_codes + y, mask=v, other=0)
            kind = tl.load(table + (x_code & _SEG_MASK) * stride_table + (y_code & _SEG_MASK), mask=v, other=0)
            kind = tl.where(((x_code ^ y_code) >> _SEG_BITS) == 0, kind, 0)
            ordered = (kind == _CAUSAL) | IS_CAUSAL
            some = v & (kind != 0) & (~ordered | (y_first <= x_last))
            every = (kind != 0) & (~ordered | (y_last <= x_first))
            if HAS_WINDOW:
                some = some & (y_last > x_first - window)
                every = every & (y_first > x_last - window)
            live = live | some
            full = full & (~v | every)
    return full, live


@triton.jit
def _chunk_classes(offs_c, offs_r, m_r, n_c, q_sum, k_sum, q_firsts, q_codes, k_firsts, k_codes, table, stride_table,
                   q_start, seq_q, seq_k, window, BM: tl.constexpr, BN: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, BY_KEY: tl.constexpr):
    """(full, live) ``[BR, CB]`` of the program's row blocks against the column blocks offs_c."""
    valid = m_r[:, None] & (offs_c < n_c)[None, :]
    if BY_KEY:
        qb, kb = offs_c[None, :], offs_r[:, None]
    else:
        qb, kb = offs_r[:, None], offs_c[None, :]
    return _classify_runs(qb, kb, valid, q_sum, k_sum, q_firsts, q_codes, k_firsts, k_codes, table, stride_table,
                          q_start, seq_q, seq_k, window, BM, BN, IS_CAUSAL, HAS_WINDOW)


@triton.jit(do_not_specialize=["stride_qs", "stride_ks", "stride_qr", "stride_kr", "stride_pb", "stride_cb",
                               "stride_ib", "stride_table", "seq_q", "seq_k", "n_q", "n_k", "window"])
def segment_lists_kernel(
    Q_SUM, K_SUM, Q_FIRSTS, Q_CODES, K_FIRSTS, K_CODES, TABLE, Q_START, COUNTS, INDICES,
    stride_qs, stride_ks, stride_qr, stride_kr, stride_qstart, stride_cb, stride_ib, stride_table,
    seq_q, seq_k, n_q, n_k, window,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, CB: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, BY_KEY: tl.constexpr, PHASE: tl.constexpr,
):
    """Program (g, b) handles the row blocks r = g*BR .. g*BR+BR-1 (key blocks when BY_KEY) of sample b: full
    column blocks in ascending order, then the partial ones, as PHASE says (as ``bit_lists.block_lists_kernel``)."""
    i_g, i_b = tl.program_id(0), tl.program_id(1)
    b64 = i_b.to(tl.int64)
    q_sum, k_sum = Q_SUM + b64 * stride_qs, K_SUM + b64 * stride_ks
    q_firsts, q_codes = Q_FIRSTS + b64 * stride_qr, Q_CODES + b64 * stride_qr
    k_firsts, k_codes = K_FIRSTS + b64 * stride_kr, K_CODES + b64 * stride_kr
    q_start = tl.load(Q_START + i_b * stride_qstart)
    n_r, n_c = (n_k, n_q) if BY_KEY else (n_q, n_k)
    offs_r = i_g * BR + tl.arange(0, BR)
    m_r = offs_r < n_r
    offs_cb = tl.arange(0, CB)
    p_cnt = COUNTS + i_b * stride_cb + offs_r * WORDS_PER_ROW
    p_idx, n_full = list_rows(p_cnt, INDICES, b64, offs_r, m_r, n_c, stride_ib, PHASE)

    n_part = tl.zeros([BR], dtype=tl.int32)
    if PHASE != PHASE_WRITE:
        for c0 in range(0, n_c, CB):
            full, live = _chunk_classes(c0 + offs_cb, offs_r, m_r, n_c, q_sum, k_sum, q_firsts, q_codes, k_firsts,
                                        k_codes, TABLE, stride_table, q_start, seq_q, seq_k, window, BM, BN, IS_CAUSAL,
                                        HAS_WINDOW, BY_KEY)
            if PHASE != PHASE_COUNT:
                live = full  # the first of two passes counts the full tiles only
            n_full, n_part = count_chunk(full, live, n_full, n_part)
    if PHASE != PHASE_COUNT:
        i_full, i_part = tl.zeros([BR], dtype=tl.int32), n_full
        for c0 in range(0, n_c, CB):
            offs_c = c0 + offs_cb
            full, live = _chunk_classes(offs_c, offs_r, m_r, n_c, q_sum, k_sum, q_firsts, q_codes, k_firsts, k_codes,
                                        TABLE, stride_table, q_start, seq_q, seq_k, window, BM, BN, IS_CAUSAL,
                                        HAS_WINDOW, BY_KEY)
            i_full, i_part = store_chunk(p_idx, offs_c, full, live, i_full, i_part)
        n_part = i_part - n_full
    store_counts(p_cnt, m_r, n_full, n_part, offs_r, n_c, PHASE)
