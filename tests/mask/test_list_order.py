"""The launch order over block lists (mmsparse.mask.list_order): each sample's rows longest list first, in the
fourth word of the lists' counts, and the programs' mapping to it, heads a section at a time
(kernels.lists.ordered_program), against plain Python."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from mmsparse import Topology
from mmsparse.kernels.lists import ordered_program
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
def test_the_cpus_order_is_the_kernels(seed):
    """A CPU mask's lists take torch's sort, a GPU's the kernel: the same order."""
    rng = random.Random(seed)
    counts = _random_counts(rng, rng.choice([1, 3]), rng.choice([1, 7, 300]), torch.device("cpu"))
    assert torch.equal(_ordered(counts.clone(), write_launch_order), _ordered(counts))


def test_no_rows(device):
    for write in (rank_rows, write_launch_order):
        write(torch.zeros((2, 0, 4), dtype=torch.int32, device=device))


@triton.jit
def _programs_kernel(COUNTS, OUT, heads, stride_cnt_b, section):
    blk, bh = ordered_program(COUNTS, tl.program_id(0), tl.program_id(1), tl.num_programs(0), heads, stride_cnt_b,
                              section)
    linear = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    tl.store(OUT + 2 * linear, blk)
    tl.store(OUT + 2 * linear + 1, bh)


def _launch_order(counts: torch.Tensor, blocks: int, batch: int, heads: int, section: int) -> list[tuple[int, int]]:
    out = torch.full((blocks * batch * heads, 2), -1, dtype=torch.int32, device=counts.device)
    shared = counts.shape[0] == 1
    _programs_kernel[(blocks, batch * heads)](counts, out, heads, 0 if shared else counts.stride(0), section)
    return [tuple(pair) for pair in out.tolist()]


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("section", [1, 2, 4, 100])
def test_programs_take_each_samples_rows_in_order_a_section_of_heads_at_a_time(shared, section, device):
    """Program p (launch order: block fastest) takes, within its sample and its section of heads, the row
    order[sample][i], every head of the section in turn; every (block, batch * head) exactly once. Shared lists
    take the batch's heads as one sample's; a section of 4 over 3 heads (or 6) ends with a narrower one."""
    batch, heads, blocks = 2, 3, 5
    counts = _ordered(_random_counts(random.Random(3), 1 if shared else batch, blocks, device))
    order = counts[..., 3].tolist()
    got = _launch_order(counts, blocks, batch, heads, section)
    samples, per_sample = (1, batch * heads) if shared else (batch, heads)
    want = []
    for sample in range(samples):
        for first in range(0, per_sample, section):
            width = min(section, per_sample - first)
            want += [(row, sample * per_sample + first + j) for row in order[sample] for j in range(width)]
    assert got == want
    assert sorted(got) == sorted((blk, bh) for blk in range(blocks) for bh in range(batch * heads))


def test_a_masks_lists_carry_their_order(device):
    """Every tile's lists built for a mask (Triton's list kernels here, torch's reduction of the tile classes on a
    plain CPU) hold the order of their own counts: the hub's text keys, which every query sees, come first."""
    topology = Topology([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    info = build_mask_info(topology, [64, 192, 128], 384, 384, False, device)
    for by_key in (False, True):
        counts = info.lists(32, 64, by_key).counts
        assert counts.shape[-1] == 4 and counts[..., 3].tolist() == _python_order(counts.cpu())
    assert info.lists(32, 64, True).counts[0, 0, 3].item() == 0  # the text keys: every query sees them
