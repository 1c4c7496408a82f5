"""Pair types 0/1/2, many segments and packed samples: the segment-code mask, its block lists, and attention
forward and backward against the float64 dense reference."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import mmsparse
from mmsparse import CAUSAL, FULL, NONE, mbs_attention, mbs_attention_varlen
from mmsparse.mask import bit_lists
from mmsparse.mask.blocks import classify_blocks_from_mask, lists_from_classes
from mmsparse.mask.info import MaskInfo
from mmsparse.mask.topology import Topology, generate_interlaced_mask
from mmsparse.reference import reference_mask, reference_packed_mask
from tests.helpers import check_outputs, make_qkv


def random_types(rng: random.Random, k: int) -> list[list[int]]:
    return [[rng.choice((NONE, FULL, CAUSAL, FULL)) for _ in range(k)] for _ in range(k)]


def transfusion(rng: random.Random, images: int, image_len: int, text_max: int) -> tuple[list[list[int]], list[int]]:
    """Text causal over everything before it; each image full within itself and sees everything before it."""
    k = 2 * images + 1  # text, image, text, ..., image, text
    topo = [[NONE] * k for _ in range(k)]
    for r in range(k):
        for c in range(r):
            topo[r][c] = FULL
        topo[r][r] = CAUSAL if r % 2 == 0 else FULL
    lens = [rng.randint(0, text_max) if s % 2 == 0 else image_len for s in range(k)]
    return topo, lens


def assert_lists_exact(info: MaskInfo, dense: torch.Tensor, block_m: int, block_n: int,
                       compact_bytes: int = bit_lists.COMPACT_BYTES) -> None:
    """The lists the kernels read equal those of the dense mask's tile classes, row by row."""
    for by_key in (False, True):
        live, full = classify_blocks_from_mask(dense, block_m, block_n, False, info.q_start)
        if by_key:
            live, full = live.transpose(1, 2), full.transpose(1, 2)
        columns = live.shape[2]
        want_counts, want_ids = lists_from_classes(live, full).padded(columns)
        got = info.lists(block_m, block_n, by_key, compact_bytes).padded(columns)
        got_counts, got_ids = (t.cpu().expand_as(w) for t, w in zip(got, (want_counts, want_ids)))
        assert torch.equal(got_counts, want_counts), f"counts differ at tile {block_m}x{block_n} by_key={by_key}"
        wrong = got_ids != want_ids
        assert not wrong.any(), f"list entries differ at {wrong.nonzero()[:5].tolist()} (by_key={by_key})"


@pytest.mark.parametrize("seed", range(6))
def test_block_lists_match_dense_classes(seed):
    """Random 0/1/2 topologies, ragged and zero lengths, per-sample rows, q_start, causal, packs: exact lists,
    fixed-slot for even seeds and packed (CSR) for odd ones."""
    compact_bytes = 0 if seed % 2 else bit_lists.COMPACT_BYTES
    rng = random.Random(seed)
    k = rng.randint(1, 7)
    topo = Topology(random_types(rng, k))
    causal = rng.random() < 0.3
    if seed % 3 == 0:  # a pack
        lens = torch.tensor([[rng.choice((0, 1, 3, 9, 17)) for _ in range(k)] for _ in range(rng.randint(1, 9))])
        seq = int(lens.sum())
        if seq == 0:
            return
        info = MaskInfo.from_segments(topo, lens, seq, seq, causal, packed=True)
        dense = reference_packed_mask(topo, lens, causal)
    else:
        batch = rng.randint(1, 3)
        lens = torch.tensor([[rng.choice((0, 1, 5, 13, 30)) for _ in range(k)] for _ in range(batch)])
        seq = max(int(lens.sum(-1).max()), 1) + rng.choice((0, 3))
        seq_q = rng.choice((seq, max(1, seq // 3)))
        q_start = None
        if seed % 3 == 2:
            q_start = torch.tensor([rng.randint(0, seq - seq_q) for _ in range(batch)])
        info = MaskInfo.from_segments(topo, lens, seq_q, seq, causal, q_start=q_start)
        dense = reference_mask(topo, lens, seq, seq_q, causal, None if q_start is None else q_start.tolist())
    assert torch.equal(info.code_mask().cpu(), dense.expand(info.batch, -1, -1))
    for block_m, block_n in ((16, 16), (16, 32), (32, 16)):
        assert_lists_exact(info, dense, block_m, block_n, compact_bytes)


def test_interlaced_mask_of_types():
    """The dense picture of a 0/1/2 topology, by hand: CAUSAL sees the segment's keys at or before the query."""
    mask = generate_interlaced_mask([[CAUSAL, NONE], [FULL, CAUSAL]], [3, 2])
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_topology_entries_checked():
    with pytest.raises(ValueError, match="0 \\(none\\), 1 \\(full\\) or 2 \\(causal\\)"):
        Topology([[1, 3], [0, 1]])
    with pytest.raises(ValueError, match="at most 4095"):
        Topology(torch.ones(4096, 4096, dtype=torch.int8))
    assert Topology([[1, 0], [1, 1]]).uses_bits and not Topology([[2, 0], [1, 1]]).uses_bits


@pytest.mark.parametrize("case", ["random", "transfusion5", "transfusion41", "causal_gqa", "per_sample_q_start"])
def test_attention_matches_reference(device, case):
    rng = random.Random(case)
    torch.manual_seed(len(case))
    causal, q_start, seq_q, heads = False, None, None, (2, 2)
    if case == "random":
        k = 5
        topo = random_types(rng, k)
        lens = [rng.randint(0, 30) for _ in range(k)]
    elif case == "transfusion5":
        topo, lens = transfusion(rng, 2, 24, 20)
    elif case == "transfusion41":
        topo, lens = transfusion(rng, 20, 3, 4)
    elif case == "causal_gqa":
        topo, lens = [[CAUSAL, NONE, FULL], [FULL, FULL, CAUSAL], [NONE, CAUSAL, CAUSAL]], [21, 0, 40]
        causal, heads = True, (4, 2)
    else:
        topo = [[CAUSAL, FULL], [NONE, CAUSAL]]
        lens = [[10, 20], [33, 0]]
        seq_q, q_start = 7, [5, 20]
    seq = sum(lens) if isinstance(lens[0], int) else max(map(sum, lens))
    seq_q = seq if seq_q is None else seq_q
    batch = 1 if isinstance(lens[0], int) else len(lens)
    q, k, v = make_qkv(batch, heads[0], heads[1], seq_q, seq, 16, torch.float32, device)
    out = mbs_attention(q, k, v, topo, lens, causal=causal, q_start=q_start)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    mask = reference_mask(topo, lens, seq, seq_q, causal, q_start)
    check_outputs(q, k, v, out, grad_out, mask)


@pytest.mark.parametrize("samples", [1, 40])
def test_packed_matches_reference(device, samples):
    """Packs with zero-length segments; samples never see each other; flash-attn's [total, H, D] layout."""
    rng = random.Random(samples)
    topo = [[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]]
    lens = [[rng.randint(1, 6), rng.choice((0, 4, 9)), rng.choice((0, 0, 3))] for _ in range(samples)]
    total = sum(map(sum, lens))
    q, k, v = make_qkv(1, 2, 1, total, total, 16, torch.float32, device)
    out = mbs_attention_varlen(q, k, v, topo, lens)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(topo, lens))

    flat = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]  # [total, H, D]
    out2 = mbs_attention_varlen(*flat, topo, torch.tensor(lens, device=device))
    assert out2.shape == (total, 2, 16)
    torch.testing.assert_close(out2, out.detach()[0].transpose(0, 1), rtol=0, atol=0)


def test_packed_lengths_checked(device):
    q, k, v = make_qkv(1, 1, 1, 10, 10, 16, torch.float32, device)
    with pytest.raises(ValueError, match="sum to 9 but q/k/v have 10"):
        mbs_attention_varlen(q, k, v, [[1]], [[4], [5]])
    with pytest.raises(ValueError, match="negative"):
        mbs_attention_varlen(q, k, v, [[1]], torch.tensor([[12], [-2]]))
    with pytest.raises(ValueError, match=r"\[samples, 1\]"):
        mbs_attention_varlen(q, k, v, [[1]], torch.tensor([10]))


def test_fully_masked_rows_are_zero(device):
    """A segment that sees nothing (a zero row of the topology): output 0 and gradients 0 there."""
    topo = [[CAUSAL, NONE], [NONE, NONE]]
    q, k, v = make_qkv(1, 1, 1, 40, 40, 16, torch.float32, device)
    out = mbs_attention(q, k, v, topo, [25, 15])
    out.backward(torch.ones_like(out))
    assert out[:, :, 25:].abs().max() == 0
    assert q.grad[:, :, 25:].abs().max() == 0 and k.grad[:, :, 25:].abs().max() == 0
    assert v.grad[:, :, 25:].abs().max() == 0


def test_constants_exported():
    assert (mmsparse.NONE, mmsparse.FULL, mmsparse.CAUSAL) == (0, 1, 2)


def test_513_segment_document(device):
    """A Transfusion-style document of 256 images and 257 text runs: 513 segments, no S x S anywhere but the
    reference."""
    rng = random.Random(513)
    topo, lens = transfusion(rng, 256, 2, 2)
    assert len(topo) == 513
    seq = sum(lens)
    q, k, v = make_qkv(1, 1, 1, seq, seq, 16, torch.float32, device)
    out = mbs_attention(q, k, v, topo, lens)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, seq))


@pytest.mark.parametrize("samples", [300, pytest.param(2000, marks=pytest.mark.gpu)])
def test_pack_block_lists(device, samples):
    """Hundreds or thousands of samples with zero-length segments: the lists of the pack equal the dense mask's
    tile classes. (Tiny segments make many runs per tile: the interpreter takes minutes at 2,000.)"""
    rng = random.Random(samples)
    lens = torch.tensor([[rng.randint(0, 3), rng.choice((0, 2, 5)), rng.choice((0, 1))] for _ in range(samples)])
    topo = Topology([[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, NONE, FULL]])
    seq = int(lens.sum())
    info = MaskInfo.from_segments(topo, lens.to(device), seq, seq, False, packed=True)
    dense = reference_packed_mask(topo, lens)
    assert torch.equal(info.code_mask().cpu(), dense)
    assert_lists_exact(info, dense, 32, 32)


GPU_CASES = {
    # name: (topology, lens, packed, causal, heads, kv_heads, dtype)
    "transfusion41": (*transfusion(random.Random(1), 20, 100, 60), False, False, 4, 2, torch.bfloat16),
    "transfusion513": (*transfusion(random.Random(2), 256, 8, 8), False, False, 2, 1, torch.bfloat16),
    "pack300": ([[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]],
                [[random.Random(n).randint(1, 30), random.Random(-n).choice((0, 17, 60)), n % 3 * 7]
                 for n in range(300)], True, False, 4, 1, torch.bfloat16),
    "pack2000": ([[FULL, NONE], [CAUSAL, FULL]], [[1 + n % 5, (n * 7) % 4] for n in range(2000)], True, True, 2, 2,
                 torch.float16),
    "random_types_causal": ([[CAUSAL, FULL, NONE, FULL], [NONE, CAUSAL, FULL, FULL], [FULL, CAUSAL, NONE, NONE],
                             [CAUSAL, NONE, FULL, CAUSAL]], [700, 1, 1300, 333], False, True, 4, 4, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_sizes_match_reference(name):
    """GPU-sized typed masks and packs at D=128 (the Gluon kernels on Hopper, the tl ones elsewhere)."""
    topo, lens, packed, causal, heads, kv_heads, dtype = GPU_CASES[name]
    seq = sum(map(sum, lens)) if packed else sum(lens)
    q, k, v = make_qkv(1, heads, kv_heads, seq, seq, 128, dtype, torch.device("cuda"))
    if packed:
        out = mbs_attention_varlen(q, k, v, topo, torch.tensor(lens, device="cuda"), causal=causal)
        mask = reference_packed_mask(topo, lens, causal)
    else:
        out = mbs_attention(q, k, v, topo, lens, causal=causal)
        mask = reference_mask(topo, lens, seq, causal=causal)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)


def test_packs_tell_the_forward_their_sample_length(device):
    """A pack's mask carries its mean sample length (what picks the forward's tile); other masks carry none."""
    topo = Topology([[1, 2], [0, 1]])
    lens = torch.tensor([[3, 5], [0, 9], [4, 4]], device=device)
    assert MaskInfo.from_segments(topo, lens, 25, 25, False, packed=True).sample_len == 25 // 3
    assert MaskInfo.from_segments(topo, lens[:1], 8, 8, False).sample_len is None


def test_compiled_ops_keep_the_pack_tile(device):
    """A traced call's frozen plan picks the tile of a pack of short samples as eager's plan does, and crosses the
    custom ops by value: its text makes an equal plan, and the mask's kernel tensors make a mask of the same kind
    (a new pack's length then changes no graph argument: the plan holds the tile, not the length)."""
    from mmsparse.attention.config import SHORT_SAMPLES, kernel_config
    from mmsparse.attention.plan import call_plan_from_text, plan_attention, plan_call
    from mmsparse.mask.info import mask_from_kernel_tensors
    from mmsparse.tuning import Tile

    topo = Topology([[1, 2], [0, 1]])
    config = replace(kernel_config(16, torch.float32, device), fwd_short_samples=Tile(16, 16))
    for lens, short in (([[3, 5], [0, 9], [4, 4]], True), ([[SHORT_SAMPLES, 1]], False)):
        lens = torch.tensor(lens, device=device)
        total = int(lens.sum())
        info = MaskInfo.from_segments(topo, lens, total, total, True, packed=True)
        plan = plan_call(config, total, total, device, info.sample_len, False, True, info.mode, info.causal,
                         info.window, info.num_segments)
        eager = plan_attention(config, 1, 1, 1, total, total, device, info.sample_len)
        assert plan.forward == eager.forward.tile == (config.fwd_short_samples if short else config.fwd)
        assert call_plan_from_text(plan.text) == plan
        again = mask_from_kernel_tensors(info.kernel_tensors(), plan.mode, plan.causal, plan.num_segments,
                                         plan.window)
        assert type(again) is type(info) and (again.seq_q, again.seq_k) == (total, total)
        assert torch.equal(again.q_codes, info.q_codes) and again.causal and again.num_segments == 2
