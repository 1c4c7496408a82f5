"""tl kernels of the block lists from per-token bits (see mmsparse.mask.bit_lists)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import LISTS_COUNT, LISTS_DENSE, LISTS_WRITE
from ..lists import WORDS_PER_ROW

_NEG = tl.constexpr(-(2**31) + 1)  # below every position
_POS = tl.constexpr(2**31 - 1)  # above every position

@triton.jit(do_not_specialize=["stride_qb", "stride_kb", "stride_pb", "stride_sb", "seq_q", "seq_k", "n_q", "n_k"])
def block_summary_kernel(
    Q_BITS, K_BITS, Q_START, SUM,
    stride_qb, stride_kb, stride_qstart, stride_sb,
    seq_q, seq_k, n_q, n_k, bit_mask,
    BM: tl.constexpr, BN: tl.constexpr, GQ: tl.constexpr, GK: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Program (g, b) summarises query blocks g*GQ .. g*GQ+GQ-1 and key blocks g*GK .. g*GK+GK-1 of sample b
    into ``SUM[b, blk]`` and ``SUM[b, n_q + blk]`` (W words each; with HAS_WINDOW the last two are the block's
    first and last position, clipped to the sequence)."""
    i_g, i_b = tl.program_id(0), tl.program_id(1)
    b64 = i_b.to(tl.int64)  # B * S token bits may pass 2^31
    offs_t = tl.arange(0, K)
    p_sum = SUM + i_b * stride_sb
    if i_g * GQ < n_q:
        offs_qb = i_g * GQ + tl.arange(0, GQ)  # [GQ]
        offs_m = offs_qb[:, None] * BM + tl.arange(0, BM)[None, :]  # [GQ, BM]
        m_q = offs_m < seq_q
        b_q = tl.load(Q_BITS + b64 * stride_qb + offs_m, mask=m_q, other=0)  # [GQ, BM]; bits >= k meet no key
        b_see = (b_q[:, :, None] >> offs_t[None, None, :]) & 1  # [GQ, BM, K]
        p_s = p_sum + offs_qb * W
        m_s = offs_qb < n_q
        # OR, and AND over the real rows, bit by bit; the bits are distinct, so their sum is their OR.
        tl.store(p_s, tl.sum(tl.max(b_see, 1) << offs_t[None, :], 1), mask=m_s)
        tl.store(p_s + 1, tl.sum(tl.min(tl.where(m_q[:, :, None], b_see, 1), 1) << offs_t[None, :], 1), mask=m_s)
        if IS_CAUSAL:
            q_start = tl.load(Q_START + i_b * stride_qstart)
            tl.store(p_s + 2, q_start + offs_qb * BM, mask=m_s)
            b_last = tl.max(tl.where(b_see != 0, q_start + offs_m[:, :, None], _NEG), 1)  # [GQ, K]
            tl.store(p_s[:, None] + 3 + offs_t[None, :], b_last, mask=m_s[:, None])
        if HAS_WINDOW:
            q_start = tl.load(Q_START + i_b * stride_qstart)
            tl.store(p_s + W - 2, q_start + offs_qb * BM, mask=m_s)
            tl.store(p_s + W - 1, q_start + tl.minimum(offs_qb * BM + BM, seq_q) - 1, mask=m_s)
    if i_g * GK < n_k:
        offs_kb = i_g * GK + tl.arange(0, GK)  # [GK]
        offs_n = offs_kb[:, None] * BN + tl.arange(0, BN)[None, :]  # [GK, BN]
        b_k = tl.load(K_BITS + b64 * stride_kb + offs_n, mask=offs_n < seq_k, other=0) & bit_mask  # [GK, BN]
        b_has = (b_k[:, :, None] >> offs_t[None, None, :]) & 1  # [GK, BN, K]
        p_s = p_sum + (n_q + offs_kb) * W
        m_s = offs_kb < n_k
        tl.store(p_s, tl.sum(tl.max(b_has, 1) << offs_t[None, :], 1), mask=m_s)
        tl.store(p_s + 1, tl.max((b_k == 0).to(tl.int32), 1), mask=m_s)  # a padding column, or one past seq_k
        if IS_CAUSAL:
            tl.store(p_s + 2, offs_kb * BN + BN - 1, mask=m_s)  # a block running past seq_k is dirty anyway
            b_first = tl.min(tl.where(b_has != 0, offs_n[:, :, None], _POS), 1)  # [GK, K]
            tl.store(p_s[:, None] + 3 + offs_t[None, :], b_first, mask=m_s[:, None])
        if HAS_WINDOW:
            tl.store(p_s + W - 2, offs_kb * BN, mask=m_s)
            tl.store(p_s + W - 1, tl.minimum(offs_kb * BN + BN, seq_k) - 1, mask=m_s)


@triton.jit
def _classify(r_or, r_x, r_edge, r_pos, r_span, p_col, offs_c, m_r, n_c, window, K: tl.constexpr, W: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BY_KEY: tl.constexpr, LIVE: tl.constexpr):
    """(full, live) bool ``[BR, CB]`` of row blocks (summaries ``r_*``: [BR, 1], [BR, 1, K]; ``r_span``: their
    first and last positions, with HAS_WINDOW) against column blocks offs_c; live only when LIVE (full
    otherwise). The window's band cuts the tiles by position, as ``mmsparse.mask.blocks.band_classes``."""
    m_c = offs_c < n_c
    p_c = p_col + offs_c * W  # [CB]
    c_or = tl.load(p_c, mask=m_c, other=0)[None, :]  # [1, CB]
    c_x = tl.load(p_c + 1, mask=m_c, other=0)[None, :]
    if BY_KEY:
        q_or, q_and, k_or, k_dirty = c_or, c_x, r_or, r_x
    else:
        q_or, q_and, k_or, k_dirty = r_or, r_x, c_or, c_x
    m_rc = m_r[:, None] & m_c[None, :]  # [BR, CB]
    full = (((k_or & ~q_and) | k_dirty) == 0) & m_rc
    live = full
    if IS_CAUSAL:
        c_edge = tl.load(p_c + 2, mask=m_c, other=0)[None, :]
        if BY_KEY:
            full = full & (r_edge <= c_edge)
        else:
            full = full & (c_edge <= r_edge)
        if LIVE:
            offs_t = tl.arange(0, K)
            c_pos = tl.load(p_c[:, None] + 3 + offs_t[None, :], mask=m_c[:, None], other=0)[None, :, :]  # [1, CB, K]
            if BY_KEY:
                see = c_pos >= r_pos  # [BR, CB, K]
            else:
                see = r_pos >= c_pos
            live = (tl.max(see.to(tl.int32), 2) != 0) & m_rc
    elif LIVE:
        live = ((q_or & k_or) != 0) & m_rc
    if HAS_WINDOW:
        r_first, r_last = r_span
        c_first = tl.load(p_c + W - 2, mask=m_c, other=0)[None, :]
        c_last = tl.load(p_c + W - 1, mask=m_c, other=0)[None, :]
        if BY_KEY:
            q_first, q_last, k_first, k_last = c_first, c_last, r_first, r_last
        else:
            q_first, q_last, k_first, k_last = r_first, r_last, c_first, c_last
        full = full & (k_first > q_last - window)
        live = live & (k_last > q_first - window)
    return full, live


PHASE_DENSE = tl.constexpr(LISTS_DENSE)
PHASE_COUNT = tl.constexpr(LISTS_COUNT)
PHASE_WRITE = tl.constexpr(LISTS_WRITE)


@triton.jit
def store_chunk(p_idx, offs_c, full, live, i_full, i_part):
    """Write one chunk of column blocks (offs_c, classes [BR, CB]) into each row's list: full ones at i_full on,
    partial ones at i_part on (the row's full count past its start); returns the advanced positions."""
    part = live & ~full
    b_f, b_p = full.to(tl.int32), part.to(tl.int32)  # [BR, CB]
    pos = tl.where(full, i_full[:, None] + tl.cumsum(b_f, 1), i_part[:, None] + tl.cumsum(b_p, 1)) - 1
    tl.store(p_idx + pos, offs_c[None, :], mask=full | part)
    return i_full + tl.sum(b_f, 1), i_part + tl.sum(b_p, 1)


@triton.jit
def count_chunk(full, live, n_full, n_part):
    """Add one chunk's full and partial tiles ([BR, CB] classes) to each row's counts."""
    return n_full + tl.sum(full.to(tl.int32), 1), n_part + tl.sum((live & ~full).to(tl.int32), 1)


@triton.jit
def list_rows(p_cnt, INDICES, b64, offs_r, m_r, n_c, stride_ib, PHASE: tl.constexpr):
    """(pointers [BR, 1] to each row's list, each row's full count) where the writing pass starts: the counts
    the host left (WRITE), or r * n_c slots in (DENSE, whose full count comes from the caller's first pass)."""
    if PHASE == PHASE_WRITE:
        start = tl.load(p_cnt + 2, mask=m_r, other=0)
        n_full = tl.load(p_cnt, mask=m_r, other=0)
    else:
        start = offs_r * n_c
        n_full = tl.zeros_like(offs_r)
    return INDICES + b64 * stride_ib + start.to(tl.int64)[:, None], n_full


@triton.jit
def store_counts(p_cnt, m_r, n_full, n_part, offs_r, n_c, PHASE: tl.constexpr):
    """Write each row's (full, partial) counts, and its start r * n_c when its slots are fixed (DENSE)."""
    if PHASE != PHASE_WRITE:
        tl.store(p_cnt, n_full, mask=m_r)
        tl.store(p_cnt + 1, n_part, mask=m_r)
    if PHASE == PHASE_DENSE:
        tl.store(p_cnt + 2, offs_r * n_c, mask=m_r)


@triton.jit(do_not_specialize=["stride_sb", "stride_cb", "stride_ib", "n_q", "n_k", "window"])
def block_lists_kernel(
    SUM, COUNTS, INDICES,
    stride_sb, stride_cb, stride_ib,
    n_q, n_k, window,
    BR: tl.constexpr, CB: tl.constexpr, K: tl.constexpr, W: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, BY_KEY: tl.constexpr, PHASE: tl.constexpr,
):
    """Program (g, b) handles the row blocks r = g*BR .. g*BR+BR-1 (key blocks when BY_KEY) of sample b, walking
    the column blocks CB at a time: ``COUNTS[b, r]`` and/or the lists, as PHASE says."""
    i_g, i_b = tl.program_id(0), tl.program_id(1)
    p_sum = SUM + i_b * stride_sb
    if BY_KEY:
        n_r, n_c, p_row, p_col = n_k, n_q, p_sum + n_q * W, p_sum
    else:
        n_r, n_c, p_row, p_col = n_q, n_k, p_sum, p_sum + n_q * W
    offs_r = i_g * BR + tl.arange(0, BR)  # [BR]
    m_r = offs_r < n_r
    p_r = p_row + offs_r * W
    r_or = tl.load(p_r, mask=m_r, other=0)[:, None]  # [BR, 1]
    r_x = tl.load(p_r + 1, mask=m_r, other=0)[:, None]
    r_edge, r_pos = r_or, r_or
    if IS_CAUSAL:
        offs_t = tl.arange(0, K)
        r_edge = tl.load(p_r + 2, mask=m_r, other=0)[:, None]
        r_pos = tl.load(p_r[:, None] + 3 + offs_t[None, :], mask=m_r[:, None], other=0)[:, None, :]  # [BR, 1, K]
    r_span = (r_or, r_or)
    if HAS_WINDOW:
        r_span = (tl.load(p_r + W - 2, mask=m_r, other=0)[:, None], tl.load(p_r + W - 1, mask=m_r, other=0)[:, None])
    offs_cb = tl.arange(0, CB)
    p_cnt = COUNTS + i_b * stride_cb + offs_r * WORDS_PER_ROW
    p_idx, n_full = list_rows(p_cnt, INDICES, i_b.to(tl.int64), offs_r, m_r, n_c, stride_ib, PHASE)

    n_part = tl.zeros([BR], dtype=tl.int32)
    if PHASE != PHASE_WRITE:
        for c0 in range(0, n_c, CB):
            full, live = _classify(r_or, r_x, r_edge, r_pos, r_span, p_col, c0 + offs_cb, m_r, n_c, window, K, W,
                                   IS_CAUSAL, HAS_WINDOW, BY_KEY, PHASE == PHASE_COUNT)
            n_full, n_part = count_chunk(full, live, n_full, n_part)
    if PHASE != PHASE_COUNT:
        i_full, i_part = tl.zeros([BR], dtype=tl.int32), n_full
        for c0 in range(0, n_c, CB):
            offs_c = c0 + offs_cb
            full, live = _classify(r_or, r_x, r_edge, r_pos, r_span, p_col, offs_c, m_r, n_c, window, K, W, IS_CAUSAL,
                                   HAS_WINDOW, BY_KEY, True)
            i_full, i_part = store_chunk(p_idx, offs_c, full, live, i_full, i_part)
        n_part = i_part - n_full
    store_counts(p_cnt, m_r, n_full, n_part, offs_r, n_c, PHASE)
