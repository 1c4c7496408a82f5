"""Block lists from segment bits against the pure-torch reduction of the dense mask."""

from __future__ import annotations

import random
import time

import pytest
import torch

from mmsparse import Topology, generate_interlaced_mask, reference_mask
from mmsparse.kernels.constants import COUNT_WORDS
from mmsparse.mask.blocks import classify_blocks_from_mask, lists_from_classes
from mmsparse.mask.info import MaskInfo
from tests.helpers import CYCLIC, RING


def _case(seed: int):
    rng = random.Random(seed)
    k = rng.randint(1, 6)
    topo = [[int(rng.random() < 0.5) for _ in range(k)] for _ in range(k)]
    lens = [rng.choice([0, 1, rng.randint(1, 40), rng.randint(40, 130)]) for _ in range(k)]
    seq_k = max(sum(lens), 1)
    lens[-1] += seq_k - sum(lens)
    seq_q = seq_k if rng.random() < 0.5 else rng.randint(1, seq_k)
    tile = rng.choice([(16, 16), (32, 16), (16, 32), (64, 128), (128, 64)])
    return topo, lens, seq_q, seq_k, rng.random() < 0.5, tile


@pytest.mark.parametrize("seed", range(60))
def test_bits_match_dense_reduction(seed):
    topo, lens, seq_q, seq_k, causal, (bm, bn) = _case(seed)
    info = MaskInfo.from_topology(Topology(topo), torch.tensor([lens]), seq_q, seq_k, causal)
    live, full = info.classes(bm, bn)
    dense = reference_mask(topo, lens, seq_k, seq_q)  # causal is applied by the reduction
    live_ref, full_ref = classify_blocks_from_mask(dense, bm, bn, causal, seq_k - seq_q)
    assert torch.equal(live, live_ref), f"live differs at {(live != live_ref).nonzero()[:5].tolist()}"
    assert torch.equal(full, full_ref), f"full differs at {(full != full_ref).nonzero()[:5].tolist()}"


def test_per_sample_padding_blocks():
    lens = torch.tensor([[10, 50, 0], [0, 0, 0], [3, 3, 3]])
    info = MaskInfo.from_topology(Topology(RING), lens, 64, 64, False)
    live, full = info.classes(16, 16)
    ref_live, ref_full = classify_blocks_from_mask(reference_mask(RING, lens, 64),
                                                   16, 16, False, 0)
    assert torch.equal(live, ref_live) and torch.equal(full, ref_full)
    assert not live[1].any()  # an all-padding sample has no live tile


def test_lists_put_full_blocks_first():
    live = torch.tensor([[[True, True, False, True, True]]])
    full = torch.tensor([[[False, True, False, False, True]]])
    lists = lists_from_classes(live, full)
    assert lists.counts.tolist() == [[[2, 2, 0, 0]]]  # (full, partial, start, the launch order's row)
    assert lists.indices[0, :4].tolist() == [1, 4, 0, 3]
    assert lists.indices.dtype == torch.int32  # fixed slots: int32 ids


def test_seed_block_mask_matches_any_reduction():
    """The seed's construction: pad the dense mask to the block size and reduce each tile with any."""
    topo, lens, block = CYCLIC, (50, 375, 500), 64
    dense = generate_interlaced_mask(topo, lens).float()
    pad = (-dense.shape[0]) % block
    padded = torch.nn.functional.pad(dense, (0, pad, 0, pad))
    n = padded.shape[0] // block
    expected = padded.reshape(n, block, n, block).amax(dim=(1, 3)).bool()
    live, _ = MaskInfo.from_topology(Topology(topo), torch.tensor([lens]), 925, 925, False).classes(block, block)
    assert torch.equal(live[0], expected)


def test_long_sequence_metadata_needs_no_square_memory():
    """S = 400k tokens: an S x S bool mask would need 160 GB; the bit path builds its lists in O(S + blocks)."""
    lens = torch.tensor([[20_000, 300_000, 80_000]])
    # this process's CPU time (all its threads), not wall time: other processes on a shared machine do not count
    start = time.process_time()
    info = MaskInfo.from_topology(Topology(CYCLIC), lens, 400_000, 400_000, True)
    lists = info.lists(512, 512)
    assert time.process_time() - start < 30
    assert lists.counts.shape == (1, 782, COUNT_WORDS) and lists.indices.numel() <= 782 * 782
    # segment 1 (vision, rows 20k..320k) sees only audio (320k..400k), which lies after it: causal leaves nothing
    row_block = 100_000 // 512
    assert lists.counts[0, row_block, :2].tolist() == [0, 0]


@pytest.mark.parametrize("seed", range(20))
def test_count_allowed_pairs_matches_dense(seed):
    from mmsparse.mask.topology import count_allowed_pairs

    topo, lens, seq_q, seq_k, causal, _ = _case(seed)
    assert count_allowed_pairs(topo, lens, causal, seq_q) == int(reference_mask(topo, lens, seq_k, seq_q, causal).sum())


@pytest.mark.parametrize("seed", range(30))
def test_coarse_tiles_pooled_from_fine_ones_match_direct(seed):
    topo, lens, seq_q, seq_k, causal, _ = _case(seed)
    lens_t = torch.tensor([lens])
    pooled = MaskInfo.from_topology(Topology(topo), lens_t, seq_q, seq_k, causal)
    pooled.classes(16, 16)
    for bm, bn in [(32, 16), (16, 64), (64, 32), (128, 64)]:
        direct = MaskInfo.from_topology(Topology(topo), lens_t, seq_q, seq_k, causal).classes(bm, bn)
        for a, b in zip(pooled.classes(bm, bn), direct):
            assert torch.equal(a, b), (bm, bn)


@pytest.mark.parametrize("seed", range(20))
def test_per_sample_query_positions_match_dense_reduction(seed):
    topo, lens, _, seq_k, causal, (bm, bn) = _case(seed)
    seq_q = max(1, seq_k // 3)
    starts = torch.tensor([0, seq_k - seq_q, (seq_k - seq_q) // 2])
    info = MaskInfo.from_topology(Topology(topo), torch.tensor([lens]), seq_q, seq_k, causal, q_start=starts)
    dense = reference_mask(topo, lens, seq_k, seq_q, q_start=starts)
    for got, want in zip(info.classes(bm, bn), classify_blocks_from_mask(dense, bm, bn, causal, starts)):
        assert torch.equal(got, want)


def test_next_power_of_2_is_tritons():
    """The host helper the mask builders size their programs with gives what ``triton.next_power_of_2`` gives."""
    import triton

    from mmsparse.mask.blocks import next_power_of_2

    for n in [*range(-3, 300), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**31 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
