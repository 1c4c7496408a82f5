"""The forward pass's launcher: per-call plans for the tl kernel, the Gluon kernel on Hopper where it applies."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from ..blocks import cdiv
from ..kernels.constants import DOT_NATIVE, DOT_TF32X3, DOT_UPCAST
from ..kernels.tl.forward import attention_combine_tl, attention_fwd_tl
from ..mask_info import MaskInfo
from .config import DECODE_MAX_Q, cuda_index, head_dim_pad, kernel_config
from .kernel_args import kernel_args
from .launch import FastKernel
from .scratch import ensure_tma_allocator

_FWD, _COMBINE = FastKernel(attention_fwd_tl), FastKernel(attention_combine_tl)


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``: 4-D. The kernels take any strides whose head dim is unit-stride and whose other strides are multiples of 8
    elements on a 16-byte aligned base (every ordinary layout of a tensor with such a head dim); else one copy."""
    s = t.stride()
    if s[3] == 1 and not (s[0] | s[1] | s[2]) & 7 and not t.data_ptr() & 15:
        return t
    return t.contiguous().clone() if t.is_contiguous() else t.contiguous()


def dot_mode(q: torch.Tensor) -> int:
    """How the tl kernels multiply tiles for this input (``mmsparse.kernels.constants.DOT_*``)."""
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
        dropout_p, seed: dropout probability and the int64 ``[3]`` seed (key, query and key position offsets)
            on q's device.

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
        tile = cfg.forward_tile(seq_q, info.seq_k, info.sample_len)
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
    from . import gluon_launch  # imports Gluon: reached only where dispatch.hopper_gluon_available said yes

    return gluon_launch.run_forward(q, k, v, info, qk_scale_log2, tile)


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
