"""A call with no queries (or no keys, hence no queries either) returns an empty output whose gradients with respect
to q, k and v are all zero, of their shapes: ``torch.autograd.grad`` over all three works (it refused k and v, which
the empty output did not depend on)."""

from __future__ import annotations

import pytest
import torch

from mmsparse import TritonMBSAttnKernel, mbs_attention

TOPOLOGY = [[1, 1], [0, 1]]


@pytest.mark.parametrize("seq_q, seq_k", [(0, 6), (0, 0)], ids=["no-queries", "no-keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_of_an_empty_call_are_zeros(device, seq_q, seq_k, dtype):
    q = torch.randn(2, 4, seq_q, 16, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, seq_k, 16, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    out = mbs_attention(q, k, v, TOPOLOGY, (seq_k // 2, seq_k - seq_k // 2))
    assert out.shape == q.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), grad_outputs=torch.ones_like(out))
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert g is not None and g.shape == t.shape and g.dtype == dtype, name
        assert torch.count_nonzero(g) == 0, f"d{name} is not zero"


def test_gradients_of_an_empty_call_through_the_module(device):
    module = TritonMBSAttnKernel(TOPOLOGY, (3, 3))
    q = torch.randn(1, 2, 0, 16, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 16, device=device, requires_grad=True) for _ in range(2))
    dq, dk, dv = torch.autograd.grad(module(q, k, v).sum(), (q, k, v))
    assert dq.shape == q.shape and not dk.any() and not dv.any() and dk.shape == k.shape
