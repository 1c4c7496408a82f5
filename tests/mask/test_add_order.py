"""The ordered one-pass backward's add ranks (mmsparse.mask.add_order) against a count over the padded lists."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import Topology
from mmsparse.mask.add_order import add_ranks
from mmsparse.mask.block_lists import build_block_lists
from mmsparse.mask.blocks import BlockLists, cdiv, lists_from_classes
from mmsparse.mask.info import MaskInfo


def _reference_ranks(lists: BlockLists, n_cols: int) -> dict[tuple[int, int, int], int]:
    """{(sample, key block, query block): rank} by counting, for each entry, the lower rows that hold its column."""
    counts, ids = lists.padded(n_cols)
    ranks = {}
    for b in range(ids.shape[0]):
        seen: dict[int, int] = {}
        for row in range(ids.shape[1]):
            for col in ids[b, row][: int(counts[b, row].sum())].tolist():
                ranks[(b, row, col)] = seen.get(col, 0)
                seen[col] = seen.get(col, 0) + 1
    return ranks


def _assert_ranks(lists: BlockLists, n_cols: int) -> None:
    ranks = add_ranks(lists, n_cols)
    assert ranks.dtype == torch.int32 and ranks.shape == lists.indices.shape and ranks.is_contiguous()
    want = _reference_ranks(lists, n_cols)
    got = {}
    counts = lists.counts.cpu()
    for b in range(counts.shape[0]):
        for row in range(counts.shape[1]):
            full, part, start = counts[b, row].tolist()
            for p in range(start, start + full + part):
                got[(b, row, int(lists.indices[b, p]))] = int(ranks[b, p])
    assert got == want, f"first differences: {[(k, got.get(k), v) for k, v in want.items() if got.get(k) != v][:5]}"


@pytest.mark.parametrize("seed", range(12))
def test_ranks_count_the_lower_key_blocks(seed, device):
    """Random topologies, batches with their own lengths, fixed-slot and packed lists."""
    rng = random.Random(seed)
    k = rng.choice([2, 3, 5])
    topo = Topology([[int(rng.random() < 0.5) for _ in range(k)] for _ in range(k)])
    batch, seq = rng.choice([1, 2]), rng.randint(20, 260)
    lens = []
    for _ in range(batch):
        row = [rng.randint(0, seq // k) for _ in range(k)]
        row[-1] += seq - sum(row)
        lens.append(row)
    seq_q = rng.choice([seq, rng.randint(1, seq)])
    info = MaskInfo.from_topology(topo, torch.tensor(lens, device=device), seq_q, seq, rng.random() < 0.5)
    bm, bn = rng.choice([(16, 16), (16, 32), (32, 16), (64, 128)])
    for compact in (False, True):
        lists = build_block_lists(info.q_bits, info.k_bits, k, bm, bn, info.causal, info.q_start, by_key=True,
                                  compact=compact)
        _assert_ranks(lists, cdiv(seq_q, bm))


def test_ranks_of_torch_built_lists_and_empty_rows(device):
    """Lists reduced from tile classes (the dense-mask path), with empty rows between full ones."""
    live = torch.tensor([[[1, 1, 0], [0, 0, 0], [1, 0, 1], [1, 1, 1]]], dtype=torch.bool, device=device)
    full = live & torch.tensor([[[1, 0, 0], [0, 0, 0], [0, 0, 1], [1, 1, 0]]], dtype=torch.bool, device=device)
    lists = lists_from_classes(live, full)
    _assert_ranks(lists, 3)
    ranks = add_ranks(lists, 3)
    # column 0: rows 0, 2, 3 -> 0, 1, 2; column 2: rows 2, 3 -> 0, 1 (row 3 lists its full columns 0, 1 first)
    assert ranks[0, 9:12].tolist() == [2, 1, 1]


def test_no_lists(device):
    lists = build_block_lists(torch.zeros(1, 0, dtype=torch.int32, device=device),
                              torch.zeros(1, 5, dtype=torch.int32, device=device), 1, 16, 16, False,
                              torch.zeros(1, dtype=torch.int32, device=device), by_key=True)
    assert add_ranks(lists, 0).numel() == 0
