"""The forward pass's launcher: the plan's kernel (the Gluon one on Hopper where it applies, else tl), with the
launch worked out once per call (:mod:`mmsparse.attention.call` keeps it)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..kernels.constants import DOT_NATIVE, DOT_TF32X3, DOT_UPCAST
from ..kernels.tl.forward import attention_combine_tl, attention_fwd_tl
from ..mask.blocks import cdiv
from ..runtime.launch import FastKernel
from ..runtime.scratch import ensure_tma_allocator
from .config import head_dim_pad
from .kernel_args import LaunchArgs
from .layouts import in_eights, output_strides
from .plan import CallPlan, ForwardPass

_FWD, _COMBINE = FastKernel(attention_fwd_tl), FastKernel(attention_combine_tl)


def dot_mode(q: torch.Tensor) -> int:
    """How the tl kernels multiply tiles for this input (``mmsparse.kernels.constants.DOT_*``)."""
    if q.device.type != "cuda":
        return DOT_UPCAST if q.dtype == torch.bfloat16 else DOT_NATIVE
    return DOT_TF32X3 if q.dtype == torch.float32 else DOT_NATIVE


class ForwardLaunch:
    """Everything about one planned forward launch except q, k, v, the outputs, the seed and the mask's tensors,
    worked out once per call kind (kept by plan, shapes, strides and the mask's integers,
    :func:`mmsparse.attention.call.forward_launch_of`, for every mask alike, in eager and in the custom ops): a
    repeated small call, or one with new lengths, is bound by host work. After its first launch it
    calls the compiled kernel straight through its launcher (:meth:`FastKernel.bind`); the strides and every other
    integer argument come from its key (the mask's integers included), so each launch specialises alike."""

    def __init__(self, q, k, v, plan: CallPlan, forward: ForwardPass, softmax_scale: float,
                 dropout_p: float) -> None:
        batch, num_heads, seq_q, head_dim = q.shape
        tile = forward.tile
        self.tile, self.gluon, self.use_tma = tile, forward.gluon, plan.use_tma
        self.mode, self.causal, self.has_window = plan.mode, plan.causal, plan.window is not None
        self.device, self.dtype = q.device, q.dtype
        self.out_shape, self.lse_shape = (batch, num_heads, seq_q, head_dim), (batch, num_heads, seq_q)
        self.lse_strides = (num_heads * seq_q, seq_q, 1)  # contiguous (empty_strided costs less host than empty)
        # out follows q's layout: a function of q's strides, which key this launch
        self.out_strides = output_strides(q)
        n_splits = self.n_splits = forward.n_splits
        self.qk_scale_log2 = softmax_scale * _LOG2E
        d_pad = head_dim_pad(head_dim)
        self.bound: dict[str, Any] = {}  # the Gluon forward's relaunch and setup (gluon_launch.run_forward)
        if self.gluon:  # the Gluon launcher works out its own grid and constexprs
            return
        key_blocks = cdiv(k.shape[2], tile.block_n)
        # The kernel writes out (split partials: float32 [n_splits, B, H, S, D], contiguous) at these strides
        if n_splits == 1:
            o_strides = (*self.out_strides[:3], 0)
        else:
            per_head = seq_q * head_dim
            o_strides = (num_heads * per_head, per_head, head_dim, batch * num_heads * per_head)
        self.strides = in_eights((*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_strides))
        self.tail = (self.qk_scale_log2, dropout_p, n_splits, cdiv(key_blocks, n_splits))
        self.grid = (forward.row_blocks * n_splits, forward.bh_programs)
        self.constexprs = dict(
            NUM_HEADS=num_heads, GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
            BM=forward.block_m, BN=tile.block_n, MASK_MODE=plan.mode, IS_CAUSAL=plan.causal,
            HAS_WINDOW=self.has_window, HAS_DROPOUT=dropout_p > 0.0, DOT_MODE=dot_mode(q), USE_TMA=plan.use_tma,
            PACK_GQA=forward.pack_rows > 0, num_warps=forward.num_warps, num_stages=tile.num_stages,
        )
        n_rows = batch * num_heads * seq_q
        self.combine_grid = (cdiv(n_rows, _COMBINE_ROWS),)
        self.combine_args = (n_rows, n_splits, num_heads, seq_q, *in_eights(self.out_strides[:3]))
        self.combine_constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BR=_COMBINE_ROWS)
        self._fwd: Callable[..., None] | None = None  # the bound launches, after the first call
        self._combine: Callable[..., None] | None = None

    def __call__(self, q, k, v, seed: torch.Tensor | None, mask: LaunchArgs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of the call's q, k, v (laid out by ``layouts.kernel_layout``), dropout seed and the mask
        arguments of the forward's tile (:func:`mmsparse.attention.kernel_args.mask_launch_args`), whose integers
        the caller keys this launch on."""
        if self.use_tma:  # every call: Triton's allocator is per thread (autograd's, a recompute's), not per launch
            ensure_tma_allocator(self.device)
        if self.gluon:
            return _hopper_forward(q, k, v, self, mask)
        out = torch.empty_strided(self.out_shape, self.out_strides, dtype=self.dtype, device=self.device)
        lse = torch.empty_strided(self.lse_shape, self.lse_strides, dtype=torch.float32, device=self.device)
        o_dst, lse_dst = out, lse
        if self.n_splits > 1:
            o_dst = torch.empty((self.n_splits, *self.out_shape), dtype=torch.float32, device=self.device)
            lse_dst = torch.empty((self.n_splits, *self.lse_shape), dtype=torch.float32, device=self.device)
        seed = seed if seed is not None else lse  # never read without dropout
        args = (q, k, v, o_dst, lse_dst, *mask[0], seed, *self.strides, *mask[1], *self.tail)
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


def _hopper_forward(q, k, v, launch: ForwardLaunch, mask: LaunchArgs):
    """The Gluon Hopper forward (the plan chose it: the tile has one, no dropout, no split key lists)."""
    from . import gluon_launch  # imports Gluon: reached only where dispatch.hopper_gluon_available said yes

    return gluon_launch.run_forward(q, k, v, mask, launch.mode, launch.causal, launch.qk_scale_log2, launch.tile,
                                    launch.has_window, bound=launch.bound, out_strides=launch.out_strides)


_COMBINE_ROWS = 16


def combine_partials(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results over disjoint key sets with the split-KV combine kernel, in part order
    (deterministic): ``outs`` float32 ``[P, *rows, D]``, ``lses`` float32 ``[P, *rows]`` in log2 units, -inf
    where a part saw no key. Returns ``(out [*rows, D] in dtype, lse [*rows])``, lse +inf where no part saw any."""
    rows, head_dim = outs.shape[1:-1], outs.shape[-1]
    n_rows = math.prod(rows)
    out = torch.empty((*rows, head_dim), dtype=dtype, device=outs.device)
    lse = torch.empty(rows, dtype=torch.float32, device=outs.device)
    # out is contiguous: its rows as one head of one sample
    _COMBINE[(cdiv(n_rows, _COMBINE_ROWS),)](outs.contiguous(), lses.contiguous(), out, lse, n_rows, outs.shape[0],
                                             1, n_rows, 0, 0, head_dim // 8, HEAD_DIM=head_dim,
                                             HEAD_DIM_PAD=head_dim_pad(head_dim), BR=_COMBINE_ROWS)
    return out, lse
_LOG2E = math.log2(math.e)
