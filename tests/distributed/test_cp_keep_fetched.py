"""``keep_fetched_kv="auto"``, the default: a call keeps its fetched K/V for the backward where the largest rank's
gathered K/V is at most ``KEEP_FETCHED_MAX_BYTES``. Every rank must decide alike (a rank that fetches again
would wait for peers that kept theirs), so the rule reads the largest rank's bytes, which every rank computes the
same from the plan."""

from __future__ import annotations

import pytest
import torch

from mmsparse.distributed import ContextParallel, RankProblem, context_parallel
from tests.helpers import HUB

LENS = (9, 20, 13)


def test_every_rank_reads_the_largest_ranks_gathered_bytes():
    # Causal hub over three ranks: the ranks gather different numbers of keys
    k = torch.empty(2, 3, 1, 16, dtype=torch.float16)
    ranks = [RankProblem(HUB, (40, 0, 200), rank, 3, causal=True) for rank in range(3)]
    gathered = [r.gathered_positions().numel() for r in ranks]
    assert len(set(gathered)) > 1, "the case must have ranks that gather different amounts"
    expected = 2 * 2 * 3 * max(gathered) * 16 * 2
    assert [r.most_gathered_kv_bytes(k) for r in ranks] == [expected] * 3


def test_auto_keeps_up_to_the_limit_and_no_further(one_rank_world, monkeypatch):
    cp = ContextParallel(HUB, LENS)
    assert cp.keep_fetched_kv == "auto"
    k = torch.empty(1, 2, sum(LENS), 16)
    size = 2 * 2 * sum(LENS) * 16 * 4  # one rank gathers every key
    assert cp.most_gathered_kv_bytes(k) == size
    monkeypatch.setattr(context_parallel, "KEEP_FETCHED_MAX_BYTES", size)
    assert cp.keeps_fetched_kv(k)
    monkeypatch.setattr(context_parallel, "KEEP_FETCHED_MAX_BYTES", size - 1)
    assert not cp.keeps_fetched_kv(k)
    assert ContextParallel(HUB, LENS, keep_fetched_kv=True).keeps_fetched_kv(k)
    assert not ContextParallel(HUB, LENS, keep_fetched_kv=False).keeps_fetched_kv(k.half())


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_other_values_are_refused(one_rank_world, value):
    with pytest.raises(TypeError, match=r"keep_fetched_kv must be True, False or 'auto'; got"):
        ContextParallel(HUB, LENS, keep_fetched_kv=value)


def test_a_call_above_the_limit_saves_no_fetched_keys(one_rank_world, monkeypatch):
    # The backward then fetches again: what the forward saves for it is q, k, v, out and lse alone
    cp = ContextParallel(HUB, LENS)
    q, k, v = (torch.randn(1, 2, sum(LENS), 16, requires_grad=True) for _ in range(3))
    saved = []
    for limit, expected in ((0, 5), (2**30, 7)):
        monkeypatch.setattr(context_parallel, "KEEP_FETCHED_MAX_BYTES", limit)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = cp.attention(q, k, v)
        assert len(saved) == expected, (limit, len(saved))
        out.sum().backward()
        saved.clear()
