"""Tiles and thresholds are one namespace, ``mmsparse.tuning``; ``mmsparse.use_config`` sets ``deterministic`` only.
Each misplaced setting is a TypeError that names where it went."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mmsparse
from mmsparse import mbs_attention, reference_mask, use_config
from mmsparse.attention.config import default_deterministic, kernel_config
from mmsparse.attention.plan import plan_attention
from mmsparse.tuning import THRESHOLDS, KernelConfig, Tile, default_config, use_tuning
from tests.helpers import HUB, check_outputs, make_qkv

LENS = (20, 30, 14)


@pytest.mark.parametrize("name", ["Tile", "KernelConfig"])
def test_the_old_top_level_names_still_import_and_say_where_they_went(name):
    """``from mmsparse import Tile`` (old code, the previous docs) still works for one release: mmsparse.tuning's
    object, with a DeprecationWarning naming its home."""
    with pytest.warns(DeprecationWarning, match=rf"mmsparse\.tuning\.{name}"):
        old = getattr(mmsparse, name)
    assert old is getattr(mmsparse.tuning, name)
    with pytest.warns(DeprecationWarning, match=rf"mmsparse\.tuning\.{name}"):
        exec(f"from mmsparse import {name} as imported", {})
    assert name not in mmsparse.__all__ and name not in dir(mmsparse) and "tuning" in mmsparse.__all__
    with pytest.raises(AttributeError, match="has no attribute 'Tiles'"):
        mmsparse.Tiles  # noqa: B018


OLD_SPELLINGS = {"positional": ((True,), {}), "thresholds": ((), {"short_keys": 0}),
                 "config-keyword": ((), {"config": True}), "with-deterministic": ((True,), {"deterministic": False})}


@pytest.mark.parametrize("spelling", OLD_SPELLINGS.values(), ids=OLD_SPELLINGS)
def test_use_config_with_tiles_and_thresholds_warns_and_does_what_use_tuning_does(spelling):
    """The old ``use_config(config)``, ``use_config(config=...)`` and ``use_config(short_keys=0)`` work for one
    release, with a DeprecationWarning naming ``mmsparse.tuning.use_tuning``, and set what use_tuning sets
    (``deterministic`` in the same call too)."""
    table = default_config(16, torch.float32, "cpu")
    odd = KernelConfig(fwd=Tile(16, 32), bwd_dkdv=Tile(32, 16), bwd_dq=Tile(16, 32), decode=Tile(16, 16))
    args, kwargs = spelling
    args = tuple(odd if a is True else a for a in args)
    kwargs = {k: odd if v is True else v for k, v in kwargs.items()}
    deterministic = kwargs.pop("deterministic", None)
    config = args[0] if args else kwargs.get("config")
    thresholds = {k: v for k, v in kwargs.items() if k != "config"}
    with use_tuning(config, **thresholds), use_config(deterministic=deterministic):
        expected = (kernel_config(16, torch.float32, torch.device("cpu")), default_deterministic())
    with pytest.warns(DeprecationWarning, match=r"mmsparse\.tuning\.use_tuning"):
        block = use_config(*args, deterministic=deterministic, **kwargs)
    with block:
        assert (kernel_config(16, torch.float32, torch.device("cpu")), default_deterministic()) == expected
    assert kernel_config(16, torch.float32, torch.device("cpu")) == table and default_deterministic() is True


def test_use_config_still_refuses_what_use_tuning_refuses():
    for kwargs, match in (({"deterministic_backward": "two_pass"}, r"deterministic_backward\b.*was removed"),
                          ({"short_key": 0}, r"use_config sets a config and the thresholds.*\['short_key'\]"),
                          ({"config": Tile(16, 16)}, r"use_config\(config\) takes a mmsparse\.tuning\.KernelConfig")):
        with pytest.raises(TypeError, match=match):
            with use_config(**kwargs):
                pass
    with pytest.raises(ValueError, match=r"use_config\(short_keys=\.\.\.\) must be an int >= 0"):
        use_config(short_keys=-1)
    with pytest.raises(TypeError, match="one config"):
        use_config(None, config=None)
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


@pytest.mark.parametrize("args, error, match", [
    ((12, torch.float32, "cpu"), ValueError, "head_dim must be a multiple of 8 between 16 and 256; got 12"),
    (("128", torch.float32, "cpu"), TypeError, "head_dim must be an int; got str '128'"),
    ((True, torch.float32, "cpu"), TypeError, "head_dim must be an int; got bool"),
    ((128, torch.int32, "cpu"), TypeError, "dtype must be one of"),
    ((128, torch.float32, "tpu"), ValueError, "a name such as 'cuda'"),
    ((128, torch.float32, "meta"), ValueError, "unsupported device meta"),
])
def test_default_config_refuses_what_no_call_takes(args, error, match):
    """A head dim, dtype or device no call takes is an error that says so (the table came back for any head dim
    and dtype, and a device torch could not parse, or CUDA on a machine without it, failed inside torch)."""
    with pytest.raises(error, match=match):
        default_config(*args)
