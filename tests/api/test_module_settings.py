"""A TritonMBSAttnKernel's settings may change after its first call: the next call runs with the new ones (its
masks were kept per query and key count only, so a new causal flag, window or layout of the same total ran with
the old mask). Each setting is checked when set, as the constructor checks it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from mmsparse import Topology, TritonMBSAttnKernel, reference_attention, reference_mask
from tests.helpers import HUB, check_outputs, make_qkv

LENS = (12, 20, 8)


def _check_call(module: TritonMBSAttnKernel, device: torch.device, seq_q: int = 40) -> None:
    """Forward and backward of the module against the float64 reference of its current settings."""
    q, k, v = make_qkv(1, 2, 1, seq_q, sum(module.seg_lens), 16, torch.float32, device,
                       torch.Generator().manual_seed(seq_q))
    out = module(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad_out)
    mask = reference_mask(module.topology, module.seg_lens, k.shape[2], seq_q, causal=module.causal_mask,
                          window=module.window)
    check_outputs(q, k, v, out, grad_out, mask, module.softmax_scale)


@pytest.mark.parametrize("name, value", [("causal_mask", True), ("window", 4), ("seg_lens", (10, 30, 0)),
                                         ("topology", [[1, 0, 0], [1, 1, 0], [0, 1, 1]])])
def test_a_setting_changed_after_a_call_takes_effect(device, name, value):
    module = TritonMBSAttnKernel(HUB, LENS)
    _check_call(module, device)
    setattr(module, name, value)
    _check_call(module, device)
    _check_call(module, device, seq_q=7)  # decoding-like: fewer queries, a mask of its own


def test_scale_and_dropout_changed_after_a_call_take_effect(device):
    module = TritonMBSAttnKernel(HUB, LENS, dropout=0.5).eval()
    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i)).to(device) for i in range(3))
    module(q, k, v)
    module.softmax_scale = 0.5
    ref = reference_attention(q, k, v, reference_mask(HUB, LENS, 40), softmax_scale=0.5)
    assert (module(q, k, v).double() - ref).abs().max().item() < 1e-5
    module.dropout = 0.0
    module.train()
    assert (module(q, k, v).double() - ref).abs().max().item() < 1e-5
    module.deterministic = False
    assert module.deterministic is False


@pytest.mark.parametrize("name, value, error", [
    ("causal_mask", "yes", TypeError), ("window", 0, ValueError), ("window", 2.5, TypeError),
    ("seg_lens", (10, 30), ValueError), ("seg_lens", (10, -1, 31), ValueError), ("topology", [[1, 3], [0, 1]],
                                                                                 ValueError),
    ("dropout", 1.0, ValueError), ("dropout", "0.1", TypeError), ("softmax_scale", -1.0, ValueError),
    ("deterministic", "no", TypeError),
])
def test_a_bad_setting_is_refused_when_set(name, value, error):
    module = TritonMBSAttnKernel(HUB, LENS)
    before = getattr(module, name)
    with pytest.raises(error, match=name if name != "topology" else "topology"):
        setattr(module, name, value)
    assert getattr(module, name) == before or name == "topology"


def test_settings_survive_copies(device):
    module = TritonMBSAttnKernel(Topology(HUB, names=("a", "b", "c")), LENS, window=6, causal_mask=True,
                                 softmax_scale=0.3, deterministic=True)
    for twin in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert (twin.seg_lens, twin.window, twin.causal_mask, twin.softmax_scale, twin.deterministic) == (
            LENS, 6, True, 0.3, True)
        assert twin.topology == module.topology and twin.topology.names == ("a", "b", "c")
        _check_call(twin, device)


def test_a_module_pickled_with_plain_attributes_loads(device):
    """The state of a module saved when the settings were plain attributes (public names, no window or
    deterministic) loads into one with checked settings."""
    module = TritonMBSAttnKernel(HUB, LENS)
    state = module.__getstate__()
    for name in ("topology", "seg_lens", "causal_mask", "dropout", "softmax_scale"):
        state[name] = state.pop("_" + name)
    for name in ("_window", "_deterministic"):
        state.pop(name)
    old = TritonMBSAttnKernel.__new__(TritonMBSAttnKernel)
    old.__setstate__(state)
    assert old.seg_lens == LENS and old.window is None and old.deterministic is None
    _check_call(old, device)
