"""Shared test helpers: inputs, the float64 comparison, verbose closeness checks."""

from __future__ import annotations

import torch

from mmsparse import mbs_attention, reference_attention, reference_mask

# dtype -> (max relative L2 error, max abs error relative to the reference's max magnitude)
TOLERANCE = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (3e-3, 1.5e-2),
    torch.bfloat16: (2e-2, 8e-2),
}


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative L2 and scaled max-abs check; the message names the tensor, the errors and any NaN positions."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    nan = torch.isnan(a)
    assert not nan.any(), f"{name}: {int(nan.sum())} NaN of {a.numel()}, first at {nan.nonzero()[:5].tolist()}"
    rel_tol, abs_tol = TOLERANCE[dtype]
    # Inputs are unit-scale randn: a reference that is (near) zero, e.g. dq of a row with one key, is judged
    # against unit scale instead of its own vanishing magnitude.
    scale = max(e.abs().max().item(), 1.0)
    rel = ((a - e).norm() / max(e.norm().item(), 1e-2 * e.numel() ** 0.5)).item()
    max_abs = (a - e).abs().max().item()
    where = tuple((a - e).abs().flatten().argmax().item() // s % n for s, n in zip(_strides(a.shape), a.shape))
    assert rel <= rel_tol and max_abs <= abs_tol * scale, (
        f"{name} ({dtype}): rel L2 {rel:.3e} (tol {rel_tol:.0e}), max abs {max_abs:.3e} at {where} "
        f"(tol {abs_tol * scale:.3e}), ref max {scale:.3e}"
    )


def _strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return list(reversed(out))


def make_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, device, generator=None):
    def rnd(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    q = rnd(batch, heads, seq_q, head_dim).requires_grad_()
    k = rnd(batch, kv_heads, seq_k, head_dim).requires_grad_()
    v = rnd(batch, kv_heads, seq_k, head_dim).requires_grad_()
    return q, k, v


def reference_grads(q, k, v, mask, grad_out, softmax_scale=None, **kw):
    """Float64 reference output and (dq, dk, dv)."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(qd, kd, vd, mask, softmax_scale=softmax_scale, **kw)
    out.backward(grad_out.double())
    return out, qd.grad, kd.grad, vd.grad


def check_against_reference(q, k, v, topology, seg_lens, causal=False, softmax_scale=None, **kw):
    """Run mbs_attention forward and backward; compare output and all three gradients with float64."""
    out = mbs_attention(q, k, v, topology, seg_lens, causal=causal, softmax_scale=softmax_scale, **kw)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    mask = reference_mask(topology, seg_lens, k.shape[2], q.shape[2], causal=causal)
    ref, dq, dk, dv = reference_grads(q, k, v, mask, grad_out, softmax_scale=softmax_scale)
    for name, a, e in (("out", out, ref), ("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert_close(name, a, e, q.dtype)
    return out, mask
