"""Forward kernel: FlashAttention-2 online softmax over the listed key blocks of each query block."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import triton
import triton.language as tl

from ..blocks import cdiv
from ..mask_info import MaskInfo
from .common import (
    DOT_NATIVE,
    DOT_TF32X3,
    DOT_UPCAST,
    dot,
    dropout_keep,
    hint_strides,
    load_block,
    load_rows,
    make_source,
    pair_mask,
    program_setup,
    store_block,
    store_rows,
)
from .config import DECODE_MAX_Q, cuda_index, ensure_tma_allocator, head_dim_pad, kernel_config, run_gluon
from .kernel_args import kernel_args
from .launch import FastKernel

# Sequence lengths, offsets and batch/head strides change with every new length: never specialise on them,
# so a new length reuses the compiled kernel.
_DYNAMIC = ["stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
            "stride_vn", "stride_qbits_b", "stride_kbits_b", "stride_mask_b", "stride_mask_q", "stride_cnt_b",
            "stride_idx_b", "stride_idx_r", "seq_q", "seq_k", "stride_past_b"]
_FWD_DYNAMIC = [*_DYNAMIC, "n_splits", "split_len"]  # (an int arg equal to 1 would otherwise be a constant)


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, b_q, offs_m, offs_n, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, start, stop,
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, past_len, qk_scale, seed, bh, dropout_p,
    BN: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, MASK_MODE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """Fold key blocks idx[start:stop] into the running (acc, l, m). MASKED applies the exact token mask."""
    for it in tl.range(start, stop, warp_specialize=WARP_SPEC):
        n_blk = tl.load(idx_ptr + it)
        offs_kv = n_blk * BN + offs_n
        b_k = load_block(k_src, n_blk * BN, offs_kv, stride_kn, offs_d, seq_k, HEAD_DIM, MASKED, USE_TMA)  # [BN, D]
        b_v = load_block(v_src, n_blk * BN, offs_kv, stride_vn, offs_d, seq_k, HEAD_DIM, MASKED, USE_TMA)  # [BN, D]
        b_s = dot(b_q, tl.trans(b_k), DOT_MODE)  # [BM, BN] raw scores; m_i is kept in raw units too
        if MASKED:
            allowed = pair_mask(offs_m[:, None], offs_kv[None, :], q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q,
                                seq_q, seq_k, past_len, MASK_MODE, IS_CAUSAL)
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
            keep = dropout_keep(seed, bh, past_len + offs_m[:, None], offs_kv[None, :], dropout_p)
            b_p = tl.where(keep, b_p, 0.0)
        acc += dot(b_p.to(b_v.dtype), b_v, DOT_MODE)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_FWD_DYNAMIC)
def _fwd_kernel(
    Q, K, V, O, LSE, Q_BITS, K_BITS, MASK, COUNTS, INDICES, SEED,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b, stride_idx_r,
    seq_q, seq_k, PAST, stride_past_b, qk_scale, dropout_p, n_splits, split_len,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, MASK_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_MODE: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
    PACK_GQA: tl.constexpr,
):
    """One program per (query block, split, batch*head). With n_splits > 1, split s takes list entries
    [s * split_len, (s + 1) * split_len) and writes an fp32 partial (out, lse) at row block s * B * H + batch*head
    of O/LSE for _combine_kernel (flash-decoding: few queries, long lists). The split count is a runtime value,
    so splitting or not is one compiled kernel.

    PACK_GQA (decoding with GQA, GROUP * seq_q <= BM): one program per (split, batch * kv head) instead; row r of
    its tile is query r % seq_q of the group's query head r // seq_q, so each K/V tile is read once for the
    whole group rather than once per query head."""
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn = hint_strides(
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn)
    split = tl.program_id(0) % n_splits
    pid_m = tl.program_id(0) // n_splits
    pid_bh = tl.program_id(1)
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
        # Output rows: split s of row (batch*head, query) at (s * B * H + batch*head) * seq_q + query.
        out_rows = (split * tl.num_programs(1) * GROUP + bh).to(tl.int64) * seq_q + offs_m
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

    n_full, n_part, idx_ptr, q_bits_ptr, k_bits_ptr, mask_ptr, seed, past_len = program_setup(
        b, pid_m, COUNTS, INDICES, Q_BITS, K_BITS, MASK, SEED, PAST, stride_cnt_b, stride_idx_b, stride_idx_r,
        stride_qbits_b, stride_kbits_b, stride_mask_b, stride_past_b, HAS_DROPOUT)

    n_total = n_full + n_part
    lo = tl.minimum(split * split_len, n_total)
    hi = tl.minimum(lo + split_len, n_total)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_DIM_PAD], tl.float32)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, b_q, offs_m, offs_n, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr, lo,
        tl.minimum(hi, n_full), q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, past_len, qk_scale,
        seed, bh_rows, dropout_p, BN, HEAD_DIM, False, MASK_MODE, IS_CAUSAL, HAS_DROPOUT, DOT_MODE, USE_TMA, WARP_SPEC,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, b_q, offs_m, offs_n, offs_d, k_src, v_src, stride_kn, stride_vn, idx_ptr,
        tl.maximum(lo, n_full), hi, q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, past_len,
        qk_scale, seed, bh_rows, dropout_p, BN, HEAD_DIM, True, MASK_MODE, IS_CAUSAL, HAS_DROPOUT, DOT_MODE, USE_TMA,
        False,
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
        tl.store(O + out_rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=in_group[:, None] & in_d[None, :])
    else:
        tl.store(LSE + out_bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)
        o_dst = make_source(O + out_bh.to(tl.int64) * seq_q * HEAD_DIM, seq_q, HEAD_DIM, BM, HEAD_DIM, HEAD_DIM_PAD,
                            USE_TMA)
        store_block(o_dst, pid_m * BM, out.to(O.dtype.element_ty), offs_m, HEAD_DIM, offs_d, seq_q, HEAD_DIM,
                    USE_TMA)


@triton.jit(do_not_specialize=["n_rows", "n_splits"])
def _combine_kernel(
    O_PART, LSE_PART, O, LSE, n_rows, n_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BR: tl.constexpr,
):
    """Merge the fp32 partials of n_splits forward splits, [n_splits, n_rows, D] and [n_splits, n_rows], in split
    order (deterministic): out = sum_s 2^(lse_s - lse) out_s, lse = log2(sum_s 2^lse_s)."""
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
    store_rows(O, (acc / w_safe[:, None]).to(O.dtype.element_ty), offs_r, HEAD_DIM, offs_d, n_rows, HEAD_DIM)


_FWD, _COMBINE = FastKernel(_fwd_kernel), FastKernel(_combine_kernel)


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``: 4-D. The kernels take any strides whose head dim is unit-stride and whose other strides are multiples of 8
    elements on a 16-byte aligned base (every ordinary layout of a tensor with such a head dim); else one copy."""
    s = t.stride()
    if s[3] == 1 and not (s[0] | s[1] | s[2]) & 7 and not t.data_ptr() & 15:
        return t
    return t.contiguous().clone() if t.is_contiguous() else t.contiguous()


def dot_mode(q: torch.Tensor) -> int:
    """How the kernels multiply tiles for this input (see mmsparse.ops.common.DOT_*)."""
    if q.device.type != "cuda":
        return DOT_UPCAST if q.dtype == torch.bfloat16 else DOT_NATIVE
    return DOT_TF32X3 if q.dtype == torch.float32 else DOT_NATIVE


def mbs_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    info: MaskInfo,
    softmax_scale: float,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]``; last dim contiguous.
        info: the mask (bits or dense) and its block lists.
        softmax_scale: multiplies q.k.
        dropout_p, seed: dropout probability and an int64 ``[1]`` seed tensor on q's device.

    Returns:
        ``(out [B, Hq, Sq, D] contiguous in q's dtype, lse [B, Hq, Sq] float32 in log2 units)``.
    """
    cfg = kernel_config(q.shape[-1], q.dtype, q.device)
    # id(cfg): the plan holds cfg, so the id stays its own while the plan is kept
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, softmax_scale, dropout_p, seed is None,
           id(cfg))
    plans = kernel_args(info).forward_plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[key] = _ForwardPlan(q, k, v, info, cfg, softmax_scale, dropout_p)
    if plan.gluon:
        return _hopper_forward(q, k, v, info, softmax_scale * _LOG2E, plan.tile)
    return plan(q, k, v, seed)


class _ForwardPlan:
    """Everything about one forward launch except q, k, v, the outputs and the seed, worked out once per (mask,
    shapes, strides, dtype, scale, dropout, tiles): a repeated small call is bound by host work. After its first
    launch the plan calls the compiled kernel straight through its launcher (:meth:`FastKernel.bind`); the
    strides and every other integer argument come from the plan's key, so each launch specialises alike."""

    def __init__(self, q, k, v, info: MaskInfo, cfg, softmax_scale: float, dropout_p: float) -> None:
        batch, num_heads, seq_q, head_dim = q.shape
        group = num_heads // k.shape[1]
        tile = cfg.forward_tile(seq_q, info.seq_k)
        pack_rows = gqa_pack_rows(group, seq_q, tile.block_m)
        if pack_rows:  # one program per (batch, kv head), all of the group's queries in one tile; list row block 0
            block_m, num_warps = pack_rows, max(tile.num_warps, pack_rows // 16)
            row_blocks, bh_programs = 1, batch * (num_heads // group)
        else:
            block_m, num_warps = tile.block_m, tile.num_warps
            row_blocks, bh_programs = cdiv(seq_q, tile.block_m), batch * num_heads
        key_blocks = cdiv(info.seq_k, tile.block_n)
        n_splits = num_splits(row_blocks * bh_programs, key_blocks, q.device)
        self.cfg, self.tile, self.gluon = cfg, tile, tile.gluon and dropout_p == 0.0 and n_splits == 1
        if cfg.use_tma:
            ensure_tma_allocator(q.device)
        self.mask_tensors, mask_scalars = kernel_args(info).tile(tile.block_m, tile.block_n)
        self.device, self.dtype = q.device, q.dtype
        self.out_shape, self.lse_shape = (batch, num_heads, seq_q, head_dim), (batch, num_heads, seq_q)
        self.n_splits = n_splits
        self.scalars = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mask_scalars, softmax_scale * _LOG2E,
                        dropout_p, n_splits, cdiv(key_blocks, n_splits))
        d_pad = head_dim_pad(head_dim)
        self.grid = (row_blocks * n_splits, bh_programs)
        self.constexprs = dict(
            NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
            BM=block_m, BN=tile.block_n, MASK_MODE=info.mode, IS_CAUSAL=info.causal,
            HAS_DROPOUT=dropout_p > 0.0, DOT_MODE=dot_mode(q), USE_TMA=cfg.use_tma, WARP_SPEC=tile.warp_specialize,
            PACK_GQA=pack_rows > 0, num_warps=num_warps, num_stages=tile.num_stages,
        )
        n_rows = batch * num_heads * seq_q
        self.combine_grid = (cdiv(n_rows, _COMBINE_ROWS),)
        self.combine_args = (n_rows, n_splits)
        self.combine_constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BR=_COMBINE_ROWS)
        self._fwd: Callable[..., None] | None = None  # the bound launches, after the first call
        self._combine: Callable[..., None] | None = None

    def __call__(self, q, k, v, seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        o_dst, lse_dst = out, lse
        if self.n_splits > 1:
            o_dst = torch.empty((self.n_splits, *self.out_shape), dtype=torch.float32, device=self.device)
            lse_dst = torch.empty((self.n_splits, *self.lse_shape), dtype=torch.float32, device=self.device)
        seed = seed if seed is not None else lse  # never read without dropout
        args = (q, k, v, o_dst, lse_dst, *self.mask_tensors, seed, *self.scalars)
        if self._fwd is not None:
            self._fwd(*args)
        else:
            self._fwd = _FWD.bind(self.grid, args, self.constexprs)
        if self.n_splits > 1:
            args = (o_dst, lse_dst, out, lse, *self.combine_args)
            if self._combine is not None:
                self._combine(*args)
            else:
                self._combine = _COMBINE.bind(self.combine_grid, args, self.combine_constexprs)
        return out, lse


def _hopper_forward(q, k, v, info, qk_scale_log2, tile):
    """The Gluon Hopper forward (``plan.gluon``: the tile has one, no dropout, no split key lists)."""
    return run_gluon("hopper_forward", "mbs_attn_fwd_hopper", q, k, v, info, qk_scale_log2, tile)


_COMBINE_ROWS = 16
_MAX_PLANS = 16  # per mask: distinct (shape, stride, dtype, scale) combinations kept
_LOG2E = math.log2(math.e)
_PACK_MAX_ROWS = 64


def gqa_pack_rows(group: int, seq_q: int, block_m: int) -> int:
    """Rows of the packed GQA tile for a short query block (decoding), 0 for no packing: the group's
    ``group * seq_q`` query rows rounded up to a power of two, at least the decode tile's rows, at most 64
    (more rows would cost registers that a separate program per head does not need)."""
    rows = group * seq_q
    if group == 1 or seq_q > min(block_m, DECODE_MAX_Q) or rows > _PACK_MAX_ROWS:
        return 0
    return max(block_m, 1 << (rows - 1).bit_length())


def num_splits(programs: int, key_blocks: int, device: torch.device) -> int:
    """How many programs share one row block's key list (flash-decoding): only when the grid is too small to
    fill the GPU (a few queries over a long cache), each split keeping at least 4 key blocks. Through the
    interpreter the bar is 8 programs and 1 block, so that the CPU tests exercise splits and the combine."""
    target, min_blocks = (2 * _sm_count(device), 4) if device.type == "cuda" else (8, 1)
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), key_blocks // min_blocks))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(cuda_index(device)).multi_processor_count
