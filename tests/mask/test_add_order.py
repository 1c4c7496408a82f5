"""The ranks that order the dQ writer's adds (``mmsparse.mask.add_order``): for every entry of a key block's list,
the number of key blocks before it in the launch order whose lists hold the same query block, counted here by a
walk over the launch order, for lists in fixed slots and packed end to end, shared by the batch and per sample,
with empty rows; and kept per lists while they live."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from mmsparse.kernels.constants import MASK_BITS, MASK_DENSE, MASK_SEGMENTS
from mmsparse.mask.add_order import _RANKS, adds_shortest_first, dq_add_ranks, lists_add_ranks
from mmsparse.mask.blocks import BlockLists, lists_from_classes
from mmsparse.mask.build import build_mask_info
from tests.helpers import HUB


def walked_ranks(lists: BlockLists, resident: int, shortest_first: bool) -> dict[tuple[int, int], int]:
    """{(sample, slot): rank}: each sample's entries walked group of ``resident`` programs by group (in launch
    order: the lists' order, backwards where ``shortest_first``), within a group step by step, within a step
    program by program, counting each query block's entries so far."""
    ranks = {}
    counts = lists.counts.tolist()
    indices = lists.indices.tolist()
    for b, rows in enumerate(counts):
        seen: dict[int, int] = {}
        launch = [row for _, _, _, row in rows][::-1 if shortest_first else 1]
        for first in range(0, len(rows), resident):
            group = [rows[row] for row in launch[first:first + resident]]
            for step in range(max((full + partial for full, partial, _, _ in group), default=0)):
                for full, partial, start, _ in group:
                    if step < full + partial:
                        block = indices[b][start + step]
                        ranks[(b, start + step)] = seen.get(block, 0)
                        seen[block] = seen.get(block, 0) + 1
    return ranks


def assert_ranks(lists: BlockLists, query_blocks: int, resident: int) -> int:
    for shortest_first in (True, False):
        ranks = dq_add_ranks(lists, query_blocks, resident, shortest_first)
        assert ranks.dtype == torch.int32 and ranks.shape == lists.indices.shape
        expected = walked_ranks(lists, resident, shortest_first)
        got = {key: int(ranks[key]) for key in expected}
        assert got == expected
    return len(expected)


@pytest.mark.parametrize("seed", range(6))
def test_ranks_of_random_tile_maps(seed):
    """Fixed-slot lists of random tile maps, 1-3 samples, rows with empty lists among them."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    samples, rows, cols = rng.randint(1, 3), rng.randint(1, 12), rng.randint(1, 16)
    live = torch.rand(samples, rows, cols) < 0.5
    live[:, rng.randrange(rows)] = False  # an empty list
    full = live & (torch.rand(samples, rows, cols) < 0.5)
    lists = lists_from_classes(live, full)
    for resident in (1, 2, 5, rows):
        assert assert_ranks(lists, cols, resident) == int(live.sum())


@pytest.mark.parametrize("compact_bytes", [0, 1 << 40], ids=["packed", "fixed-slots"])
@pytest.mark.parametrize("lens", [(300, 0, 517), [(100, 500, 217), (400, 17, 400)]], ids=["shared", "per-sample"])
def test_ranks_of_a_masks_key_lists(compact_bytes, lens):
    """The by-key lists a mask builds for the dQ writer's tile (64 query rows x 128 keys), packed end to end and in
    fixed slots, shared by the batch and per sample."""
    info = build_mask_info(HUB, lens, 817, 817, True, torch.device("cpu"))
    lists = info.lists(64, 128, True, compact_bytes)
    assert lists.counts.shape[0] == (1 if isinstance(lens, tuple) else 2)
    for resident in (3, 132):
        assert assert_ranks(lists, -(-817 // 64), resident) > 0


def test_no_rows_or_entries():
    empty = BlockLists(torch.zeros(1, 0, 4, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32))
    assert dq_add_ranks(empty, 3, 132).shape == (1, 0)
    none_live = lists_from_classes(torch.zeros(1, 3, 4, dtype=torch.bool), torch.zeros(1, 3, 4, dtype=torch.bool))
    assert dq_add_ranks(none_live, 4, 132).shape == none_live.indices.shape
    with pytest.raises(ValueError, match="resident is the number of programs"):
        dq_add_ranks(lists_from_classes(torch.ones(1, 3, 4, dtype=torch.bool), torch.ones(1, 3, 4, dtype=torch.bool)),
                     4, 0)


def test_ranks_are_kept_while_their_lists_live():
    torch.manual_seed(0)
    live = torch.rand(1, 5, 10) < 0.5
    lists = lists_from_classes(live, live & (torch.rand(1, 5, 10) < 0.5))
    first = lists_add_ranks(lists.counts, lists.indices, 10, 4)
    assert lists_add_ranks(lists.counts, lists.indices, 10, 4) is first
    assert torch.equal(first, dq_add_ranks(lists, 10, 4))
    assert torch.equal(lists_add_ranks(lists.counts, lists.indices, 10, 2), dq_add_ranks(lists, 10, 2))
    # other counts over the same ids (another launch order): their own ranks, not the kept ones
    reordered = lists.counts.clone()
    reordered[..., 3] = reordered[..., 3].flip(-1)
    assert torch.equal(lists_add_ranks(reordered, lists.indices, 10, 2),
                       dq_add_ranks(BlockLists(reordered, lists.indices), 10, 2))
    # the other launch direction: its own ranks
    longest = lists_add_ranks(lists.counts, lists.indices, 10, 2, shortest_first=False)
    assert torch.equal(longest, dq_add_ranks(lists, 10, 2, shortest_first=False))
    assert not torch.equal(longest, dq_add_ranks(lists, 10, 2))
    key = id(lists.indices)
    assert key in _RANKS
    del lists
    gc.collect()
    assert key not in _RANKS


def test_the_launch_direction_follows_the_mask():
    """Shortest list first where a key block's list may start at its own queries (the causal flag, segment codes'
    causal pairs, a dense mask), longest first for a bit mask without the causal flag."""
    assert not adds_shortest_first(MASK_BITS, False)
    assert adds_shortest_first(MASK_BITS, True)
    for mode in (MASK_SEGMENTS, MASK_DENSE):
        assert adds_shortest_first(mode, False) and adds_shortest_first(mode, True)
