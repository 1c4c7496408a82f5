"""Dropout: eval is exact, training is seeded by torch's generator, and the backward uses the forward's mask."""

from __future__ import annotations

import torch
from helpers import check_outputs, make_qkv

from mmsparse import TritonMBSAttnKernel, mbs_attention, reference_mask
from mmsparse.functional import new_dropout_seed
from mmsparse.ops.dropout import dropout_keep_mask

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
LENS = (9, 30, 21)


def test_dropout_matches_reference_with_the_same_mask(device):
    p = 0.3
    q, k, v = make_qkv(2, 4, 2, 60, 60, 32, torch.float32, device)
    torch.manual_seed(1234)
    out = mbs_attention(q, k, v, CYCLIC, LENS, causal=True, dropout_p=p)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    torch.manual_seed(1234)
    keep = dropout_keep_mask(new_dropout_seed(q.device), 2, 4, 60, 60, p)
    frac = keep.float().mean().item()
    assert abs(frac - (1 - p)) < 0.02, f"kept fraction {frac:.3f}, expected {1 - p}"
    mask = reference_mask(CYCLIC, LENS, 60, causal=True)
    check_outputs(q, k, v, out, grad_out, mask, dropout_keep=keep, dropout_p=p)


def test_dropout_is_reproducible_and_varies(device):
    q, k, v = make_qkv(1, 2, 2, 60, 60, 16, torch.float16, device)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(mbs_attention(q, k, v, CYCLIC, LENS, dropout_p=0.5))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_module_dropout_only_in_training(device):
    attn = TritonMBSAttnKernel(CYCLIC, LENS, dropout=0.4)
    q, k, v = make_qkv(1, 2, 2, 60, 60, 16, torch.float32, device)
    exact = mbs_attention(q, k, v, CYCLIC, LENS)
    assert torch.equal(attn.eval()(q, k, v), exact)
    assert not torch.equal(attn.train()(q, k, v), exact)
