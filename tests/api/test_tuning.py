"""Tiles and thresholds are one namespace, ``mmsparse.tuning``; ``mmsparse.use_config`` sets ``deterministic`` only.
Each misplaced setting is a TypeError that names where it went."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mmsparse
from mmsparse import mbs_attention, reference_mask, use_config
from mmsparse.attention.config import kernel_config
from mmsparse.attention.plan import plan_attention
from mmsparse.tuning import THRESHOLDS, KernelConfig, Tile, default_config, use_tuning
from tests.helpers import HUB, check_outputs, make_qkv

LENS = (20, 30, 14)


@pytest.mark.parametrize("name", ["Tile", "KernelConfig"])
def test_the_old_top_level_names_say_where_they_went(name):
    with pytest.raises(AttributeError, match=rf"mmsparse\.tuning\.{name}"):
        getattr(mmsparse, name)
    assert name not in mmsparse.__all__ and "tuning" in mmsparse.__all__


def test_use_config_refuses_tiles_and_thresholds_with_the_new_home():
    table = default_config(16, torch.float32, "cpu")
    for args, kwargs in (((table,), {}), ((), {"short_keys": 0}), ((), {"config": table})):
        with pytest.raises(TypeError, match=r"mmsparse\.tuning\.use_tuning"):
            with use_config(*args, **kwargs):
                pass
    with pytest.raises(TypeError, match=r"deterministic is mmsparse\.use_config's"):
        with use_tuning(deterministic=False):
            pass


def test_use_tuning_sets_the_tiles_and_thresholds_a_call_plans_with(device):
    table = default_config(16, torch.float32, device)
    assert table == kernel_config(16, torch.float32, device)
    odd = KernelConfig(fwd=Tile(16, 32), bwd_dkdv=Tile(32, 16), bwd_dq=Tile(16, 32), decode=Tile(16, 16))
    seq = sum(LENS)
    with use_tuning(odd, short_keys=0), use_config(deterministic=False):
        cfg = kernel_config(16, torch.float32, device)
        assert dataclasses.replace(cfg, short_keys=odd.short_keys) == odd and cfg.short_keys == 0
        assert default_config(16, torch.float32, device) == table  # the table, not the thread's tuning
        assert plan_attention(cfg, 1, 2, 1, seq, seq, device).forward.tile == odd.fwd
        q, k, v = make_qkv(1, 2, 1, seq, seq, 16, torch.float32, device, torch.Generator().manual_seed(4))
        out = mbs_attention(q, k, v, HUB, LENS)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    out.backward(grad_out)  # outside both blocks: the forward's tiles and one-pass backward
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, LENS, seq))
    assert kernel_config(16, torch.float32, device) == table
    assert set(THRESHOLDS) <= {f.name for f in dataclasses.fields(KernelConfig)}
