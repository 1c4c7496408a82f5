"""The ordered one-pass backward (``KernelConfig.deterministic_backward = "ordered_one_pass"``): the one-pass dK/dV
kernel adds into each dQ tile in the order of the key blocks, counted by a semaphore per tile. Output and all
three gradients against the float64 reference, every semaphore counts its tile's key blocks once the call ends,
two calls give the same bits, the plan and the list preparation, and bad settings are ValueErrors."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mmsparse import (
    CAUSAL,
    FULL,
    NONE,
    mbs_attention,
    mbs_attention_varlen,
    reference_mask,
    reference_packed_mask,
    use_config,
)
from mmsparse.attention import backward
from mmsparse.attention.config import KernelConfig, Tile, cuda_kernel_config, kernel_config
from mmsparse.attention.kernel_args import list_tiles, prepare
from mmsparse.attention.plan import plan_attention
from mmsparse.functional import build_mask_info
from mmsparse.mask.blocks import cdiv
from mmsparse.mask.info import MaskInfo
from tests.helpers import CYCLIC, HUB, RING, check_outputs, forward_backward, make_qkv

ORDERED = "ordered_one_pass"
PAIR_TYPES = [[CAUSAL, FULL, NONE], [FULL, CAUSAL, NONE], [CAUSAL, NONE, FULL]]

# name: (topology, seg_lens (or per-sample rows), causal, batch, heads, kv_heads, seq_q, head_dim, dtype, extra)
CASES = {
    "gqa-causal-D24": (HUB, (9, 21, 20), True, 1, 4, 2, None, 24, torch.float32, {}),
    "mqa-D40-fp16": (CYCLIC, (13, 30, 22), False, 2, 3, 1, None, 40, torch.float16, {}),
    "window-bf16": (RING, (17, 25, 19), True, 1, 2, 1, None, 16, torch.bfloat16, {"window": 9}),
    "pair-types-window": (PAIR_TYPES, (20, 15, 26), True, 1, 4, 2, None, 24, torch.float16, {"window": 12}),
    "per-sample-lens": (HUB, [(10, 20, 5), (30, 0, 12)], True, 2, 2, 1, None, 16, torch.float32, {}),
    "fewer-queries": (HUB, (20, 25, 26), True, 2, 2, 2, 37, 16, torch.bfloat16, {}),
    "q-start": ([[CAUSAL, FULL], [NONE, CAUSAL]], [(10, 20), (33, 0)], False, 2, 2, 1, 7, 16, torch.float32,
                {"q_start": [5, 20]}),
}


def _case_id(name: str) -> str:
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, extra = CASES[name]
    seq = sum(lens) if isinstance(lens[0], int) else max(map(sum, lens))
    window = f"-window{extra['window']}" if "window" in extra else ""
    return (f"{name}-B{batch}-H{heads}x{kv_heads}-Sq{seq_q or seq}-S{seq}-D{head_dim}-{str(dtype)[6:]}"
            f"{'-causal' if causal else ''}{window}")


class _Accumulators:
    """Wraps the backward's dQ accumulator allocation and the mask's add ranks: keeps each call's semaphores and
    the by-key lists its ranks came from, to read after the call."""

    def __init__(self, allocate, ranks) -> None:
        self.allocate, self.ranks, self.semaphores, self.lists = allocate, ranks, [], []

    def __call__(self, shape, device, semaphores):
        dq_sum, dq_sem = self.allocate(shape, device, semaphores)
        self.semaphores.append(dq_sem)
        return dq_sum, dq_sem

    def add_ranks(self, info, block_m, block_n):
        self.lists.append((info.built_lists(block_m, block_n, True), cdiv(info.seq_q, block_m)))
        return self.ranks(info, block_m, block_n)


@pytest.fixture
def accumulators(monkeypatch):
    spy = _Accumulators(backward._dq_accumulator, MaskInfo.dq_add_ranks)
    monkeypatch.setattr(backward, "_dq_accumulator", spy)
    monkeypatch.setattr(MaskInfo, "dq_add_ranks", lambda info, bm, bn: spy.add_ranks(info, bm, bn))
    return spy


def _listed_counts(lists, n_cols: int, batch: int, heads: int) -> torch.Tensor:
    """int32 ``[B, Hq, query blocks]``: how many key blocks' lists hold each query block."""
    counts, ids = lists.padded(n_cols)
    held = torch.stack([(ids == c).sum((1, 2)) for c in range(n_cols)], -1).to(torch.int32).cpu()  # [Bm, NQ]
    return held[:, None, :].expand(batch, heads, n_cols)


def _live_counts(mask: torch.Tensor, batch: int, heads: int, block_m: int, block_n: int) -> torch.Tensor:
    """int32 ``[B, Hq, query blocks]``: the key blocks with an allowed pair in each query block (from the dense
    reference mask: the tiles the float64 reference says are live)."""
    mask = mask.expand(batch, *mask.shape[-2:]) if mask.dim() == 3 else mask.expand(batch, *mask.shape)
    seq_q, seq_k = mask.shape[-2:]
    n_q, n_k = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    padded = torch.zeros(batch, n_q * block_m, n_k * block_n, dtype=torch.bool)
    padded[:, :seq_q, :seq_k] = mask.cpu()
    live = padded.view(batch, n_q, block_m, n_k, block_n).any(4).any(2)  # [B, NQ, NK]
    return live.sum(-1).to(torch.int32)[:, None, :].expand(batch, heads, n_q)


@pytest.mark.parametrize("name", list(CASES), ids=_case_id)
def test_ordered_one_pass_matches_reference(name, device, accumulators):
    """Fresh inputs, the mask built inside the call; out, dq, dk, dv against float64; every semaphore ends at the
    number of key blocks whose lists hold its tile (each waited for its turn and passed it on), which without a
    window is the number of live tiles of the reference mask (a window's edge may list a tile with no pair)."""
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, extra = CASES[name]
    seq = sum(lens) if isinstance(lens[0], int) else max(map(sum, lens))
    seq_q = seq if seq_q is None else seq_q
    gen = torch.Generator().manual_seed(len(name) + 100)
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q, seq, head_dim, dtype, device, gen)
    with use_config(deterministic_backward=ORDERED):
        out = mbs_attention(q, k, v, topo, lens, causal=causal, **extra)
        grad_out = torch.randn(out.shape, generator=gen).to(device, dtype)
        out.backward(grad_out)
    mask = reference_mask(topo, lens, seq, seq_q, causal, extra.get("q_start"), window=extra.get("window"))
    check_outputs(q, k, v, out, grad_out, mask)
    tile = kernel_config(head_dim, dtype, device).one_pass_kernel_tile(ordered=True)
    (sem,), ((lists, n_cols),) = accumulators.semaphores, accumulators.lists
    want = _listed_counts(lists, n_cols, batch, heads)
    per_tile = sem.numel() // want.numel()  # the Gluon kernel (Hopper): one per warpgroup's column half
    got = sem.cpu().view(*want.shape, per_tile)
    assert torch.equal(got, want[..., None].expand_as(got)), f"semaphores {got} vs {want}"
    if "window" not in extra:
        assert torch.equal(want, _live_counts(mask, batch, heads, tile.block_m, tile.block_n))


@pytest.mark.parametrize("kind", ["bits", "dense"])
def test_ordered_one_pass_dense_and_bit_masks(kind, device):
    gen = torch.Generator().manual_seed(31)
    q, k, v = make_qkv(2, 2, 1, 45, 45, 24, torch.float32, device, gen)
    with use_config(deterministic_backward=ORDERED):
        if kind == "dense":
            mask = torch.rand(2, 45, 45, generator=gen) < 0.4
            out = mbs_attention(q, k, v, attn_mask=mask.to(device))
        else:
            mask = reference_mask(CYCLIC, (8, 20, 17), 45)
            out = mbs_attention(q, k, v, CYCLIC, (8, 20, 17))
        grad_out = torch.randn(out.shape, generator=gen).to(device)
        out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)


def test_ordered_one_pass_pack(device):
    """A pack of samples (packed varlen lists, per-sample key blocks)."""
    rng = random.Random(17)
    topo = [[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]]
    lens = [[rng.randint(1, 9), rng.choice((0, 4, 9)), rng.choice((0, 3))] for _ in range(8)]
    total = sum(map(sum, lens))
    q, k, v = make_qkv(1, 4, 2, total, total, 16, torch.float16, device, torch.Generator().manual_seed(18))
    with use_config(deterministic_backward=ORDERED):
        out = mbs_attention_varlen(q, k, v, topo, lens, causal=True)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(topo, lens, causal=True))


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
    assert KernelConfig.deterministic_backward == "two_pass"  # the default until timed faster on a GPU
