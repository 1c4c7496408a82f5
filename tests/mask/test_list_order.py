"""The launch order over block lists (mmsparse.mask.list_order): each sample's rows longest list first, in the
fourth word of the lists' counts, and the programs' rows through it (kernels.lists.ordered_row), against plain
Python."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from mmsparse import Topology
from mmsparse.kernels.lists import ordered_row
from mmsparse.mask.build import build_mask_info
from mmsparse.mask.list_order import rank_rows, write_launch_order


def _python_order(counts: torch.Tensor) -> list[list[int]]:
    lengths = (counts[..., 0] + counts[..., 1]).tolist()
    return [sorted(range(len(row)), key=lambda r: (-row[r], r)) for row in lengths]


def _random_counts(rng: random.Random, batch: int, rows: int, device: torch.device) -> torch.Tensor:
    top = rng.choice([1, 3, 40])  # few distinct lengths: many ties
    full = torch.tensor([[rng.randint(0, top) for _ in range(rows)] for _ in range(batch)], dtype=torch.int32)
    partial = torch.tensor([[rng.randint(0, top) for _ in range(rows)] for _ in range(batch)], dtype=torch.int32)
    starts = torch.arange(rows, dtype=torch.int32).expand(batch, rows) * 7
    unwritten = torch.full((batch, rows), -5, dtype=torch.int32)
    return torch.stack([full, partial, starts, unwritten], -1).contiguous().to(device)


def _ordered(counts: torch.Tensor, write=rank_rows) -> torch.Tensor:
    """``counts`` with the launch order written (by the kernel, on a GPU or through the interpreter), the other
    words as they were."""
    before = counts.clone()
    write(counts)
    assert torch.equal(counts[..., :3], before[..., :3])
    return counts


@pytest.mark.parametrize("seed", range(4))
def test_entries_come_longest_first_ties_in_order(seed, device):
    rng = random.Random(seed)
    # past one program's entries and one chunk of the others (interpreter: 256 and 1024), with several samples
    batch, rows = rng.choice([(1, 1), (1, 300), (3, 500), (2, 1100)])
    counts = _ordered(_random_counts(rng, batch, rows, device))
    assert counts[..., 3].tolist() == _python_order(counts.cpu())


@pytest.mark.parametrize("seed", range(3))
def test_the_cpus_order_is_the_kernels(seed, device):
    """A CPU mask's lists take torch's sort, a GPU's the kernel (on the test's device): the same order."""
    rng = random.Random(seed)
    counts = _random_counts(rng, rng.choice([1, 3]), rng.choice([1, 7, 300]), torch.device("cpu"))
    sorted_on_cpu = _ordered(counts.clone(), write_launch_order)
    assert torch.equal(sorted_on_cpu, _ordered(counts.to(device)).cpu())


def test_no_rows(device):
    for write in (rank_rows, write_launch_order):
        write(torch.zeros((2, 0, 4), dtype=torch.int32, device=device))


@triton.jit
def _rows_kernel(COUNTS, OUT, heads, stride_cnt_b):
    b = tl.program_id(1) // heads
    tl.store(OUT + tl.program_id(0) + tl.program_id(1) * tl.num_programs(0),
             ordered_row(COUNTS, tl.program_id(0), b, stride_cnt_b))


@pytest.mark.parametrize("shared", [True, False])
def test_each_heads_programs_take_their_samples_rows_longest_first(shared, device):
    """Program (blk, b * heads + h) takes its sample's blk-th longest row (shared lists: the batch's one order), so
    every head's programs cover every row once."""
    batch, heads, blocks = 2, 3, 5
    counts = _ordered(_random_counts(random.Random(3), 1 if shared else batch, blocks, device))
    out = torch.full((batch * heads, blocks), -1, dtype=torch.int32, device=device)
    _rows_kernel[(blocks, batch * heads)](counts, out, heads, 0 if shared else counts.stride(0))
    order = _python_order(counts.cpu())
    assert out.tolist() == [order[0 if shared else bh // heads] for bh in range(batch * heads)]
    assert all(sorted(row) == list(range(blocks)) for row in out.tolist())


def test_a_masks_lists_carry_their_order(device):
    """Every tile's lists built for a mask (Triton's list kernels here, torch's reduction of the tile classes on a
    plain CPU) hold the order of their own counts: the hub's text keys, which every query sees, come first."""
    topology = Topology([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    info = build_mask_info(topology, [64, 192, 128], 384, 384, False, device)
    for by_key in (False, True):
        counts = info.lists(32, 64, by_key).counts
        assert counts.shape[-1] == 4 and counts[..., 3].tolist() == _python_order(counts.cpu())
    assert info.lists(32, 64, True).counts[0, 0, 3].item() == 0  # the text keys: every query sees them
