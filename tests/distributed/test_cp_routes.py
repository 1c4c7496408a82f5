"""The exchange's routes (mmsparse/distributed/routes.py): worked out once per rank and key order, so that a call
spends no host time walking the plan; and consistent between ranks, each gathered key landing exactly once."""

from __future__ import annotations

import pytest
import torch

from mmsparse.distributed import ContextParallel, ContextParallelPlan, RankProblem
from tests.helpers import CYCLIC, HUB

CASES = [(CYCLIC, (30, 200, 90), False, 3), (HUB, (40, 0, 200), True, 4), ([[1, 1], [0, 0]], (37, 20), False, 2)]


def _covers_once(spans, total: int, destination: bool = True) -> bool:
    hits = torch.zeros(total, dtype=torch.int32)
    for s, d, n in spans:
        start = d if destination else s
        hits[start : start + n] += 1
    return bool((hits == 1).all())


@pytest.mark.parametrize(("topology", "lens", "causal", "world"), CASES)
@pytest.mark.parametrize("by_position", [False, True])
def test_what_one_rank_sends_another_receives(topology, lens, causal, world, by_position):
    ranks = [RankProblem(topology, lens, r, world, causal=causal) for r in range(world)]
    routes = [p.routes(by_position) for p in ranks]
    assert sum(routes[0].local_lengths) == ranks[0].seq_len
    for a in range(world):
        for b in range(world):
            if a == b:
                assert a not in routes[a].fetch_sends and a not in routes[a].fetch_receives
                continue
            sent = routes[a].fetch_sends.get(b)
            got = routes[b].fetch_receives.get(a)
            assert (sent is None) == (got is None) and routes[a].served[b] == (0 if sent is None else sent.tokens)
            if sent is not None:
                assert sent.tokens == got.tokens == routes[b].fetch_pulls[a].tokens
                # the return goes back along the fetch: b returns to a what a served b
                assert routes[b].return_sends[a].tokens == routes[a].return_pulls[b].tokens == sent.tokens
                assert _covers_once(sent.spans, sent.tokens) and _covers_once(got.spans, got.tokens, False)
    for r, route in enumerate(routes):
        assert route.gathered == route.gathered_lengths[r] == ranks[r].gathered_positions(by_position).numel()
        # every gathered key lands once: its own chunks, and each peer's, by point to point or by peer copies
        landing = list(route.own) + [s for m in route.fetch_receives.values() for s in m.spans]
        pulled = list(route.own) + [s for m in route.fetch_pulls.values() for s in m.spans]
        assert _covers_once(landing, route.gathered) and _covers_once(pulled, route.gathered)
        assert route.fetched == route.gathered - sum(n for _, _, n in route.own)


def test_a_call_does_not_walk_the_plan_again(one_rank_world, monkeypatch):
    cp = ContextParallel(HUB, (9, 20, 13))
    q, k, v = (torch.randn(1, 2, 42, 16, requires_grad=True) for _ in range(3))
    cp.attention(q, k, v).sum().backward()  # builds the pieces, the rows and the routes
    calls = []
    original = ContextParallelPlan.chunk_tokens
    monkeypatch.setattr(ContextParallelPlan, "chunk_tokens", lambda self, c: calls.append(c) or original(self, c))
    cp.attention(q, k, v).sum().backward()
    assert calls == [], f"a second call walked the plan's chunks {len(calls)} times"
    assert cp.routes(False) is cp.routes(False)
