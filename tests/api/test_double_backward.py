"""A double backward through the attention (``create_graph=True``, as a gradient penalty takes) raises: the kernels'
gradients are not differentiable, and handed out as constants they made a penalty's terms through them vanish, so
that a loss's gradient came out wrong with no error (``mmsparse.attention.first_order``). A backward with
``create_graph=True`` whose gradients are only read gives the gradients of the plain backward."""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention
from tests.helpers import HUB

LENS = (5, 7, 4)
S = sum(LENS)


def _inputs(device):
    torch.manual_seed(0)
    w = torch.randn(16, 16, device=device, requires_grad=True)
    x = torch.randn(1, 2, S, 16, device=device)
    return w, x


def _penalised_loss(w, x):
    q = x @ w
    out = mbs_attention(q, x, x, HUB, LENS)
    grad_q, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return out.sum() + grad_q.square().sum()


def test_a_gradient_penalty_through_the_attention_raises(device):
    w, x = _inputs(device)
    with pytest.raises(RuntimeError, match="mbs_attention's gradients .* cannot be differentiated again"):
        torch.autograd.grad(_penalised_loss(w, x), w)  # with respect to some leaves only
    with pytest.raises(RuntimeError, match="double backward through it"):
        _penalised_loss(w, x).backward()


def test_gradients_that_depend_on_the_inputs_alone_raise_too(device):
    """With a constant incoming gradient dQ still depends on q, k and v (the attention's second derivative)."""
    _, x = _inputs(device)
    q = x.clone().requires_grad_()
    out = mbs_attention(q, x, x, HUB, LENS)
    grad_q, = torch.autograd.grad(out, q, grad_outputs=torch.ones_like(out), create_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        torch.autograd.grad(grad_q.sum(), q)


def test_create_graph_gradients_that_are_only_read_match_the_plain_backward(device):
    _, x = _inputs(device)
    grad_out = torch.randn(1, 2, S, 16, device=device)
    leaves = [t.clone().requires_grad_() for t in (x, x, x)]
    plain = torch.autograd.grad(mbs_attention(*leaves, HUB, LENS), leaves, grad_out)
    leaves = [t.clone().requires_grad_() for t in (x, x, x)]
    graphed = torch.autograd.grad(mbs_attention(*leaves, HUB, LENS), leaves, grad_out, create_graph=True)
    for a, b in zip(plain, graphed):
        assert torch.equal(a, b.detach()) and b.requires_grad
