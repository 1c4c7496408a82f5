"""mmsparse.nn: the layer and replace_attention against independent dense computations, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mmsparse import reference_mask
from mmsparse.nn import MultiheadMBSAttention, MultimodalSelfAttention, clip_seg_lens, replace_attention
from tests.helpers import RING, assert_close, layer_reference, run_example

ALL = [[1, 1, 1], [1, 1, 1], [1, 1, 1]]
SEG = (7, 20, 13)  # S = 40: ragged against the interpreter's 16/32 tiles
E, H = 32, 2


def assert_model_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    """fp32 model vs fp32 model (both rounded): relative L2 and max abs against the larger of 1 and the ref's max."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN at {torch.isnan(a).nonzero()[:5].tolist()}"
    scale = max(e.abs().max().item(), 1.0)
    rel = ((a - e).norm() / max(e.norm().item(), scale)).item()
    max_abs = (a - e).abs().max().item()
    assert rel <= tol and max_abs <= tol * scale, f"{name}: rel L2 {rel:.3e}, max abs {max_abs:.3e} (tol {tol:.0e})"


CASES = {
    "B2-H2-kv1-S40-causal": dict(num_kv_heads=1, causal=True, per_sample=None),
    "B2-H2-kv2-S40": dict(num_kv_heads=None, causal=False, per_sample=None),
    "B2-H2-kv2-S40-padded": dict(num_kv_heads=None, causal=False, per_sample=[(7, 20, 13), (5, 11, 9)]),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_layer_matches_dense_reference(case, device):
    torch.manual_seed(0)
    layer = MultimodalSelfAttention(E, H, RING, SEG, num_kv_heads=case["num_kv_heads"], causal=case["causal"])
    layer = layer.to(device)
    x = torch.randn(2, sum(SEG), E, device=device, requires_grad=True)
    lens = case["per_sample"]
    out = layer(x, seg_lens=lens)
    grad = torch.randn_like(out)
    out.backward(grad)

    mask = reference_mask(RING, SEG if lens is None else lens, sum(SEG), causal=case["causal"])
    ref, xd, p = layer_reference(layer, x, mask)
    ref.backward(grad.double())
    assert_close("out", out, ref, torch.float32)
    assert_close("dx", x.grad, xd.grad, torch.float32)
    for name, param in layer.named_parameters():
        assert_close(f"d{name}", param.grad, p[name].grad, torch.float32)


def test_layer_validates_arguments():
    bad = [
        dict(embed_dim=30, num_heads=2),  # not divisible
        dict(embed_dim=24, num_heads=2),  # head dim 12
        dict(embed_dim=32, num_heads=2, num_kv_heads=3),
        dict(embed_dim=32, num_heads=0),
        dict(embed_dim=32, num_heads=2, dropout=1.0),
        dict(embed_dim=32, num_heads=2, topology=[[1, 2], [0, 1]]),
        dict(embed_dim=32, num_heads=2, seg_lens=(3, 4)),  # 2 lengths for 3 segments
        dict(embed_dim=32, num_heads=2, seg_lens=(3, -1, 4)),
    ]
    for kw in bad:
        args = dict(topology=RING, seg_lens=SEG) | kw
        with pytest.raises(ValueError):
            MultimodalSelfAttention(**args)
    layer = MultimodalSelfAttention(E, H, RING, SEG, num_kv_heads=1, causal=True)
    text = repr(layer)
    for part in ("embed_dim=32", "num_heads=2", "num_kv_heads=1", "seg_lens=(7, 20, 13)", "causal=True"):
        assert part in text
    with pytest.raises(ValueError, match="sum to 40"):
        layer(torch.randn(1, 39, E))
    with pytest.raises(ValueError, match=r"\[batch, seq, 32\]"):
        layer(torch.randn(1, 40, 16))


def test_clip_seg_lens():
    got = clip_seg_lens((3, 4, 5), torch.tensor([12, 5, 0, 8]))
    assert got.tolist() == [[3, 4, 5], [3, 2, 0], [0, 0, 0], [3, 4, 1]]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_replace_encoder_layer_all_ones_matches_original(batch_first, device):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.1, batch_first=batch_first).to(device).eval()
    original = copy.deepcopy(layer)
    mha = layer.self_attn
    assert replace_attention(layer, ALL, SEG) == ["self_attn"]
    new = layer.self_attn
    assert isinstance(new, MultiheadMBSAttention) and not new.training
    assert new.in_proj_weight is mha.in_proj_weight and new.out_proj is mha.out_proj  # shared, not copied
    assert list(layer.state_dict()) == list(original.state_dict())

    shape = (2, sum(SEG), E) if batch_first else (sum(SEG), 2, E)
    x = torch.randn(shape, device=device)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [m(t) for m, t in zip((layer, original), xs)]
    grad = torch.randn_like(outs[0])
    for o in outs:
        o.backward(grad)
    assert_model_close("out", outs[0], outs[1])
    assert_model_close("dx", xs[0].grad, xs[1].grad)
    ref_params = dict(original.named_parameters())
    for name, param in layer.named_parameters():
        assert_model_close(f"d{name}", param.grad, ref_params[name].grad)


def test_replaced_layer_runs_the_topology_under_no_grad(device):
    """In eval + no_grad nn.TransformerEncoderLayer has a fused fast path: the replacement must not be bypassed.

    Compared with the original layer given the equivalent dense mask (True = blocked in torch's convention).
    """
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(E, H, 64, batch_first=True).to(device).eval()
    original = copy.deepcopy(layer)
    replace_attention(layer, RING, SEG, causal=True)
    blocked = ~reference_mask(RING, SEG, sum(SEG), causal=True)[0].to(device)
    x = torch.randn(2, sum(SEG), E, device=device)
    with torch.no_grad():
        out, ref, plain = layer(x), original(x, src_mask=blocked), original(x)
    assert_model_close("out", out, ref)
    assert (out - plain).abs().max() > 1e-2  # the topology changed the result


def test_replace_encoder_stack_with_padding(device):
    """nn.TransformerEncoder (seq-first) with right padding via src_key_padding_mask: valid positions match."""
    torch.manual_seed(3)
    enc_layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0)
    model = nn.TransformerEncoder(enc_layer, num_layers=2, enable_nested_tensor=False).to(device).train()
    original = copy.deepcopy(model)
    assert replace_attention(model, ALL, SEG) == ["layers.0.self_attn", "layers.1.self_attn"]
    valid = torch.tensor([sum(SEG), 30], device=device)
    pad = torch.arange(sum(SEG), device=device)[None, :] >= valid[:, None]  # [B, S], True = padding
    x = torch.randn(sum(SEG), 2, E, device=device)
    out, ref = model(x, src_key_padding_mask=pad), original(x, src_key_padding_mask=pad)
    keep = ~pad.T[..., None]
    assert_model_close("out", out * keep, ref * keep)
    (out * keep).square().sum().backward()
    (ref * keep).square().sum().backward()
    ref_params = dict(original.named_parameters())
    for name, param in model.named_parameters():
        assert_model_close(f"d{name}", param.grad, ref_params[name].grad)
    with pytest.raises(ValueError, match="right padding"):
        model(x, src_key_padding_mask=pad.flip(-1))


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_key_padding_mask_is_bool_or_zero_and_minus_inf_of_the_input_shape(batch_first, device):
    """As torch's MHA takes it: ``[batch, seq]``, bool (True = padding) or float added to the scores; mmsparse takes
    a float one of 0 and -inf only (another value would change the scores, not drop the key). Anything else is an
    error that says so, not a mask read some other way."""
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first).to(device)
    layer = MultiheadMBSAttention(mha, ALL, SEG)
    S = sum(SEG)
    x = torch.randn(2, S, E, device=device)
    x = x if batch_first else x.transpose(0, 1)
    pad = torch.arange(S, device=device)[None, :] >= torch.tensor([S, 30], device=device)[:, None]
    as_float = torch.zeros(2, S, device=device).masked_fill(pad, float("-inf"))
    assert torch.equal(layer(x, x, x, key_padding_mask=pad)[0], layer(x, x, x, key_padding_mask=as_float)[0])
    cases = [
        (pad[:, :-1], ValueError, r"\[batch, seq\] = \[2, 40\]"),
        (pad[:1], ValueError, r"\[batch, seq\] = \[2, 40\]"),
        (pad[:, None], ValueError, r"\[batch, seq\] = \[2, 40\]"),
        (as_float.masked_fill(pad, -10.0), ValueError, "0 \\(attend\\) and -inf \\(padding\\) only"),
        (pad.int(), TypeError, "bool \\(True = padding\\) or float"),
    ]
    for mask, error, match in cases:
        with pytest.raises(error, match=match):
            layer(x, x, x, key_padding_mask=mask)


class _Block(nn.Module):
    """A custom block that calls an MHA directly, next to a decoder layer whose cross-attention must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(E, H, 64, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def test_replace_bare_mha_and_keep_cross_attention(device):
    torch.manual_seed(4)
    block = _Block().to(device)
    original = copy.deepcopy(block)
    names = replace_attention(block, RING, SEG, include=lambda name, m: not name.startswith("dec"))
    assert names == ["attn"]
    assert isinstance(block.dec.self_attn, nn.MultiheadAttention)
    assert isinstance(block.dec.multihead_attn, nn.MultiheadAttention)
    x = torch.randn(1, sum(SEG), E, device=device)
    out = block(x)
    ref_mask = ~reference_mask(RING, SEG, sum(SEG))[0].to(device)
    ref = original.attn(x, x, x, attn_mask=ref_mask)[0]
    assert_model_close("out", out, ref)

    with pytest.raises(ValueError, match="self-attention only"):
        block.attn(x, x.clone(), x)
    with pytest.raises(ValueError, match="no nn.MultiheadAttention"):
        replace_attention(nn.Linear(4, 4), RING, SEG)
    both = replace_attention(copy.deepcopy(original), RING, SEG)
    assert both == ["attn", "dec.self_attn"]  # cross-attention left alone


def test_example_tiny_runs(tmp_path):
    result = run_example("train_multimodal", ["--tiny", "--steps", "4", "--out", str(tmp_path)])
    assert len(result["mmsparse"]["loss"]) == len(result["dense"]["loss"]) == 4
    diff = max(abs(a - b) for a, b in zip(result["mmsparse"]["loss"], result["dense"]["loss"]))
    assert diff < 1e-3, diff
    assert result["mmsparse"]["tokens_per_s"] > 0 and result["dense"]["tokens_per_s"] > 0
    assert (tmp_path / "train_multimodal_tiny.json").exists()
