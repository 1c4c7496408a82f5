"""The context-parallel plan: pair counts against the dense mask, nothing needed left out, balanced ranks."""

from __future__ import annotations

import pytest
import torch

from mmsparse import reference_mask
from mmsparse.distributed import chunk_pairs, plan_context_parallel
from tests.helpers import CYCLIC, HUB


def _dense_chunk_pairs(topology, lens, seq, chunk, causal):
    mask = reference_mask(topology, lens, seq, causal=causal).sum(0).to(torch.int64)  # [S, S], summed over samples
    n = -(-seq // chunk)
    padded = torch.zeros(n * chunk, n * chunk, dtype=torch.int64)
    padded[:seq, :seq] = mask
    return padded.view(n, chunk, n, chunk).sum((1, 3))


def _random_case(gen, k):
    topo = (torch.rand(k, k, generator=gen) < 0.5).int().tolist()
    rows = torch.randint(0, 40, (3, k), generator=gen)
    rows[1, 0] = 0  # a zero-length segment
    return topo, rows.tolist()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunk_pairs_match_the_dense_mask(causal):
    gen = torch.Generator().manual_seed(0)
    for k in (1, 3, 5):
        topo, rows = _random_case(gen, k)
        seq = max(sum(r) for r in rows) + 7  # padding past every sample
        for chunk in (16, 32):
            want = _dense_chunk_pairs(topo, rows, seq, chunk, causal)
            assert torch.equal(chunk_pairs(topo, rows, chunk, seq, causal), want)
            assert torch.equal(chunk_pairs(topo, rows[0], chunk, seq, causal),
                               _dense_chunk_pairs(topo, rows[0], seq, chunk, causal))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plan_covers_every_token_and_every_needed_key(world, causal):
    gen = torch.Generator().manual_seed(world)
    topo, rows = _random_case(gen, 4)
    seq = max(sum(r) for r in rows) + 5
    plan = plan_context_parallel(topo, rows, world, causal=causal, seq_len=seq, chunk=16, tile=16)
    tokens = torch.cat([plan.token_index(r) for r in range(world)])
    assert torch.equal(tokens.sort().values, torch.arange(seq)), "every token on exactly one rank"
    mask = reference_mask(topo, rows, seq, causal=causal).any(0)  # [S, S]: live for some sample
    for r in range(world):
        q = plan.token_index(r)
        keys = mask[q].any(0).nonzero().flatten()
        assert set((keys // plan.chunk).tolist()) <= set(plan.needed_kv[r]), "a needed K/V chunk is not fetched"
    assert sum(plan.live_pairs) == int(reference_mask(topo, rows, seq, causal=causal).sum())
    again = plan_context_parallel(topo, rows, world, causal=causal, seq_len=seq, chunk=16, tile=16)
    assert again.owner == plan.owner, "the plan is deterministic"


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize(
    "topology, seg, causal",
    [(CYCLIC, (4096, 24576, 14336), False), (HUB, (16384, 196608, 49152), True), (HUB, (8192, 786432, 253952), True)],
    ids=["cyclic_43k", "hub_causal_256k", "long_1m"],
)
def test_live_pairs_are_balanced(world, topology, seg, causal):
    plan = plan_context_parallel(topology, seg, world, causal=causal)
    assert plan.imbalance() <= 1.05, plan.summary()
    tokens = plan.summary()["tokens"]
    assert max(tokens) - min(tokens) <= plan.chunk


def test_volume_against_all_gather():
    """A cyclic topology: each rank fetches only what its queries see, never more than an all-gather."""
    plan = plan_context_parallel(CYCLIC, (4096, 24576, 14336), 4)
    s = plan.summary(kv_bytes_per_token=2 * 4 * 128 * 2)
    assert all(r <= a for r, a in zip(s["recv_bytes"], s["all_gather_bytes"]))
    assert sum(s["recv_bytes"]) == sum(s["sent_bytes"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        plan_context_parallel(CYCLIC, (10, 20, 30), 0)
    with pytest.raises(ValueError, match="multiple of the tile"):
        plan_context_parallel(CYCLIC, (10, 20, 30), 2, chunk=100)
    with pytest.raises(ValueError, match="more than the sequence length"):
        chunk_pairs(CYCLIC, (10, 20, 30), 16, 50)
