"""tl forward: FlashAttention-2 online softmax over the listed key blocks of each query block, and the
deterministic combine of split key lists (flash-decoding)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import DYNAMIC_ARGS, IO_STRIDE_ARGS
from ..lists import block_id, ordered_row
from .common import (
    dot,
    dropout_keep,
    element_strides,
    load_block,
    load_rows,
    make_source,
    pair_mask,
    program_setup,
    store_block,
)

# (an int arg equal to 1 would otherwise be a constant)
_FWD_DYNAMIC = [*DYNAMIC_ARGS, *IO_STRIDE_ARGS, "n_splits", "split_len"]


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, b_q, offs_m, offs_n, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, start, stop,
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window, qk_scale, seed, bh, dropout_p,
    BN: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, MASK_MODE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Fold key blocks idx[start:stop] into the running (acc, l, m). MASKED applies the exact token mask."""
    for it in range(start, stop):
        n_blk = block_id(idx_ptr, it)
        offs_kv = n_blk * BN + offs_n
        b_k = load_block(k_src, n_blk * BN, offs_kv, stride_kn, offs_d, seq_k, HEAD_DIM, MASKED, USE_TMA)  # [BN, D]
        b_v = load_block(v_src, n_blk * BN, offs_kv, stride_vn, offs_d, seq_k, HEAD_DIM, MASKED, USE_TMA)  # [BN, D]
        b_s = dot(b_q, tl.trans(b_k), DOT_MODE)  # [BM, BN] raw scores; m_i is kept in raw units too
        if MASKED:
            allowed = pair_mask(offs_m[:, None], offs_kv[None, :], q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q,
                                seq_q, seq_k, q_start, window, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
            b_s = tl.where(allowed, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        # A row that has seen nothing yet keeps m = -inf: use 0 as the exponent base so exp2 gives 0, not NaN.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        # Subtract before scaling: a row's largest score gives exactly p = 1 (a fused multiply-add of the scaled
        # score and a rounded scaled max would not), and no contraction can differ between kernel variants.
        b_p = tl.math.exp2((b_s - m_base[:, None]) * qk_scale)  # [BM, BN]
        alpha = tl.math.exp2((m_i - m_base) * qk_scale)
        l_i = tl.fma(l_i, alpha, tl.sum(b_p, 1))
        acc = acc * alpha[:, None]
        m_i = m_new
        if HAS_DROPOUT:
            keep = dropout_keep(seed, bh, q_start + offs_m[:, None], offs_kv[None, :], dropout_p)
            b_p = tl.where(keep, b_p, 0.0)
        acc += dot(b_p.to(b_v.dtype), b_v, DOT_MODE)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_FWD_DYNAMIC)
def attention_fwd_tl(
    Q, K, V, O, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES, SEED,
    stride_qb8, stride_qh8, stride_qm8, stride_kb8, stride_kh8, stride_kn8, stride_vb8, stride_vh8, stride_vn8,
    stride_ob8, stride_oh8, stride_om8, stride_os8,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, dropout_p, n_splits, split_len,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, MASK_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr, USE_TMA: tl.constexpr, PACK_GQA: tl.constexpr,
):
    """One program per (query block, split, batch*head). With n_splits > 1, split s takes list entries
    [s * split_len, (s + 1) * split_len) and writes an fp32 partial (out, lse) at row block s * B * H + batch*head
    of O/LSE for attention_combine_tl (flash-decoding: few queries, long lists). The split count is a runtime value,
    so splitting or not is one compiled kernel.

    PACK_GQA (decoding with GQA, GROUP * seq_q <= BM): one program per (split, batch * kv head) instead; row r of
    its tile is query r % seq_q of the group's query head r // seq_q, so each K/V tile is read once for the
    whole group rather than once per query head.

    O is written at its strides (``stride_os8`` between splits' partials), which need not be q's: an output follows
    its input's layout (``layouts.output_like``). Every stride comes in units of 8 elements (``element_strides``)."""
    stride_ob, stride_oh, stride_om = element_strides(stride_ob8, stride_oh8, stride_om8)
    stride_os = stride_os8.to(tl.int64) * 8
    stride_qb, stride_qh, stride_qm = element_strides(stride_qb8, stride_qh8, stride_qm8)
    stride_kb, stride_kh, stride_kn = element_strides(stride_kb8, stride_kh8, stride_kn8)
    stride_vb, stride_vh, stride_vn = element_strides(stride_vb8, stride_vh8, stride_vn8)
    split = tl.program_id(0) % n_splits
    pid_bh = tl.program_id(1)
    heads = NUM_HEADS // GROUP if PACK_GQA else NUM_HEADS  # per sample along the grid's second axis
    pid_m = ordered_row(COUNTS, tl.program_id(0) // n_splits, pid_bh // heads, stride_cnt_b)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    if PACK_GQA:
        b = pid_bh // (NUM_HEADS // GROUP)
        hk = pid_bh % (NUM_HEADS // GROUP)
        rows = tl.arange(0, BM)
        in_group = rows < GROUP * seq_q
        offs_m = tl.where(in_group, rows % seq_q, seq_q)  # padding rows sit past the end: fully masked
        h = hk * GROUP + rows // seq_q  # [BM]: each row's query head
        bh = b * NUM_HEADS + h
        # 64-bit: one sample's H * S * D, or a [B, S, H, D] view's S * H * D, passes 2^31 at sizes users run
        q_rows = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m.to(tl.int64) * stride_qm
        in_d = offs_d < HEAD_DIM
        b_q = tl.load(q_rows[:, None] + offs_d[None, :], mask=in_group[:, None] & in_d[None, :], other=0.0)
        # lse rows: split s of row (batch*head, query) at (s * B * H + batch*head) * seq_q + query.
        out_rows = (split * tl.num_programs(1) * GROUP + bh).to(tl.int64) * seq_q + offs_m
        o_rows = (O + split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + offs_m.to(tl.int64) * stride_om)
        bh_rows = bh[:, None]
    else:
        b = pid_bh // NUM_HEADS
        h = pid_bh % NUM_HEADS
        hk = h // GROUP
        offs_m = pid_m * BM + tl.arange(0, BM)
        q_ptr = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh  # 64-bit: as above
        q_src = make_source(q_ptr, seq_q, stride_qm, BM, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
        b_q = load_block(q_src, pid_m * BM, offs_m, stride_qm, offs_d, seq_q, HEAD_DIM, True, USE_TMA)  # [BM, D]
        out_bh = split * tl.num_programs(1) + pid_bh
        bh_rows = pid_bh
    b64 = b.to(tl.int64)
    k_ptr = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_ptr = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    k_src = make_source(k_ptr, seq_k, stride_kn, BN, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
    v_src = make_source(v_ptr, seq_k, stride_vn, BN, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)

    n_full, n_part, idx_ptr, q_bits_ptr, k_bits_ptr, mask_ptr, seed, q_start = program_setup(
        b, pid_m, COUNTS, INDICES, Q_BITS, K_BITS, MASK, SEED, Q_START, stride_cnt_b, stride_idx_b,
        stride_qbits_b, stride_kbits_b, stride_mask_b, stride_qstart_b, HAS_DROPOUT)

    n_total = n_full + n_part
    lo = tl.minimum(split * split_len, n_total)
    hi = tl.minimum(lo + split_len, n_total)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_DIM_PAD], tl.float32)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, b_q, offs_m, offs_n, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, lo,
        tl.minimum(hi, n_full), q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window,
        qk_scale, seed, bh_rows, dropout_p, BN, HEAD_DIM, False, MASK_MODE, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT,
        DOT_MODE, USE_TMA,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, b_q, offs_m, offs_n, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr,
        tl.maximum(lo, n_full), hi, q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start,
        window, qk_scale, seed, bh_rows, dropout_p, BN, HEAD_DIM, True, MASK_MODE, IS_CAUSAL, HAS_WINDOW,
        HAS_DROPOUT, DOT_MODE, USE_TMA,
    )

    # Rows that attend nothing: l = 0, output 0, and lse = +inf so that the backward's exp2(s - lse) is 0
    # (a split's partial says -inf instead: weight 0 in the combine).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty, tl.where(n_splits > 1, float("-inf"), float("inf")), m_i * qk_scale + tl.math.log2(l_safe))
    if PACK_GQA:
        tl.store(LSE + out_rows, lse, mask=in_group)
        tl.store(o_rows[:, None] + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=in_group[:, None] & in_d[None, :])
    else:
        tl.store(LSE + out_bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)
        o_ptr = O + split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        o_dst = make_source(o_ptr, seq_q, stride_om, BM, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
        store_block(o_dst, pid_m * BM, out.to(O.dtype.element_ty), offs_m, stride_om, offs_d, seq_q, HEAD_DIM,
                    USE_TMA)


@triton.jit(do_not_specialize=["n_rows", "n_splits", "heads", "seq", "stride_ob8", "stride_oh8", "stride_om8"])
def attention_combine_tl(
    O_PART, LSE_PART, O, LSE, n_rows, n_splits, heads, seq, stride_ob8, stride_oh8, stride_om8,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BR: tl.constexpr,
):
    """Merge the fp32 partials of n_splits forward splits, [n_splits, n_rows, D] and [n_splits, n_rows], in split
    order (deterministic): out = sum_s 2^(lse_s - lse) out_s, lse = log2(sum_s 2^lse_s). Row r of the partials is
    row r % seq of head (r // seq) % heads of sample r // (seq * heads) in O, at O's strides (in units of 8
    elements; an output follows its input's layout); LSE is contiguous."""
    stride_ob, stride_oh, stride_om = element_strides(stride_ob8, stride_oh8, stride_om8)
    offs_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # 64-bit: rows * HEAD_DIM may pass 2^31
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    in_r = offs_r < n_rows
    rows64 = n_rows.to(tl.int64)
    m = tl.full([BR], float("-inf"), tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(LSE_PART + s * rows64 + offs_r, mask=in_r, other=float("-inf")))
    m_base = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, HEAD_DIM_PAD], tl.float32)
    for s in range(n_splits):
        w = tl.math.exp2(tl.load(LSE_PART + s * rows64 + offs_r, mask=in_r, other=float("-inf")) - m_base)
        p_part = O_PART + s * rows64 * HEAD_DIM
        part = load_rows(p_part, offs_r, HEAD_DIM, offs_d, n_rows, HEAD_DIM, True)  # [BR, D]
        w_sum += w
        acc += w[:, None] * part
    empty = w_sum == 0.0
    w_safe = tl.where(empty, 1.0, w_sum)
    tl.store(LSE + offs_r, tl.where(empty, float("inf"), m_base + tl.math.log2(w_safe)), mask=in_r)
    bh = offs_r // seq
    o_rows = (bh // heads) * stride_ob + (bh % heads) * stride_oh + (offs_r % seq) * stride_om  # 64-bit: offs_r's
    tl.store(O + o_rows[:, None] + offs_d[None, :], (acc / w_safe[:, None]).to(O.dtype.element_ty),
             mask=in_r[:, None] & (offs_d < HEAD_DIM)[None, :])
