"""The ordered one-pass backward (``KernelConfig.deterministic_backward = "ordered_one_pass"``): the one-pass dK/dV
kernel adds into each dQ tile in the order of the key blocks, counted by a semaphore per tile. Two calls give the
same bits, dropout runs the tl kernel, torch's deterministic mode allows it, the plan and the list preparation, and
bad settings are ValueErrors. Its output and gradients against the float64 reference, with every semaphore's count,
are test_one_pass.py's cases run under both one-pass backwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE, mbs_attention, use_config
from mmsparse.attention.config import KernelConfig, Tile, cuda_kernel_config, kernel_config
from mmsparse.attention.kernel_args import list_tiles, prepare
from mmsparse.attention.plan import plan_attention
from mmsparse.mask.build import build_mask_info
from tests.helpers import CYCLIC, HUB, forward_backward, make_qkv

ORDERED = "ordered_one_pass"
PAIR_TYPES = [[CAUSAL, FULL, NONE], [FULL, CAUSAL, NONE], [CAUSAL, NONE, FULL]]


def test_ordered_one_pass_is_bitwise_repeatable_and_close_to_two_passes(device):
    """Two calls give the same bits in all of out, dq, dk, dv; against the two passes dQ differs by the order of
    float32 adds only (dK, dV: the same kernel's numbers)."""
    q, k, v = make_qkv(2, 4, 2, 70, 70, 40, torch.bfloat16, device, torch.Generator().manual_seed(21))
    grad_out = torch.randn(2, 4, 70, 40, generator=torch.Generator().manual_seed(22)).to(device, torch.bfloat16)
    kw = dict(topology=PAIR_TYPES, seg_lens=(15, 33, 22), causal=True)
    with use_config(deterministic_backward=ORDERED):
        runs = [forward_backward(q, k, v, grad_out, **kw) for _ in range(2)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name
    two = forward_backward(q, k, v, grad_out, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), two[1:], runs[0][1:]):
        a, b = a.double(), b.double()
        tol = 1e-5 * a.abs().max().item() + 2.0**-7 * torch.maximum(a.abs(), b.abs())
        assert ((a - b).abs() <= tol).all(), f"{name}: max diff {(a - b).abs().max().item():.3e}"


def test_ordered_one_pass_with_dropout_is_the_tl_kernel_and_agrees(device):
    """Dropout (the tl kernel everywhere): with the same seed the output is the two passes' and the gradients agree
    up to the order of float32 adds."""
    q, k, v = make_qkv(2, 4, 2, 60, 60, 32, torch.float32, device, torch.Generator().manual_seed(25))
    grad_out = torch.randn(2, 4, 60, 32, generator=torch.Generator().manual_seed(26)).to(device)
    kw = dict(topology=CYCLIC, seg_lens=(9, 30, 21), causal=True, dropout_p=0.3)
    torch.manual_seed(1234)
    two = forward_backward(q, k, v, grad_out, **kw)
    with use_config(deterministic_backward=ORDERED):
        torch.manual_seed(1234)
        ordered = forward_backward(q, k, v, grad_out, **kw)
    assert torch.equal(two[0], ordered[0])
    for name, a, b in zip(("dq", "dk", "dv"), two[1:], ordered[1:]):
        a, b = a.double(), b.double()
        tol = 1e-5 * a.abs().max().item() + 2.0**-23 * torch.maximum(a.abs(), b.abs())
        assert ((a - b).abs() <= tol).all(), f"{name}: max diff {(a - b).abs().max().item():.3e}"


def test_ordered_one_pass_is_not_the_nondeterministic_alert(device):
    """Deterministic in torch's sense: torch.use_deterministic_algorithms(True) does not refuse it."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, device, torch.Generator().manual_seed(2))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with use_config(deterministic_backward=ORDERED):
            out = mbs_attention(q, k, v, HUB, (10, 18, 12))
            out.backward(torch.ones_like(out))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_plan_and_prepared_lists(device):
    cfg = dataclasses.replace(kernel_config(32, torch.float32, device), deterministic_backward=ORDERED)
    plan = plan_attention(cfg, 2, 4, 2, 60, 60, device, None, False)
    assert plan.dq is None and plan.dkdv.one_pass and plan.dkdv.ordered and not plan.side_stream
    assert plan.kernels() == {"forward": "tl", "dq": "ordered-one-pass", "dkdv": "tl"}
    atomic = plan_attention(cfg, 2, 4, 2, 60, 60, device, None, False, deterministic=False)
    assert atomic.dkdv.one_pass and not atomic.dkdv.ordered and atomic.kernels()["dq"] == "one-pass"
    long = plan_attention(cfg, 2, 4, 2, 60, cfg.one_pass_max_keys, device, None, False)
    assert long.dq is not None and not long.dkdv.one_pass  # the same threshold as the atomic one-pass
    tile = cfg.one_pass_kernel_tile(ordered=True)
    assert list_tiles(cfg, 60, 60)[1:] == plan.list_tiles(forward=False) == [(tile.block_m, tile.block_n, True)]
    info = build_mask_info(HUB, (20, 25, 15), 60, 60, True, device)
    prepare(info, cfg)  # ahead of a call (CUDA-graph capture): the ordered one's add ranks too
    assert (tile.block_m, tile.block_n) in info._add_ranks
    assert info.dq_add_ranks(tile.block_m, tile.block_n).shape == info.lists(tile.block_m, tile.block_n,
                                                                             True).indices.shape
    gluon = dataclasses.replace(cuda_kernel_config(128, torch.bfloat16), deterministic_backward=ORDERED)
    short = plan_attention(gluon, 4, 16, 4, 1024, 1024, torch.device("cpu"), None, False, sms=132)
    assert short.dkdv.gluon and short.dkdv.ordered and short.kernels()["dq"] == "ordered-one-pass"
    dropout = plan_attention(gluon, 4, 16, 4, 1024, 1024, torch.device("cpu"), None, True, sms=132)
    assert not dropout.dkdv.gluon and dropout.dkdv.ordered


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="deterministic_backward must be one of 'two_pass', 'ordered_one_pass'"):
        KernelConfig(fwd=Tile(16, 16), bwd_dkdv=Tile(16, 16), bwd_dq=Tile(16, 16), decode=Tile(16, 16),
                     deterministic_backward="ordered")
    with pytest.raises(ValueError, match="got 'one_pass'"), use_config(deterministic_backward="one_pass"):
        pass
    bulk = Tile(64, 128, gluon_stages=3, dq_adds="bulk")  # the ordered one-pass runs the Gluon dK/dV tile
    with pytest.raises(ValueError, match="bwd_dkdv has dq_adds='bulk': give it dq_adds='atomic'"):
        KernelConfig(fwd=Tile(16, 16), bwd_dkdv=bulk, bwd_dq=Tile(16, 16), decode=Tile(16, 16),
                     deterministic_backward="ordered_one_pass")
    KernelConfig(fwd=Tile(16, 16), bwd_dkdv=bulk, bwd_dq=Tile(16, 16), decode=Tile(16, 16))  # two passes: fine
    assert KernelConfig.deterministic_backward == "two_pass"  # the default until timed faster on a GPU
