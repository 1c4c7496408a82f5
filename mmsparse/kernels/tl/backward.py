"""tl backward: delta = rowsum(dO * O); dK/dV per key block; dQ per query block.

Each pass recomputes P from the saved log-sum-exp and owns its output tile, so there are no atomics and the
result is bitwise reproducible. For GQA a dK/dV program walks all query heads of its group.

The one-pass variant (``ONE_PASS``, ``deterministic=False``) has the dK/dV kernel also add each tile pair's
dQ contribution dS K into a float32 ``[B, Hq, Sq, D]`` accumulator with atomic adds: 5 matmuls per tile pair
instead of 7 and no dQ pass, but the order of the adds, hence dQ's last bits, changes from run to run."""

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


@triton.jit(do_not_specialize=["seq_q", *IO_STRIDE_ARGS])
def attention_delta_tl(O, DO, DELTA, DQ_SUM, seq_q, stride_ob8, stride_oh8, stride_om8, stride_dob8, stride_doh8,
                       stride_dom8, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                       BR: tl.constexpr, ZERO_DQ: tl.constexpr = False):
    """delta = rowsum(dO * O) of BR query rows of one (batch, head) a program, O and dO at their strides (in units of 8
    elements: an output follows its input's layout; dO is read as autograd hands it over), delta ``[B, H, Sq]``
    contiguous. ``ZERO_DQ``: also zero the same rows of the one-pass backward's float32 dQ accumulator ``DQ_SUM`` (``[B,
    H, Sq, HEAD_DIM]``, contiguous), which a launch of its own would otherwise do: a small call is bound by host
    work."""
    stride_ob, stride_oh, stride_om = element_strides(stride_ob8, stride_oh8, stride_om8)
    stride_dob, stride_doh, stride_dom = element_strides(stride_dob8, stride_doh8, stride_dom8)
    pid_bh = tl.program_id(1)
    b64, h64 = (pid_bh // NUM_HEADS).to(tl.int64), (pid_bh % NUM_HEADS).to(tl.int64)
    # 64-bit offsets: B * H * S rows times HEAD_DIM passes 2^31 (B=4, H=32, S=144k, D=128), and a wrapped offset
    # gives a wrong delta, hence wrong dq and dk, with no error.
    row0 = tl.program_id(0) * BR
    offs_r = tl.arange(0, BR)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o_base = O + b64 * stride_ob + h64 * stride_oh + row0.to(tl.int64) * stride_om
    do_base = DO + b64 * stride_dob + h64 * stride_doh + row0.to(tl.int64) * stride_dom
    o = load_rows(o_base, offs_r, stride_om, offs_d, seq_q - row0, HEAD_DIM, True).to(tl.float32)
    do = load_rows(do_base, offs_r, stride_dom, offs_d, seq_q - row0, HEAD_DIM, True).to(tl.float32)
    rows = pid_bh.to(tl.int64) * seq_q + row0  # this tile's first row of delta (and of DQ_SUM)
    inside = offs_r < seq_q - row0
    tl.store(DELTA + rows + offs_r, tl.sum(o * do, 1), mask=inside)
    if ZERO_DQ:
        tl.store(DQ_SUM + rows * HEAD_DIM + offs_r[:, None] * HEAD_DIM + offs_d[None, :],
                 tl.zeros([BR, HEAD_DIM_PAD], tl.float32), mask=inside[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _dkdv_tiles(
    dk, dv, b_k, b_v, offs_n, offs_m0, offs_d, q_src, do_src, lse_ptr, delta_ptr, dq_ptr, stride_qm, stride_dom,
    idx_ptr, start, stop, q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window, qk_scale,
    sm_scale, seed, bh, dropout_p, BM: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    MASK_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_MODE: tl.constexpr, USE_TMA: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks idx[start:stop]. Tiles are transposed: [BN, BM].
    ``ONE_PASS``: also add each query block's dQ contribution into the float32 rows at ``dq_ptr`` (this head's
    ``[Sq, HEAD_DIM]``, from a 64-bit base)."""
    for it in range(start, stop):
        m_blk = block_id(idx_ptr, it)
        offs_m = m_blk * BM + offs_m0
        b_q = load_block(q_src, m_blk * BM, offs_m, stride_qm, offs_d, seq_q, HEAD_DIM, True, USE_TMA)  # [BM, D]
        b_do = load_block(do_src, m_blk * BM, offs_m, stride_dom, offs_d, seq_q, HEAD_DIM, True, USE_TMA)  # [BM, D]
        # Rows past the end get lse = +inf, hence p = 0.
        lse = tl.load(lse_ptr + offs_m, mask=offs_m < seq_q, other=float("inf"))
        delta = tl.load(delta_ptr + offs_m, mask=offs_m < seq_q, other=0.0)
        b_st = dot(b_k, tl.trans(b_q), DOT_MODE)  # [BN, BM] raw scores
        # Issued before the exponentials: the tensor cores work on dP while exp2 runs (4% on the H100 at D=128).
        b_dpt = dot(b_v, tl.trans(b_do), DOT_MODE)  # [BN, BM]
        b_pt = tl.math.exp2(tl.fma(b_st, qk_scale, -lse[None, :]))  # explicit FMA: see the forward
        if MASKED:
            allowed = pair_mask(offs_m[None, :], offs_n[:, None], q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q,
                                seq_q, seq_k, q_start, window, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
            b_pt = tl.where(allowed, b_pt, 0.0)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, bh, q_start + offs_m[None, :], offs_n[:, None], dropout_p)
            scale_keep = 1.0 / (1.0 - dropout_p)
            dv += dot(tl.where(keep, b_pt * scale_keep, 0.0).to(b_do.dtype), b_do, DOT_MODE)
            b_dpt = tl.where(keep, b_dpt * scale_keep, 0.0)
        else:
            dv += dot(b_pt.to(b_do.dtype), b_do, DOT_MODE)
        b_dst = (b_pt * (b_dpt - delta[None, :])).to(b_q.dtype)
        dk += dot(b_dst, b_q, DOT_MODE)
        if ONE_PASS:
            # dS in the input dtype, as the dQ pass multiplies it: the two paths differ only in the order of the adds
            b_dq = dot(tl.trans(b_dst), b_k, DOT_MODE)  # [BM, D]
            # 64-bit row base, 32-bit offsets in the tile (as load_block); relaxed: the adds need only be atomic,
            # the kernel's end orders them before the launcher reads the sum
            p_dq = dq_ptr + (m_blk * BM).to(tl.int64) * HEAD_DIM + offs_m0[:, None] * HEAD_DIM + offs_d[None, :]
            tl.atomic_add(p_dq, b_dq * sm_scale, mask=(offs_m < seq_q)[:, None] & (offs_d < HEAD_DIM)[None, :],
                          sem="relaxed")
    return dk, dv


@triton.jit
def _kv_sources(K, V, b64, hk64, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, seq_k,
                BN: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, USE_TMA: tl.constexpr):
    """The K and V sources of one (sample, KV head), both passes': 64-bit bases (one sample's H * S * D passes 2^31
    at sizes users run)."""
    k_src = make_source(K + b64 * stride_kb + hk64 * stride_kh, seq_k, stride_kn, BN, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
    v_src = make_source(V + b64 * stride_vb + hk64 * stride_vh, seq_k, stride_vn, BN, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
    return k_src, v_src


@triton.jit
def _q_do_sources(Q, DO, b64, h, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom, seq_q,
                  BM: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, USE_TMA: tl.constexpr):
    """The Q and dO sources of one (sample, query head), both passes': each at its strides from a 64-bit base."""
    h64 = h.to(tl.int64)
    q_src = make_source(Q + b64 * stride_qb + h64 * stride_qh, seq_q, stride_qm, BM, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
    do_src = make_source(DO + b64 * stride_dob + h64 * stride_doh, seq_q, stride_dom, BM, HEAD_DIM, HEAD_DIM_PAD,
                         USE_TMA)
    return q_src, do_src


@triton.jit(do_not_specialize=[*DYNAMIC_ARGS, *IO_STRIDE_ARGS])
def attention_dkdv_tl(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, Q_BITS, K_BITS, MASK, COUNTS, INDICES, SEED,
    stride_qb8, stride_qh8, stride_qm8, stride_kb8, stride_kh8, stride_kn8, stride_vb8, stride_vh8, stride_vn8,
    stride_dob8, stride_doh8, stride_dom8, stride_dkb8, stride_dkh8, stride_dkn8, stride_dvb8, stride_dvh8, stride_dvn8,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, sm_scale, dropout_p,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK_MODE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr,
    USE_TMA: tl.constexpr, ONE_PASS: tl.constexpr = False,
):
    """dK, dV of one key block (``[B, Hkv, Sk, D]``, summed over the GQA group, at their strides); with
    ``ONE_PASS`` also dQ's contributions, added into DQ: float32 ``[B, Hq, Sq, D]``, contiguous, zeroed by the
    launcher (unused otherwise). Every stride comes in units of 8 elements (:func:`element_strides`)."""
    stride_dob, stride_doh, stride_dom = element_strides(stride_dob8, stride_doh8, stride_dom8)
    stride_dkb, stride_dkh, stride_dkn = element_strides(stride_dkb8, stride_dkh8, stride_dkn8)
    stride_dvb, stride_dvh, stride_dvn = element_strides(stride_dvb8, stride_dvh8, stride_dvn8)
    stride_qb, stride_qh, stride_qm = element_strides(stride_qb8, stride_qh8, stride_qm8)
    stride_kb, stride_kh, stride_kn = element_strides(stride_kb8, stride_kh8, stride_kn8)
    stride_vb, stride_vh, stride_vn = element_strides(stride_vb8, stride_vh8, stride_vn8)
    pid_bh = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    pid_n = ordered_row(COUNTS, tl.program_id(0), b, stride_cnt_b)
    hk = pid_bh % NUM_KV_HEADS
    b64 = b.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m0 = tl.arange(0, BM)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_src, v_src = _kv_sources(K, V, b64, hk.to(tl.int64), stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                               stride_vn, seq_k, BN, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
    b_k = load_block(k_src, pid_n * BN, offs_n, stride_kn, offs_d, seq_k, HEAD_DIM, True, USE_TMA)
    b_v = load_block(v_src, pid_n * BN, offs_n, stride_vn, offs_d, seq_k, HEAD_DIM, True, USE_TMA)

    n_full, n_part, idx_ptr, q_bits_ptr, k_bits_ptr, mask_ptr, seed, q_start = program_setup(
        b, pid_n, COUNTS, INDICES, Q_BITS, K_BITS, MASK, SEED, Q_START, stride_cnt_b, stride_idx_b,
        stride_qbits_b, stride_kbits_b, stride_mask_b, stride_qstart_b, HAS_DROPOUT)

    dk = tl.zeros([BN, HEAD_DIM_PAD], tl.float32)
    dv = tl.zeros([BN, HEAD_DIM_PAD], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * NUM_HEADS + h
        row0 = bh.to(tl.int64) * seq_q
        q_src, do_src = _q_do_sources(Q, DO, b64, h, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh,
                                      stride_dom, seq_q, BM, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
        dq_ptr = DQ + row0 * HEAD_DIM  # 64-bit base: B * Hq * Sq * D passes 2^31
        dk, dv = _dkdv_tiles(
            dk, dv, b_k, b_v, offs_n, offs_m0, offs_d, q_src, do_src, LSE + row0, DELTA + row0, dq_ptr, stride_qm,
            stride_dom, idx_ptr, 0, n_full, q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start,
            window, qk_scale, sm_scale, seed, bh, dropout_p, BM, HEAD_DIM, False, MASK_MODE, IS_CAUSAL, HAS_WINDOW,
            HAS_DROPOUT, DOT_MODE, USE_TMA, ONE_PASS,
        )
        dk, dv = _dkdv_tiles(
            dk, dv, b_k, b_v, offs_n, offs_m0, offs_d, q_src, do_src, LSE + row0, DELTA + row0, dq_ptr, stride_qm,
            stride_dom, idx_ptr, n_full, n_full + n_part, q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q,
            seq_k, q_start, window, qk_scale, sm_scale, seed, bh, dropout_p, BM, HEAD_DIM, True, MASK_MODE,
            IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, DOT_MODE, USE_TMA, ONE_PASS,
        )
    hk64 = hk.to(tl.int64)
    dk_dst = make_source(DK + b64 * stride_dkb + hk64 * stride_dkh, seq_k, stride_dkn, BN, HEAD_DIM, HEAD_DIM_PAD,
                         USE_TMA)
    dv_dst = make_source(DV + b64 * stride_dvb + hk64 * stride_dvh, seq_k, stride_dvn, BN, HEAD_DIM, HEAD_DIM_PAD,
                         USE_TMA)
    store_block(dk_dst, pid_n * BN, (dk * sm_scale).to(DK.dtype.element_ty), offs_n, stride_dkn, offs_d, seq_k,
                HEAD_DIM, USE_TMA)
    store_block(dv_dst, pid_n * BN, dv.to(DV.dtype.element_ty), offs_n, stride_dvn, offs_d, seq_k, HEAD_DIM, USE_TMA)


@triton.jit
def _dq_tiles(
    dq, b_q, b_do, lse, delta, offs_m, offs_n0, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, start, stop,
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window, qk_scale, seed, bh, dropout_p,
    BN: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, MASK_MODE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr,
    USE_TMA: tl.constexpr, LSE_FIRST: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks idx[start:stop]. ``LSE_FIRST``: P as the Gluon passes
    compute it (``rules.lse_in_scores``), S onto -lse / scale, else exp2(S scale - lse)."""
    if LSE_FIRST:
        s_init = tl.zeros([lse.shape[0], BN], tl.float32) - (lse * (1.0 / qk_scale))[:, None]
    for it in range(start, stop):
        n_blk = block_id(idx_ptr, it)
        offs_n = n_blk * BN + offs_n0
        b_k = load_block(k_src, n_blk * BN, offs_n, stride_kn, offs_d, seq_k, HEAD_DIM, MASKED, USE_TMA)  # [BN, D]
        b_v = load_block(v_src, n_blk * BN, offs_n, stride_vn, offs_d, seq_k, HEAD_DIM, MASKED, USE_TMA)  # [BN, D]
        if LSE_FIRST:
            b_s = dot(b_q, tl.trans(b_k), DOT_MODE, s_init)  # [BM, BN] scores less lse / scale
        else:
            b_s = dot(b_q, tl.trans(b_k), DOT_MODE)  # [BM, BN] raw scores
        b_dp = dot(b_do, tl.trans(b_v), DOT_MODE)  # [BM, BN], before the exponentials as in the dK/dV pass
        if LSE_FIRST:
            b_p = tl.math.exp2(b_s * qk_scale)
        else:
            b_p = tl.math.exp2(tl.fma(b_s, qk_scale, -lse[:, None]))  # explicit FMA: see the forward
        if MASKED:
            allowed = pair_mask(offs_m[:, None], offs_n[None, :], q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q,
                                seq_q, seq_k, q_start, window, MASK_MODE, IS_CAUSAL, HAS_WINDOW)
            b_p = tl.where(allowed, b_p, 0.0)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, bh, q_start + offs_m[:, None], offs_n[None, :], dropout_p)
            b_dp = tl.where(keep, b_dp * (1.0 / (1.0 - dropout_p)), 0.0)
        b_ds = b_p * (b_dp - delta[:, None])
        dq += dot(b_ds.to(b_k.dtype), b_k, DOT_MODE)
    return dq


@triton.jit(do_not_specialize=[*DYNAMIC_ARGS, *IO_STRIDE_ARGS])
def attention_dq_tl(
    Q, K, V, DO, LSE, DELTA, DQ, Q_BITS, K_BITS, MASK, COUNTS, INDICES, SEED,
    stride_qb8, stride_qh8, stride_qm8, stride_kb8, stride_kh8, stride_kn8, stride_vb8, stride_vh8, stride_vn8,
    stride_dob8, stride_doh8, stride_dom8, stride_dqb8, stride_dqh8, stride_dqm8,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, sm_scale, dropout_p, O, stride_ob8, stride_oh8,
    stride_om8, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, MASK_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr, USE_TMA: tl.constexpr, LSE_FIRST: tl.constexpr = False,
    OWN_DELTA: tl.constexpr = False,
):
    """dQ of one query block, dO and dQ at their strides. Every stride comes in units of 8 elements
    (:func:`element_strides`). ``LSE_FIRST``: P computed as the Gluon dK/dV pass beside it does (:func:`_dq_tiles`).
    ``OWN_DELTA``: this block's delta = rowsum(dO * O) is computed here from O (at its strides) as
    :func:`attention_delta_tl` does, and written to DELTA for a dK/dV pass that runs after this one on the stream
    (a launch fewer: a small call is bound by host work); else DELTA is read and O unread."""
    stride_dob, stride_doh, stride_dom = element_strides(stride_dob8, stride_doh8, stride_dom8)
    stride_dqb, stride_dqh, stride_dqm = element_strides(stride_dqb8, stride_dqh8, stride_dqm8)
    stride_qb, stride_qh, stride_qm = element_strides(stride_qb8, stride_qh8, stride_qm8)
    stride_kb, stride_kh, stride_kn = element_strides(stride_kb8, stride_kh8, stride_kn8)
    stride_vb, stride_vh, stride_vn = element_strides(stride_vb8, stride_vh8, stride_vn8)
    pid_bh = tl.program_id(1)
    b = pid_bh // NUM_HEADS
    pid_m = ordered_row(COUNTS, tl.program_id(0), b, stride_cnt_b)
    h = pid_bh % NUM_HEADS
    b64 = b.to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n0 = tl.arange(0, BN)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row0 = pid_bh.to(tl.int64) * seq_q
    q_src, do_src = _q_do_sources(Q, DO, b64, h, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                                  seq_q, BM, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)
    b_q = load_block(q_src, pid_m * BM, offs_m, stride_qm, offs_d, seq_q, HEAD_DIM, True, USE_TMA)
    b_do = load_block(do_src, pid_m * BM, offs_m, stride_dom, offs_d, seq_q, HEAD_DIM, True, USE_TMA)
    lse = tl.load(LSE + row0 + offs_m, mask=offs_m < seq_q, other=float("inf"))
    if OWN_DELTA:
        stride_ob, stride_oh, stride_om = element_strides(stride_ob8, stride_oh8, stride_om8)
        o_base = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + (pid_m * BM).to(tl.int64) * stride_om
        b_o = load_rows(o_base, tl.arange(0, BM), stride_om, offs_d, seq_q - pid_m * BM, HEAD_DIM, True)
        delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # rows past seq_q: zeros of both
        tl.store(DELTA + row0 + offs_m, delta, mask=offs_m < seq_q)
    else:
        delta = tl.load(DELTA + row0 + offs_m, mask=offs_m < seq_q, other=0.0)

    n_full, n_part, idx_ptr, q_bits_ptr, k_bits_ptr, mask_ptr, seed, q_start = program_setup(
        b, pid_m, COUNTS, INDICES, Q_BITS, K_BITS, MASK, SEED, Q_START, stride_cnt_b, stride_idx_b,
        stride_qbits_b, stride_kbits_b, stride_mask_b, stride_qstart_b, HAS_DROPOUT)
    k_src, v_src = _kv_sources(K, V, b64, (h // GROUP).to(tl.int64), stride_kb, stride_kh, stride_kn, stride_vb,
                               stride_vh, stride_vn, seq_k, BN, HEAD_DIM, HEAD_DIM_PAD, USE_TMA)

    dq = tl.zeros([BM, HEAD_DIM_PAD], tl.float32)
    dq = _dq_tiles(
        dq, b_q, b_do, lse, delta, offs_m, offs_n0, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, 0, n_full,
        q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window, qk_scale, seed, pid_bh,
        dropout_p, BN, HEAD_DIM, False, MASK_MODE, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, DOT_MODE, USE_TMA, LSE_FIRST,
    )
    dq = _dq_tiles(
        dq, b_q, b_do, lse, delta, offs_m, offs_n0, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, n_full,
        n_full + n_part, q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window, qk_scale,
        seed, pid_bh, dropout_p, BN, HEAD_DIM, True, MASK_MODE, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, DOT_MODE, USE_TMA,
        LSE_FIRST,
    )
    dq_dst = make_source(DQ + b64 * stride_dqb + h.to(tl.int64) * stride_dqh, seq_q, stride_dqm, BM, HEAD_DIM,
                         HEAD_DIM_PAD, USE_TMA)
    store_block(dq_dst, pid_m * BM, (dq * sm_scale).to(DQ.dtype.element_ty), offs_m, stride_dqm, offs_d, seq_q,
                HEAD_DIM, USE_TMA)
