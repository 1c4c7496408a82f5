"""The context-parallel schedule's overlap: without causal tests a rank's own keys run while its fetch is in flight
(forward and backward), and in the backward part of them waits until the gathered keys' dK/dV return has started.
Read from the order of the calls alone, on one process: a plan with one piece over every key would run nothing
before the fetch."""

import torch

from mmsparse.distributed import local
from mmsparse.distributed.local import RankProblem, backward_pieces, forward_pieces

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]


def _events(monkeypatch):
    events = []
    for name in ("piece_forward", "piece_backward"):
        original = getattr(local, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            piece = args[3] if _name == "piece_forward" else args[6]
            events.append(("own" if piece.local_keys else "gathered") + (" late" if piece.late else ""))
            return _original(*args, **kwargs)

        monkeypatch.setattr(local, name, wrapped)
    return events


def test_own_keys_hide_the_fetch_and_the_return(monkeypatch):
    events = _events(monkeypatch)
    problem = RankProblem(CYCLIC, (64, 96, 32), rank=0, world_size=2, chunk=16, tile=16)
    pieces = problem.pieces(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, problem.local_len, 16, generator=gen) for _ in range(4))
    keys = problem.gathered_positions()
    k_g, v_g = (torch.randn(1, 2, keys.numel(), 16, generator=gen) for _ in range(2))

    def gather():
        events.append("gather")
        return k_g, v_g

    out, lse = forward_pieces(q, k, v, pieces, [None] * len(pieces), 0.25, 0.0, gather)
    assert events[0].startswith("own") and events.index("gather") < events.index("gathered"), events
    assert not any(e.startswith("own") for e in events[events.index("gather"):]), events
    events.clear()
    backward_pieces(do, q, k, v, out, lse, pieces, [None] * len(pieces), 0.25, 0.0, gather,
                    lambda dkv: events.append("send back"))
    assert events == ["own", "gather", "gathered", "send back", "own late"], events
