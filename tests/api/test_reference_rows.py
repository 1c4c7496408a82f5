"""The row-sampled reference used at sizes where an S x S tensor does not fit agrees with the dense one."""

from __future__ import annotations

import torch

from mmsparse import reference_attention, reference_mask
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from mmsparse.reference import reference_group_rows
from tests.helpers import HUB


def _dense(q, k, v, do, mask, keep=None, p=0.0):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(qd, kd, vd, mask, dropout_keep=keep, dropout_p=p)
    out.backward(do.double())
    return out, qd.grad, kd.grad, vd.grad


def test_sampled_rows_match_the_dense_reference(device):
    gen = torch.Generator().manual_seed(3)
    seg, seq, group = (13, 40, 18), 71, 3
    q = torch.randn(1, group, seq, 32, generator=gen, dtype=torch.float64).to(device)
    k, v = (torch.randn(1, 1, seq, 32, generator=gen, dtype=torch.float64).to(device) for _ in "kv")
    do = torch.randn(1, group, seq, 32, generator=gen, dtype=torch.float64).to(device)
    mask = reference_mask(HUB, seg, seq, causal=True)[0].to(device)  # [S, S]
    seed = new_dropout_seed(device)
    for keep in (None, dropout_keep_mask(seed, 1, group, seq, seq, 0.3)):
        p = 0.0 if keep is None else 0.3
        out, dq, dk, dv = _dense(q, k, v, do, mask, keep, p)
        rows, cols = torch.tensor([0, 12, 13, 40, 70], device=device), torch.tensor([1, 13, 52, 70], device=device)
        got = reference_group_rows(
            q[0], k[0, 0], v[0, 0], do[0], lambda idx: mask[idx], rows, cols, dtype=torch.float64, chunk=16,
            keep=None if keep is None else (lambda g, idx, keep=keep: keep[0, g, idx]), dropout_p=p,
        )
        for name, a, e in zip(("out", "dq"), got[:2], (out[0][:, rows], dq[0][:, rows])):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)
        for name, a, e in zip(("dk", "dv"), got[2:], (dk[0, 0, cols], dv[0, 0, cols])):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)
        rows_only = reference_group_rows(q[0], k[0, 0], v[0, 0], do[0], lambda idx: mask[idx], rows,
                                         rows[:0], dtype=torch.float64, chunk=2,
                                         keep=None if keep is None else (lambda g, idx, keep=keep: keep[0, g, idx]),
                                         dropout_p=p)
        torch.testing.assert_close(rows_only[:2], got[:2], rtol=1e-12, atol=1e-12)
