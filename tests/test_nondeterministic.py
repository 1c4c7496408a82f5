"""deterministic=False: dQ added atomically inside the dK/dV pass. Same float64 checks as the default path, and
dK/dV unchanged bit for bit where both modes use the same dK/dV tile."""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_reference, check_outputs, make_qkv
from test_attention import _case_id, _random_case

from mmsparse import TritonMBSAttnKernel, mbs_attention, mbs_attention_varlen, reference_mask
from mmsparse.nn import MultimodalSelfAttention
from mmsparse.ops.config import kernel_config

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
HUB = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]


@pytest.mark.parametrize("seed", range(0, 24, 3), ids=_case_id)
def test_random_topologies_with_atomic_dq(seed, device):
    c = _random_case(seed)
    gen = torch.Generator().manual_seed(2000 + seed)
    q, k, v = make_qkv(c["batch"], c["heads"], c["kv_heads"], c["seq_q"], sum(c["seg_lens"]), c["head_dim"],
                       c["dtype"], device, gen)
    check_against_reference(q, k, v, c["topology"], c["seg_lens"], causal=c["causal"], deterministic=False)


def _grads(q, k, v, grad_out, **kw):
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(7)  # the dropout seed
    mbs_attention(q, k, v, **kw).backward(grad_out)
    return q.grad.clone(), k.grad.clone(), v.grad.clone()


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_atomic_dq_matches_the_deterministic_pass(dropout_p, device):
    """GQA, causal, dropout: dK/dV equal bit for bit (same tile, same order); dQ equal up to fp32 summation
    order, rounded once to the output dtype."""
    q, k, v = make_qkv(2, 4, 2, 53, 61, 32, torch.float16, device)
    grad_out = torch.randn(2, 4, 53, 32, device=device, dtype=torch.float16)
    kw = dict(topology=HUB, seg_lens=(13, 29, 19), causal=True, dropout_p=dropout_p)
    dq, dk, dv = _grads(q, k, v, grad_out, **kw)
    dq_atomic, dk_atomic, dv_atomic = _grads(q, k, v, grad_out, deterministic=False, **kw)
    cfg = kernel_config(32, torch.float16, device)
    if cfg.dkdv_tile(False) == cfg.bwd_dkdv:
        assert torch.equal(dk, dk_atomic) and torch.equal(dv, dv_atomic)
    torch.testing.assert_close(dq_atomic, dq, rtol=2e-3, atol=2e-3)
    assert not dq_atomic.isnan().any()


def test_dense_mask_and_padding_rows_with_atomic_dq(device):
    """A user mask with rows that see nothing: their dQ is exactly 0 (zeroed buffer, nothing added)."""
    s = 47
    mask = torch.rand(s, s, generator=torch.Generator().manual_seed(3)) < 0.4
    mask[5:9] = False
    q, k, v = make_qkv(1, 2, 1, s, s, 16, torch.float32, device)
    out = mbs_attention(q, k, v, None, None, attn_mask=mask.to(device), deterministic=False)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)
    assert torch.equal(q.grad[:, :, 5:9], torch.zeros_like(q.grad[:, :, 5:9]))


def test_module_layer_and_varlen_pass_the_flag(device):
    lens = (7, 20, 12)
    attn = TritonMBSAttnKernel(CYCLIC, lens, deterministic=False)
    assert "deterministic=False" in repr(attn)
    q, k, v = make_qkv(1, 2, 2, 39, 39, 16, torch.bfloat16, device)
    out = attn(q, k, v)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, 39))

    q, k, v = make_qkv(1, 2, 1, 39, 39, 16, torch.float32, device)
    out = mbs_attention_varlen(q, k, v, CYCLIC, [(3, 10, 6), (4, 10, 6)], deterministic=False)
    exact = mbs_attention_varlen(q, k, v, CYCLIC, [(3, 10, 6), (4, 10, 6)])
    torch.testing.assert_close(out, exact, rtol=0, atol=0)
    (out_g,) = torch.autograd.grad(out.sum(), q)
    (exact_g,) = torch.autograd.grad(exact.sum(), q)
    torch.testing.assert_close(out_g, exact_g, rtol=1e-5, atol=1e-5)

    layer = MultimodalSelfAttention(32, 2, CYCLIC, lens).to(device)
    x = torch.randn(1, 39, 32, device=device, requires_grad=True)
    (g_det,) = torch.autograd.grad(layer(x).square().sum(), x)
    layer.deterministic = False
    (g_atomic,) = torch.autograd.grad(layer(x).square().sum(), x)
    torch.testing.assert_close(g_atomic, g_det, rtol=1e-4, atol=1e-5)


def test_atomic_dq_through_pointers(device):
    """The pre-Hopper path: per-element atomics (on Hopper the dQ sums go through TMA bulk reductions)."""
    from dataclasses import replace

    from mmsparse.ops.config import use_config

    q, k, v = make_qkv(2, 2, 1, 37, 53, 40, torch.float16, device)
    with use_config(replace(kernel_config(40, torch.float16, device), use_tma=False)):
        check_against_reference(q, k, v, CYCLIC, (3, 31, 19), causal=True, deterministic=False)
