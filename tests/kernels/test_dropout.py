"""Dropout: eval is exact, training is seeded by torch's generator, and the backward uses the forward's mask."""

from __future__ import annotations

import torch

from mmsparse import TritonMBSAttnKernel, mbs_attention, reference_mask
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from tests.helpers import CYCLIC, check_outputs, make_qkv

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


def test_dropout_bits_are_keyed_by_absolute_position(device):
    """The last Sq queries of a call draw the bits of the same positions in the full call (sharded or offset
    calls draw the same mask), and a per-sample q_start moves them with it."""
    seed = new_dropout_seed(device)
    full = dropout_keep_mask(seed, 2, 3, 70, 70, 0.5)
    assert torch.equal(dropout_keep_mask(seed, 2, 3, 20, 70, 0.5), full[:, :, 50:])
    shifted = dropout_keep_mask(seed, 2, 3, 20, 70, 0.5, q_start=[10, 31])
    assert torch.equal(shifted[0], full[0, :, 10:30]) and torch.equal(shifted[1], full[1, :, 31:51])


def test_dropout_seed_uses_all_64_bits(device):
    torch.manual_seed(0)
    seeds = torch.stack([new_dropout_seed(device)[0] for _ in range(64)]).cpu()
    assert (seeds >> 32).unique().numel() > 32, "seeds must vary in their high 32 bits"
    low = torch.tensor([12345], dtype=torch.int64, device=device)
    high = low + (1 << 40)  # same low 32 bits: Philox must see the high word
    assert not torch.equal(dropout_keep_mask(low, 1, 1, 40, 40, 0.5), dropout_keep_mask(high, 1, 1, 40, 40, 0.5))


def test_seed_offsets_move_the_bits_to_global_positions(device):
    """The seed's query and key offsets: a call over rows 30.. and keys 20.. of a longer sequence draws that
    window of the whole sequence's bits (what a context-parallel piece needs)."""
    torch.manual_seed(1)
    seed = new_dropout_seed(device)
    assert seed.shape == (3,) and seed[1:].tolist() == [0, 0]
    full = dropout_keep_mask(seed, 2, 3, 80, 80, 0.5)
    window = seed.clone()
    window[1:] = torch.tensor([30, 20])
    part = dropout_keep_mask(window, 2, 3, 10, 15, 0.5, q_start=[0, 0])
    assert torch.equal(part, full[:, :, 30:40, 20:35])
    assert not torch.equal(part, full[:, :, :10, :15])


def test_dropout_with_q_start_matches_reference(device):
    p = 0.25
    lens = [(9, 30, 21), (5, 20, 10)]
    q_start = [44, 19]
    q, k, v = make_qkv(2, 4, 2, 16, 60, 32, torch.float32, device)
    torch.manual_seed(7)
    out = mbs_attention(q, k, v, CYCLIC, lens, dropout_p=p, q_start=q_start)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.manual_seed(7)
    keep = dropout_keep_mask(new_dropout_seed(q.device), 2, 4, 16, 60, p, q_start=q_start)
    mask = reference_mask(CYCLIC, lens, 60, 16, q_start=q_start)
    check_outputs(q, k, v, out, grad_out, mask, dropout_keep=keep, dropout_p=p)


def test_dropout_runs_the_backward_passes_at_their_own_tiles(device, monkeypatch):
    """A config's ``bwd_dkdv_dropout`` and ``bwd_dq_dropout`` are the tiles the dK/dV and dQ passes run with
    dropout (the D=256 table keeps the tl tiles there): the call plans them, builds their lists, and matches the
    float64 reference with the same keep mask."""
    import inspect
    from dataclasses import replace

    from mmsparse.attention import backward
    from mmsparse.attention.config import Tile, kernel_config, use_tuning

    p = 0.3
    base = kernel_config(32, torch.float32, device)
    own = Tile(16, 32, num_warps=4, num_stages=1)
    own_dq = Tile(16, 16, num_warps=4, num_stages=1)
    assert own != base.bwd_dkdv and own_dq != base.bwd_dq
    tiles = []
    real = backward.BackwardLaunch.__init__
    signature = inspect.signature(real)

    def spy(*args, **kwargs):
        plan = signature.bind(*args, **kwargs).arguments["plan"]
        tiles.append((plan.dq.tile, plan.dkdv.tile))
        real(*args, **kwargs)

    monkeypatch.setattr(backward.BackwardLaunch, "__init__", spy)
    q, k, v = make_qkv(2, 4, 2, 60, 60, 32, torch.float32, device)
    torch.manual_seed(99)
    with use_tuning(replace(base, bwd_dkdv_dropout=own, bwd_dq_dropout=own_dq)):
        out = mbs_attention(q, k, v, CYCLIC, LENS, causal=True, dropout_p=p)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert tiles == [(own_dq, own)]
    torch.manual_seed(99)
    keep = dropout_keep_mask(new_dropout_seed(q.device), 2, 4, 60, 60, p)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, LENS, 60, causal=True), dropout_keep=keep,
                  dropout_p=p)
