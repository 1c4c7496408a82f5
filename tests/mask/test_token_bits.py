"""The one-launch token bits (mmsparse.mask.token_bits) against a plain Python construction of the segment ids."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import Topology
from mmsparse.mask import token_bits as token_bits_module
from mmsparse.mask.token_bits import launch_token_bits


def _expected(topology: Topology, lens: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = topology.num_segments
    def int32(bits: int) -> int:  # bit 31 is the sign bit (k = 32)
        return bits - (1 << 32) if bits >= 1 << 31 else bits

    row_table = [int32(sum(int(topology.matrix[r, c]) << c for c in range(k))) for r in range(k)] + [0]
    col_table = [int32(1 << c) for c in range(k)] + [0]
    rows, cols = [], []
    for sample in lens:
        ids = [t for t, n in enumerate(sample) for _ in range(n)][:seq_len]
        ids += [k] * (seq_len - len(ids))  # padding
        rows.append([row_table[i] for i in ids])
        cols.append([col_table[i] for i in ids])
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(cols, dtype=torch.int32)


def _random_topology(k: int, rng: random.Random) -> Topology:
    matrix = [[int(r == c or rng.random() < 0.4) for c in range(k)] for r in range(k)]
    return Topology(matrix)


@pytest.mark.parametrize("k", [1, 3, 5, 32])
def test_token_bits_match_the_segments(k, device):
    rng = random.Random(k)
    topology = _random_topology(k, rng)
    seq_len = 2500  # three programs of 1024 tokens, the last one ragged
    lens = [[rng.randint(0, 2 * seq_len // k) for _ in range(k)] for _ in range(3)]
    lens[0] = [0] * k  # a sample of padding only
    lens[1][0] = 0  # a zero-length first segment
    for sample in lens:  # totals at most seq_len; some samples padded
        while sum(sample) > seq_len:
            sample[rng.randrange(k)] //= 2
    lens[2] = [seq_len - sum(lens[2][1:])] + lens[2][1:]  # one sample covers the sequence exactly
    for dtype in (torch.int32, torch.int64):
        got = launch_token_bits(topology, torch.tensor(lens, dtype=dtype, device=device), seq_len)
        want = _expected(topology, lens, seq_len)
        for g, w in zip(got, want):
            assert g.dtype == torch.int32 and g.shape == (3, seq_len)
            assert torch.equal(g.cpu(), w)


def test_token_bits_of_a_strided_length_view(device):
    topology = Topology([[1, 1], [0, 1]])
    lens = torch.tensor([[5, 3, 99], [2, 7, 99]], dtype=torch.int32, device=device)[:, :2]  # row stride 3
    got = launch_token_bits(topology, lens, 12)
    for g, w in zip(got, _expected(topology, lens.tolist(), 12)):
        assert torch.equal(g.cpu(), w)


def test_the_kernel_runs_where_kernels_run(device, monkeypatch):
    """The build path uses the kernel (one launch), not the torch ops; off the kernels' devices it uses torch."""
    calls = []
    real = token_bits_module.token_bits_torch
    # Both paths give the same bits: only a spy tells which ran. Triton's interpreter is on for the whole session,
    # so a device the kernels do not take can only be faked.
    monkeypatch.setattr(token_bits_module, "token_bits_torch", lambda *a: calls.append(1) or real(*a))
    topology = Topology([[1, 0], [1, 1]])
    launch_token_bits(topology, torch.tensor([[3, 4]], device=device), 7)
    assert calls == []
    monkeypatch.setattr(token_bits_module, "kernels_run_on", lambda dev: False)
    launch_token_bits(topology, torch.tensor([[3, 4]], device=device), 7)
    assert calls == [1]
