"""The Gluon Hopper forward (mmsparse/kernels/gluon/forward.py): where it runs, what it computes, and the fall-backs.

The kernel itself needs an sm_90 GPU (Gluon has no CPU interpreter); the dispatch and the fall-back after a failed
build are tested everywhere."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
import triton

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention import config, dispatch, forward, plan
from mmsparse.attention.config import KernelConfig, Tile, kernel_config, use_tuning
from mmsparse.attention.dispatch import hopper_gluon_available
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from tests.helpers import CYCLIC, HOPPER_CASES, HUB, check_against_reference, check_outputs, hopper_case_id, make_qkv


@pytest.fixture
def hopper_calls(monkeypatch):
    """Counts the calls that took the Gluon forward. Both forwards give the same result within tolerance, so only
    a spy on the Gluon launcher tells which one ran."""
    from mmsparse.attention import gluon_launch

    calls = []
    real = gluon_launch.run_forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_launch, "run_forward", spy)
    return calls


@pytest.fixture
def gluon_at_every_length(monkeypatch):
    """The Gluon forward at every key length. By default short key ranges take the tl tile (see
    test_few_keys_take_the_tl_tile); SHORT_KEYS is the only switch for that, and these cases are short."""
    with use_tuning(short_keys=0):
        yield


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_CASES, ids=hopper_case_id)
def test_against_float64(case, hopper_calls, gluon_at_every_length):
    """Ragged segments (partial blocks), causal, GQA, per-sample lengths, fewer queries than keys, a segment that
    sees nothing, a zero-length segment, a padded head dim (96 in 128-wide tiles), a sequence shorter than one
    tile; output and all three gradients (the backward reads the Gluon forward's lse)."""
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = max(sum(r) for r in lens) if isinstance(lens, list) else sum(lens)
    # Enough heads for a grid of 2 programs per SM, else the key lists are split (the tl forward's job).
    programs = -(-(seq_q or seq_k) // 128) * batch * heads
    more = -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // programs)
    heads, kv_heads = heads * more, kv_heads * more
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q or seq_k, seq_k, head_dim, dtype, torch.device("cuda"))
    check_against_reference(q, k, v, topo, lens, causal=causal)
    assert len(hopper_calls) == 1


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_with_an_empty_row(causal, hopper_calls, gluon_at_every_length):
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 64, 32, 1500, 1500, 128, torch.bfloat16, dev)
    mask = torch.rand(1500, 1500, device=dev) < 0.3
    mask[5] = False
    out = mbs_attention(q, k, v, None, None, causal=causal, attn_mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want = mask & torch.ones_like(mask).tril() if causal else mask
    check_outputs(q, k, v, out, grad_out, want.cpu())
    assert len(hopper_calls) == 1
    assert not out[:, :, 5].any()


@pytest.mark.hopper
@pytest.mark.gpu
def test_dropout_and_small_grids_run_the_tl_forward_at_the_same_tile(hopper_calls, gluon_at_every_length):
    """Dropout, and a grid too small to fill the GPU (split key lists), are the tl kernel's: it runs the Gluon
    tile (128 x 128, 8 warps, 2 stages) on the same block lists."""
    dev = torch.device("cuda")
    assert kernel_config(128, torch.bfloat16, dev).fwd.gluon
    lens = (300, 1000, 777)
    q, k, v = make_qkv(1, 2, 1, 2077, 2077, 128, torch.bfloat16, dev)
    check_against_reference(q, k, v, CYCLIC, lens)  # 17 x 2 programs: split
    # The same with a dense mask, whose tiles the tl kernel also stages (3 stages would not fit).
    mask = torch.rand(2077, 2077, device=dev) < 0.3
    out = mbs_attention(q, k, v, None, None, causal=True, attn_mask=mask)
    grad_out = torch.randn_like(out)
    for t in (q, k, v):
        t.grad = None
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, (mask & torch.ones_like(mask).tril()).cpu())

    q, k, v = make_qkv(1, 64, 32, 2077, 2077, 128, torch.bfloat16, dev)
    torch.manual_seed(7)
    out = mbs_attention(q, k, v, HUB, lens, dropout_p=0.2)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.manual_seed(7)
    keep = dropout_keep_mask(new_dropout_seed(dev), 1, 64, 2077, 2077, 0.2)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 2077), dropout_keep=keep, dropout_p=0.2)
    assert hopper_calls == []


# (Tile.turns, gluon_stages) of the ping-pong schemes checked on a GPU, beside the forward without ping-pong.
TURN_SCHEMES = [("mbarrier", 3), ("named_release", 3), ("named_release", 2)]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_turn_scheme_gives_the_same_bits(head_dim, hopper_calls, gluon_at_every_length):
    """The ping-pong turn schemes (Tile.turns) only move synchronisation: at 2 and 3 stages each gives the output
    of the forward without ping-pong bit for bit (D=64 included, which runs without ping-pong by default), and
    that output matches the float64 reference (forward and gradients)."""
    dev = torch.device("cuda")
    base = kernel_config(head_dim, torch.bfloat16, dev)
    lens = (1000, 1700, 1300)  # ragged: partial blocks in every segment
    q, k, v = make_qkv(1, 64, 32, 4000, 4000, head_dim, torch.bfloat16, dev)
    outs = {}
    for turns, stages in [("mbarrier", 2), *TURN_SCHEMES]:
        tile = replace(base.fwd, gluon_stages=stages, pingpong=(turns, stages) != ("mbarrier", 2), turns=turns)
        with use_tuning(replace(base, fwd=tile, fwd_short_samples=None)), torch.no_grad():
            outs[turns, stages, tile.pingpong] = mbs_attention(q, k, v, HUB, lens, causal=True)
    assert len(hopper_calls) == len(outs)
    plain = outs["mbarrier", 2, False]
    for scheme, out in outs.items():
        assert torch.equal(out, plain), f"{scheme}: {(out.float() - plain.float()).abs().max()}"
    tile = replace(base.fwd, gluon_stages=3, pingpong=True, turns="named_release")
    with use_tuning(replace(base, fwd=tile, fwd_short_samples=None)):
        check_against_reference(q, k, v, HUB, lens, causal=True)


def test_a_failing_gluon_forward_raises(monkeypatch, device):
    """An error inside the Gluon forward reaches the caller, on every call: no silent fallback to the tl forward."""
    from mmsparse.attention import gluon_launch

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("simulated kernel failure")

    # A kernel failure cannot be had otherwise; a grid this small would split its key lists on a GPU (a tl-only
    # path), so splitting is switched off.
    monkeypatch.setattr(gluon_launch, "run_forward", broken)
    monkeypatch.setattr(plan, "num_splits", lambda *args: 1)
    base = kernel_config(32, torch.float32, device)
    gluon_tile = Tile(config.GLUON_BLOCK, base.fwd.block_n, gluon_stages=2)  # the Gluon forward's 128 rows
    q, k, v = make_qkv(2, 4, 2, 60, 60, 32, torch.float32, device)
    with use_tuning(KernelConfig(fwd=gluon_tile, bwd_dkdv=base.bwd_dkdv, bwd_dq=base.bwd_dq, decode=base.decode)):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="simulated kernel failure"):
                mbs_attention(q, k, v, HUB, (9, 30, 21))
    assert calls == [1, 1]


def test_gluon_availability_is_decided_up_front(monkeypatch):
    """Availability comes from the switch, the architecture, the Triton version and whether the Gluon modules
    import; an import failure on an old Triton is told once and the tl kernels run."""
    # No Hopper or other Triton here: faking the capability, the version and a failing import is the only way
    # through these branches.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    dispatch.gluon_importable.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.5.0")
    assert not dispatch.hopper_gluon_available(0)
    dispatch.gluon_importable.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.6.0")

    import mmsparse.kernels.gluon

    monkeypatch.delattr(mmsparse.kernels.gluon, "forward", raising=False)
    monkeypatch.setitem(sys.modules, "mmsparse.kernels.gluon.forward", None)  # the next import of it fails
    with pytest.warns(RuntimeWarning, match="do not import"):
        assert not dispatch.hopper_gluon_available(0)
    dispatch.gluon_importable.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert not dispatch.hopper_gluon_available(0)
    dispatch.gluon_importable.cache_clear()


@pytest.mark.hopper
@pytest.mark.gpu
def test_few_keys_take_the_tl_tile(hopper_calls):
    """Below SHORT_KEYS keys (the seed: 925) the tl forward runs its own tile, with its own block lists."""
    q, k, v = make_qkv(8, 16, 16, 925, 925, 64, torch.bfloat16, torch.device("cuda"))
    check_against_reference(q, k, v, CYCLIC, (50, 375, 500))
    assert hopper_calls == []
    cfg = kernel_config(64, torch.bfloat16, q.device)
    assert not cfg.forward_tile(925, 925).gluon and cfg.forward_tile(925, config.SHORT_KEYS).gluon


def test_forward_tile_choice():
    short, long, decode = Tile(64, 64), Tile(128, 128, gluon_stages=3), Tile(16, 64)
    cfg = KernelConfig(fwd=long, bwd_dkdv=short, bwd_dq=short, decode=decode, fwd_short=short)
    assert cfg.forward_tile(925, 925) is short
    assert cfg.forward_tile(925, config.SHORT_KEYS) is long
    assert cfg.forward_tile(16, 10**5) is decode
    assert KernelConfig(fwd=long, bwd_dkdv=short, bwd_dq=short, decode=decode).forward_tile(100, 100) is long
    packs = replace(cfg, fwd_short_samples=Tile(128, 64, gluon_stages=3))
    assert packs.forward_tile(65536, 65536, config.SHORT_SAMPLES) is packs.fwd_short_samples
    assert packs.forward_tile(65536, 65536, config.SHORT_SAMPLES + 1) is long
    assert packs.forward_tile(65536, 65536) is long
    assert packs.forward_tile(8, 65536, 100) is decode and cfg.forward_tile(65536, 65536, 100) is long


def test_dq_tile_choice():
    short, long = Tile(64, 64), Tile(128, 64, gluon_stages=3)
    cfg = KernelConfig(fwd=short, bwd_dkdv=short, bwd_dq=long, decode=short, bwd_dq_short=short)
    assert cfg.dq_tile(925) is short and cfg.dq_tile(config.SHORT_KEYS) is long
    assert replace(cfg, bwd_dq_short=None).dq_tile(925) is long


def test_block_lists_follow_the_tiles_by_length():
    """The block lists prepared for a call are the ones its forward and dQ tiles read, short or long."""
    from mmsparse.attention.kernel_args import list_tiles

    fwd, fwd_short, dq, dq_short, dkdv = Tile(128, 128), Tile(64, 32), Tile(128, 64), Tile(64, 64), Tile(64, 128)
    cfg = KernelConfig(
        fwd=fwd, bwd_dkdv=dkdv, bwd_dq=dq, decode=Tile(16, 64), fwd_short=fwd_short, bwd_dq_short=dq_short
    )
    assert list_tiles(cfg, 925, 925) == [(64, 32, False), (64, 128, True), (64, 64, False)]
    assert list_tiles(cfg, 4096, 4096) == [(128, 128, False), (64, 128, True), (128, 64, False)]
    packs = replace(cfg, fwd_short_samples=Tile(128, 64, gluon_stages=3))
    # the forward's tile is the dQ pass's here: their lists are one set, named once
    assert list_tiles(packs, 4096, 4096, 128) == [(128, 64, False), (64, 128, True)]


def test_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MMSPARSE_GLUON", "0")
    assert not hopper_gluon_available(0)
    assert forward._hopper_forward is not None  # the dispatch itself stays importable everywhere
