"""The one autograd definition, for eager and compiled calls alike: saves what the backward needs and calls the op
boundary (:mod:`mmsparse.attention.custom_ops`); no launch logic here."""

from __future__ import annotations

import torch

from ..mask.info import MaskInfo
from .config import Settings
from .custom_ops import attention_backward, attention_forward
from .first_order import first_order_gradients


class MBSAttentionFunction(torch.autograd.Function):
    """Multimodal block-sparse (MBS) attention: ``apply(q, k, v, info, softmax_scale, dropout_p, seed,
    deterministic, settings)`` -> out; ``deterministic`` (a bool) picks the backward: two passes, or one with dQ
    by atomics; ``settings``: ``use_config``'s as the call read them (the backward runs with the same, on whichever
    thread and whenever it runs). The forward plans the call once (:mod:`mmsparse.attention.call`); the backward
    reads that plan."""

    @staticmethod
    def forward(ctx, q, k, v, info: MaskInfo, softmax_scale: float, dropout_p: float, seed,  # type: ignore[override]
                deterministic: bool, settings: Settings):
        out, lse, launch = attention_forward(q, k, v, info, softmax_scale, dropout_p, seed, settings, deterministic)
        ctx.save_for_backward(q, k, v, out, lse, seed)
        ctx.info, ctx.softmax_scale, ctx.dropout_p = info, softmax_scale, dropout_p
        ctx.deterministic, ctx.settings, ctx.launch = deterministic, settings, launch
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, seed = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, ctx.info, ctx.softmax_scale, ctx.dropout_p, seed,
                                        ctx.deterministic, ctx.settings, ctx.launch)
        dq, dk, dv = first_order_gradients("mbs_attention", (dq, dk, dv), grad_out, q, k, v)
        return dq, dk, dv, None, None, None, None, None, None
