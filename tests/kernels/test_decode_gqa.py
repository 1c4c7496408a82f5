"""Decoding with GQA: the forward packs a group's query heads into one tile (one K/V read per group)."""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from mmsparse.attention.plan import gqa_pack_rows
from tests.helpers import HUB, RING, check_against_reference, check_outputs, make_qkv


def test_pack_rows():
    assert gqa_pack_rows(1, 1, 16) == 0  # no GQA: nothing to pack
    assert gqa_pack_rows(4, 1, 16) == 16  # at least the decode tile's rows
    assert gqa_pack_rows(4, 5, 16) == 32  # 20 rows, rounded up to a power of two
    assert gqa_pack_rows(4, 16, 16) == 64
    assert gqa_pack_rows(8, 16, 16) == 0  # 128 rows: one program per head instead
    assert gqa_pack_rows(2, 17, 128) == 0  # not a decode step


@pytest.mark.parametrize(
    "heads,kv_heads,q_len,causal,dtype",
    [
        (4, 2, 1, True, torch.float32),  # 2 rows in a 16-row tile
        (8, 2, 3, True, torch.bfloat16),  # 12 rows
        (6, 2, 5, False, torch.float16),  # group of 3: 15 rows
        (4, 1, 16, True, torch.float32),  # 64 rows, the largest packed tile
        (8, 1, 16, True, torch.float16),  # 128 rows: not packed, the per-head path
    ],
)
def test_decode_with_gqa_against_float64(heads, kv_heads, q_len, causal, dtype, device):
    q, k, v = make_qkv(2, heads, kv_heads, q_len, 70, 32, dtype, device)
    check_against_reference(q, k, v, RING, (10, 40, 20), causal=causal)


def test_packed_decode_with_per_sample_caches_and_dropout(device):
    """Per-sample lengths and first-query positions, and dropout (the packed rows draw the bits of their own
    head): output and gradients against the float64 reference with the same keep mask."""
    p, q_len = 0.2, 2
    lens = [(5, 30, 7), (12, 20, 20)]
    q_start = [40, 50]
    q, k, v = make_qkv(2, 8, 2, q_len, 52, 16, torch.float32, device)
    torch.manual_seed(99)
    out = mbs_attention(q, k, v, HUB, lens, causal=True, dropout_p=p, q_start=q_start)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.manual_seed(99)
    keep = dropout_keep_mask(new_dropout_seed(q.device), 2, 8, q_len, 52, p, q_start=q_start)  # bits by position
    mask = reference_mask(HUB, lens, 52, q_len, causal=True, q_start=q_start)
    check_outputs(q, k, v, out, grad_out, mask, dropout_keep=keep, dropout_p=p)


def test_packed_decode_with_a_dense_mask(device):
    """A user mask instead of a topology: the packed rows read the mask row of their query."""
    s, q_len = 45, 3
    mask = torch.rand(s, s, generator=torch.Generator().manual_seed(5)) < 0.5
    mask[-2] = False  # a query that sees nothing: zero output and gradients
    q, k, v = make_qkv(2, 4, 1, q_len, s, 16, torch.float32, device)
    out = mbs_attention(q, k, v, None, None, attn_mask=mask.to(device))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask[None, s - q_len :])


@pytest.mark.parametrize("head_dim", [40, 24])
def test_packed_decode_with_padded_head_dim_and_empty_segment(head_dim, device):
    """Head dims that are not powers of two (the packed loads and stores mask the padded columns), a
    zero-length segment, ragged key tiles, and per-sample first-query positions."""
    lens, q_start = (12, 0, 41), [0, 49]
    q, k, v = make_qkv(2, 6, 2, 4, 53, head_dim, torch.float16, device)
    out = mbs_attention(q, k, v, HUB, lens, causal=True, q_start=q_start)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 53, 4, causal=True, q_start=q_start))
