"""Triton block lists (mmsparse.mask.bit_lists) against the torch reference, row by row, fixed or packed."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import Topology
from mmsparse.mask import info as mask_info
from mmsparse.mask.bit_lists import build_block_lists
from mmsparse.mask.blocks import BlockLists, classify_blocks_from_bits, index_dtype, lists_from_classes
from mmsparse.mask.info import MaskInfo

TILES = [(16, 16), (32, 16), (16, 32), (64, 64), (128, 64)]


def _reference(q_bits, k_bits, k, bm, bn, causal, past, by_key) -> BlockLists:
    live, full = classify_blocks_from_bits(q_bits, k_bits, k, bm, bn, causal, past)
    if by_key:
        live, full = live.transpose(1, 2), full.transpose(1, 2)
    return lists_from_classes(live, full)


def _assert_same(got: BlockLists, want: BlockLists, packed: bool = False) -> None:
    """The same lists row by row, whatever the layout (fixed slots or ``packed``); ``want`` has fixed slots."""
    columns = want.indices.shape[-1] // max(want.counts.shape[1], 1)
    assert got.counts.dtype == torch.int32 and got.indices.dtype == index_dtype(columns, packed)
    assert got.counts.shape == want.counts.shape and got.indices.dim() == 2
    assert got.counts.device == got.indices.device == want.counts.device
    (got_counts, got_ids), (want_counts, want_ids) = got.padded(columns), want.padded(columns)
    diff = (got_counts != want_counts).nonzero()[:5].tolist()
    assert torch.equal(got_counts, want_counts), f"counts differ at {diff}"
    bad = got_ids != want_ids
    assert not bad.any(), f"indices differ at {bad.nonzero()[:5].tolist()}"
    lengths = want_counts.sum(-1).tolist()  # the launch order: each sample's rows longest list first, ties by row
    assert got.counts[..., 3].tolist() == [sorted(range(len(row)), key=lambda r: (-row[r], r)) for row in lengths]


def _check(q_bits, k_bits, k, tile, causal, past, tile_elems=None, fit=None) -> None:
    for by_key in (False, True):
        want = _reference(q_bits, k_bits, k, *tile, causal, past, by_key)
        for compact in (False, True):
            got = build_block_lists(q_bits, k_bits, k, *tile, causal, past, by_key, tile_elems, fit, compact=compact)
            _assert_same(got, want, compact)
            if compact:  # packed end to end: a row starts where the one before it ends
                sizes = got.counts[..., :2].sum(-1)
                assert torch.equal(got.counts[..., 2], sizes.cumsum(1) - sizes)


def _random_info(rng: random.Random, device: torch.device) -> tuple[MaskInfo, int]:
    k = rng.choice([1, 2, 3, 4, 6, 32])
    topo = Topology([[int(rng.random() < 0.5) for _ in range(k)] for _ in range(k)])
    batch = rng.choice([1, 1, 3])
    seq_k = rng.randint(1, 300)
    lens = []
    for _ in range(batch):  # zero-length segments, padding tails, now and then a sample of padding only
        row = [rng.choice([0, 0, 1, rng.randint(1, 60), rng.randint(1, 200)]) for _ in range(k)]
        while sum(row) > seq_k:
            row[rng.randrange(k)] //= 2
        if rng.random() < 0.5 and sum(row) < seq_k:
            row[rng.randrange(k)] += seq_k - sum(row)
        lens.append(row if rng.random() > 0.1 else [0] * k)
    seq_q = rng.choice([seq_k, 1, rng.randint(1, seq_k)])
    q_start = None
    if rng.random() < 0.4:  # per-sample first query, possibly before 0 or running past the end
        q_start = torch.tensor([rng.randint(-3, seq_k + 3) for _ in range(batch)], device=device)
        if batch > 1 and rng.random() < 0.5:
            lens = lens[:1]  # one set of lengths for the batch: the key bits are a stride-0 expansion
    info = MaskInfo.from_topology(topo, torch.tensor(lens, device=device), seq_q, seq_k, rng.random() < 0.5, q_start)
    return info, k


@pytest.mark.parametrize("seed", range(32))
def test_random_topologies_match_reference(seed, device):
    rng = random.Random(seed)
    info, k = _random_info(rng, device)
    tile = rng.choice(TILES)
    # Small tiles cover several chunks and row groups per sample; fit=False the fixed sizes used on a GPU.
    tile_elems, fit = rng.choice([(None, None), (None, None), (16, None), (256, None), (4096, False)])
    _check(info.q_bits, info.k_bits, k, tile, info.causal, info.q_start, tile_elems, fit)


@pytest.mark.parametrize("seed", range(8))
def test_arbitrary_bits_match_reference(seed, device):
    """Any int32 patterns (bit 31, bits above k that must be ignored, multi-bit keys, zeros), any past."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bm, seq_q, seq_k = rng.choice([1, 2]), rng.randint(1, 200), rng.randint(1, 200)
    k = rng.choice([1, 5, 31, 32])
    q_bits = torch.randint(-(2**31), 2**31, (bm, seq_q), generator=gen, dtype=torch.int64).to(torch.int32)
    q_bits &= torch.randint(0, 2, (bm, seq_q), generator=gen, dtype=torch.int32) * -1  # some rows see nothing
    k_bits = torch.ones(bm, seq_k, dtype=torch.int32) << torch.randint(0, 32, (bm, seq_k), generator=gen)
    k_bits[torch.rand(bm, seq_k, generator=gen) < 0.2] = 0
    k_bits[torch.rand(bm, seq_k, generator=gen) < 0.1] |= 3
    past = torch.randint(-5, seq_k + 5, (rng.choice([1, bm]),), generator=gen, dtype=torch.int32)
    q_bits, k_bits, past = q_bits.to(device), k_bits.to(device), past.to(device)
    for causal in (False, True):
        _check(q_bits, k_bits, k, rng.choice(TILES), causal, past, rng.choice([None, 64]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q", [1, 5])
def test_decode_rows_over_a_long_cache(causal, seq_q, device):
    topo = Topology([[1, 0, 1], [1, 1, 0], [1, 1, 1]])
    lens = torch.tensor([[40, 300, 37], [0, 5, 90], [200, 0, 0]], device=device)
    seq_k = 400
    for q_start in (None, torch.tensor([377 - seq_q, 95 - seq_q, 398], device=device)):  # the last runs past the end
        info = MaskInfo.from_topology(topo, lens, seq_q, seq_k, causal, q_start=q_start)
        for tile in [(16, 32), (64, 64)]:
            _check(info.q_bits, info.k_bits, 3, tile, causal, info.q_start)


def test_causal_diagonal_boundaries(device):
    """A tile is full exactly when its last column is the position of its first row (and partial one before)."""
    past = torch.tensor([0, 1, 14, 15, 16, 17, 30, 31, 47, 50], dtype=torch.int32, device=device)
    q_bits = torch.ones(10, 70, dtype=torch.int32, device=device)
    k_bits = torch.ones(1, 120, dtype=torch.int32, device=device).expand(10, -1)
    for tile in [(32, 16), (16, 32)]:
        _check(q_bits, k_bits, 1, tile, True, past)


def test_key_bits_from_k_up_are_padding(device):
    """A key whose only bits are >= k is no real token: its tiles are neither live nor full."""
    q_bits = torch.full((1, 40), -1, dtype=torch.int32, device=device)
    k_bits = torch.tensor([[1] * 16 + [16] * 16 + [-(2**31)] * 8], dtype=torch.int32, device=device)  # bits 0, 4, 31
    past = torch.zeros(1, dtype=torch.int32, device=device)
    for causal in (False, True):
        _check(q_bits, k_bits, 3, (16, 16), causal, past)
        lists = build_block_lists(q_bits, k_bits, 3, 16, 16, causal, past)
        assert lists.counts[0, :, 0].tolist() == [int(not causal), 1, 1] and lists.counts[0, :, 1].sum() == causal


def test_strided_and_expanded_bits(device):
    """q_bits a column slice of a wider tensor (row stride != Sq), k_bits a stride-0 expansion, past shared."""
    info = MaskInfo.from_topology(Topology([[1, 1], [0, 1]]), torch.tensor([[70, 60]], device=device), 130, 130, True)
    wide = torch.zeros(4, 200, dtype=torch.int32, device=device)
    wide[:, 20:150] = info.q_bits
    wide[1, 20:60] = 2  # make the samples differ
    q_bits, k_bits = wide[:, 20:150], info.k_bits.expand(4, -1)
    assert q_bits.stride(0) == 200 and k_bits.stride(0) == 0
    _check(q_bits, k_bits, 2, (16, 16), True, info.q_start, 256)
    _check(q_bits, k_bits, 2, (32, 16), False, info.q_start)


def test_all_padding_and_tiny_inputs(device):
    topo = Topology([[1]])
    info = MaskInfo.from_topology(topo, torch.tensor([[0], [17]], device=device), 17, 17, True)
    lists = build_block_lists(info.q_bits, info.k_bits, 1, 16, 16, True, info.q_start)
    assert lists.counts[0, :, :2].sum() == 0  # the all-padding sample has no tile
    assert lists.counts[1, :, :2].tolist() == [[0, 1], [1, 1]]  # causal diagonal partial; key block 1 runs past Sk
    assert lists.padded(2)[1][1].tolist() == [[0, -1], [0, 1]]
    _check(info.q_bits, info.k_bits, 1, (16, 16), True, info.q_start)
    _check(info.q_bits, info.k_bits, 1, (128, 64), False, info.q_start)


def test_mask_info_lists_come_from_the_kernels(device, monkeypatch):
    """MaskInfo.lists builds through the kernels and agrees with the lists of MaskInfo.classes (torch)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3:5])
        return build_block_lists(*args, **kwargs)

    # The kernels' lists equal the torch ones (the assertion below), so only a spy tells which build ran, and once.
    monkeypatch.setattr(mask_info, "build_block_lists", counted)
    lens = torch.tensor([[30, 100, 0, 70], [5, 5, 5, 5]], device=device)
    topo = Topology([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 1]])
    info = MaskInfo.from_topology(topo, lens, 150, 200, True)
    for tile in TILES:
        live, full = info.classes(*tile)
        for by_key in (False, True):
            got = info.lists(*tile, by_key)
            assert calls[-1] == tile
            if by_key:
                live, full = live.transpose(1, 2), full.transpose(1, 2)
            _assert_same(got, lists_from_classes(live, full))
    assert len(calls) == 2 * len(TILES)


@pytest.mark.gpu
def test_packed_lists_refuse_cuda_graph_capture():
    """Packed lists read their length back to the host, which a CUDA graph cannot replay: a clear error during
    capture, and fixed-slot lists of the same mask still capture."""
    info = MaskInfo.from_topology(Topology([[1, 0], [1, 1]]), torch.tensor([[300, 200]], device="cuda"), 500, 500,
                                  True)
    args = (info.q_bits, info.k_bits, 2, 64, 64, True, info.q_start)
    build_block_lists(*args, compact=False)  # compile outside the capture
    build_block_lists(*args, compact=True)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="before capturing the CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            build_block_lists(*args, compact=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_block_lists(*args, compact=False)
    graph.replay()
    _assert_same(build_block_lists(*args, compact=True), captured, packed=True)
