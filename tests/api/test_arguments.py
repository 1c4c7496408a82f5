"""Argument handling of the public API: a mask alone, SDPA-style masks, what is rejected and how it is said."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmsparse import TritonMBSAttnKernel, generate_interlaced_mask, mbs_attention, mbs_attention_varlen
from mmsparse.nn import MultimodalSelfAttention
from tests.helpers import RING, check_outputs, make_qkv

LENS = (9, 21, 14)  # S = 44: ragged against the interpreter's 32x16 tiles


def test_mask_alone_equals_topology_path(device):
    """mbs_attention(q, k, v, attn_mask=mask) with no topology: the same result as the topology path, bit for bit
    through the interpreter (the CUDA variants may reduce in another order, see test_attention)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(2, 2, 1, 44, 44, 16, torch.float32, device, gen)
    by_topology = mbs_attention(q, k, v, RING, LENS)
    by_mask = mbs_attention(q, k, v, attn_mask=generate_interlaced_mask(RING, LENS).to(device))
    if device.type == "cpu":
        assert torch.equal(by_mask, by_topology)
    else:
        torch.testing.assert_close(by_mask, by_topology, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["sdpa-4d", "key-padding", "full-rows"], ids=str)
def test_sdpa_style_masks_match_reference(form, device):
    """[B, 1, Sq, S] per-sample masks, [B, 1, 1, S] key padding masks, and an [S, S] mask for Sq < S queries."""
    gen = torch.Generator().manual_seed(5)
    batch, seq_q, seq_k = 2, (44 if form != "full-rows" else 13), 44
    q, k, v = make_qkv(batch, 2, 2, seq_q, seq_k, 16, torch.float32, device, gen)
    if form == "sdpa-4d":
        mask = torch.rand(batch, 1, seq_q, seq_k, generator=gen) < 0.4
        mask[1, 0, 3] = False  # a row that sees nothing
        expected = mask[:, 0]
    elif form == "key-padding":
        mask = torch.ones(batch, 1, 1, seq_k, dtype=torch.bool)
        mask[1, ..., 30:] = False  # sample 1 has 30 real keys
        expected = mask[:, 0].expand(batch, seq_q, seq_k)
    else:
        mask = torch.rand(seq_k, seq_k, generator=gen) < 0.5
        expected = mask[seq_k - seq_q :]
    out = mbs_attention(q, k, v, attn_mask=mask.to(device))
    grad_out = torch.randn(out.shape, generator=gen).to(device)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, expected)


def test_topology_and_mask_together_is_an_error(device):
    q, k, v = make_qkv(1, 1, 1, 44, 44, 16, torch.float32, device)
    mask = torch.ones(44, 44, dtype=torch.bool, device=device)
    for topology, seg_lens in ((RING, LENS), ([[2]], "junk"), (None, LENS), (RING, None)):
        with pytest.raises(ValueError, match="either a topology with seg_lens, or attn_mask, not both"):
            mbs_attention(q, k, v, topology, seg_lens, attn_mask=mask)
    with pytest.raises(ValueError, match="q_start goes with a topology"):
        mbs_attention(q, k, v, attn_mask=mask, q_start=[0])
    with pytest.raises(ValueError, match="needs a topology with seg_lens, or attn_mask"):
        mbs_attention(q, k, v)


def test_mask_shape_message_is_readable(device):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, torch.float32, device)
    with pytest.raises(ValueError) as e:
        mbs_attention(q, k, v, attn_mask=torch.ones(63, 63, dtype=torch.bool, device=device))
    assert str(e.value) == (
        "attn_mask has shape (63, 63); expected a bool mask of queries x keys: [64, 64], [B, 64, 64] or SDPA's "
        "[B, 1, 64, 64], with B = 1; a query dim of 1 broadcasts over the queries"
    )
    q, k, v = make_qkv(2, 2, 2, 5, 64, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"\[5 or 64, 64\] \(with 64 rows, the last 5 are the queries'\).*B = 1 or 2"):
        mbs_attention(q, k, v, attn_mask=torch.ones(3, 5, 64, dtype=torch.bool, device=device))


def test_unsupported_masks_say_what_is_supported(device):
    q, k, v = make_qkv(2, 2, 2, 20, 20, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"a mask per head \(2 heads\) is not supported.*\[B, 1, Sq, S\]"):
        mbs_attention(q, k, v, attn_mask=torch.ones(2, 2, 20, 20, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="additive float masks are not supported.*attn_mask == 0"):
        mbs_attention(q, k, v, attn_mask=torch.zeros(2, 1, 20, 20, device=device))
    with pytest.raises(TypeError, match=r"attn_mask.bool\(\)"):
        mbs_attention(q, k, v, attn_mask=torch.ones(20, 20, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mbs_attention(q, k, v, attn_mask=np.ones((20, 20), dtype=bool))


def test_causal_must_be_a_bool(device):
    q, k, v = make_qkv(1, 1, 1, 44, 44, 16, torch.float32, device)
    mask = torch.ones(44, 44, dtype=torch.bool, device=device)
    with pytest.raises(TypeError, match="causal must be True or False; got str 'yes'"):
        mbs_attention(q, k, v, RING, LENS, causal="yes")
    with pytest.raises(TypeError, match="causal must be True or False"):
        mbs_attention(q, k, v, attn_mask=mask, causal="yes")
    with pytest.raises(TypeError, match="causal must be True or False"):
        mbs_attention_varlen(q, k, v, RING, [LENS], causal=None)
    with pytest.raises(TypeError, match="causal_mask must be True or False"):
        TritonMBSAttnKernel(RING, LENS, causal_mask="no")
    with pytest.raises(TypeError, match="causal must be True or False"):
        MultimodalSelfAttention(32, 2, RING, LENS, causal="yes")
    # bool-like values are fine and mean what they say
    torch.testing.assert_close(mbs_attention(q, k, v, RING, LENS, causal=np.bool_(True)),
                               mbs_attention(q, k, v, RING, LENS, causal=True), rtol=0, atol=0)
    assert TritonMBSAttnKernel(RING, LENS, causal_mask=1).causal_mask is True


def test_sequence_first_layout_gets_a_hint(device):
    """q/k/v laid out [B, S, H, D] by mistake: the length error says which layout mmsparse takes."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 44, 2, 16, generator=gen).to(device) for _ in range(3))
    with pytest.raises(ValueError, match=r"k/v have 44 in dim 1 and 2 in dim 2: .*\[B, H, S, D\].*transpose\(1, 2\)"):
        mbs_attention(q, k, v, RING, LENS)
    with pytest.raises(ValueError, match=r"transpose\(1, 2\)"):
        mbs_attention(q, k, v, RING, [LENS, LENS])
    with pytest.raises(ValueError, match=r"transpose\(1, 2\)"):
        TritonMBSAttnKernel(RING, LENS)(q, k, v)
    gqa_q = torch.randn(1, 44, 4, 16, device=device)  # 4 query heads over 2 kv heads, [B, S, H, D]
    with pytest.raises(ValueError, match=r"q has 4 positions but k/v only 2.*transpose\(1, 2\)"):
        mbs_attention(gqa_q, k[:, :, :, :], v, RING, LENS)
    # a genuine length error in the right layout has no layout hint
    with pytest.raises(ValueError) as e:
        mbs_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), RING, (9, 21, 15))
    assert "transpose" not in str(e.value)
