"""Gradients that may not be differentiated again: the kernels compute them outside autograd, so a double backward
(``create_graph=True`` through the attention, as a gradient penalty takes) would see them as constants and drop
every term that passes through them, silently. Under ``create_graph=True`` they are handed out tied to what they
depend on (the incoming gradient and the attention's inputs) through a node whose backward raises instead.

``torch.autograd.function.once_differentiable`` does not do: it ties the gradients to a fresh leaf rather than to
the graph, so ``torch.autograd.grad`` of a loss with respect to parameters prunes its node and drops the terms
without an error, and it looks only at the incoming gradient, not at the inputs the gradients also depend on.
"""

from __future__ import annotations

import torch

NOT_TWICE = ("{what}'s gradients are computed by its kernels outside autograd and cannot be differentiated again: a "
             "double backward through it (create_graph=True, as a gradient penalty takes) is not supported. Compute "
             "the term that needs second derivatives without it, or use mmsparse.reference_attention for it (dense, "
             "float64)")


def first_order_gradients(what: str, gradients: tuple[torch.Tensor, ...],
                          *depends_on: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``gradients`` as they are, unless grad mode is on (a backward with ``create_graph=True``) and one of
    ``depends_on`` (the incoming gradient, the inputs) requires grad: then copies whose backward raises, with a
    message that names ``what``."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in depends_on):
        return gradients
    return _RaiseIfDifferentiated.apply(what, len(gradients), *gradients, *depends_on)


class _RaiseIfDifferentiated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, what: str, count: int, *tensors: torch.Tensor | None):  # type: ignore[override]
        ctx.what = what
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError(NOT_TWICE.format(what=ctx.what))
