"""The kernels as torch custom ops (``torch.ops.mmsparse.fwd`` / ``.bwd``) with fake implementations and
autograd, so that ``torch.compile(fullgraph=True)`` traces through mmsparse without graph breaks.

Eager calls use the lighter autograd.Function in :mod:`mmsparse.autograd`; both run the same launchers.
"""

from __future__ import annotations

import torch

from ..mask_info import MaskInfo
from .backward import mbs_attn_bwd
from .config import kernel_config
from .forward import kernel_layout, mbs_attn_fwd


def _info(q: torch.Tensor, k: torch.Tensor, meta: list[torch.Tensor], mode: int, causal: bool) -> MaskInfo:
    cfg = kernel_config(q.shape[-1], q.dtype, q.device)
    return MaskInfo.from_kernel_tensors(meta, cfg, mode, q.shape[2], k.shape[2], causal)


@torch.library.custom_op("mmsparse::fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: list[torch.Tensor], seed: torch.Tensor | None,
    mode: int, causal: bool, softmax_scale: float, dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (kernel_layout(t) for t in (q, k, v))
    return mbs_attn_fwd(q, k, v, _info(q, k, meta, mode, causal), softmax_scale, dropout_p, seed)


@attention_fwd_op.register_fake
def _(q, k, v, meta, seed, mode, causal, softmax_scale, dropout_p):
    batch, heads, seq_q, head_dim = q.shape
    return q.new_empty((batch, heads, seq_q, head_dim)), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


@torch.library.custom_op("mmsparse::bwd", mutates_args=())
def attention_bwd_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    meta: list[torch.Tensor], seed: torch.Tensor | None, mode: int, causal: bool, softmax_scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, q, k, v = (kernel_layout(t) for t in (grad_out.contiguous(), q, k, v))
    return mbs_attn_bwd(grad_out, q, k, v, out, lse, _info(q, k, meta, mode, causal), softmax_scale, dropout_p, seed)


@attention_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, meta, seed, mode, causal, softmax_scale, dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, meta, seed, mode, causal, softmax_scale, dropout_p = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, *meta)
    ctx.flags = (mode, causal, softmax_scale, dropout_p)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, seed, *meta = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(grad_out, q, k, v, out, lse, meta, seed, *ctx.flags)
    return dq, dk, dv, [None] * len(meta), None, None, None, None, None


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)
