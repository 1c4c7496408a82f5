"""The autograd.Function: saves what the backward needs and calls the launchers; no launch logic here."""

from __future__ import annotations

import torch

from .mask_info import MaskInfo
from .ops.backward import mbs_attn_bwd
from .ops.forward import kernel_layout, mbs_attn_fwd


class MBSAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, info: MaskInfo, softmax_scale: float, dropout_p: float, seed):  # type: ignore[override]
        out, lse = mbs_attn_fwd(q, k, v, info, softmax_scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, seed)
        ctx.info, ctx.softmax_scale, ctx.dropout_p = info, softmax_scale, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, seed = ctx.saved_tensors
        grad_out = kernel_layout(grad_out.contiguous())
        dq, dk, dv = mbs_attn_bwd(grad_out, q, k, v, out, lse, ctx.info, ctx.softmax_scale,
                                  ctx.dropout_p, seed)
        return dq, dk, dv, None, None, None, None
