"""What a rank runs while its exchanges are in flight, every rank in one process (``RankProblem``: no process group).

Without a causal test a bit mask runs the rank's own keys as a piece of their own (from its local K/V, while the
fetch is in flight) and the gathered keys with the own keys' bits cleared; the backward runs the gathered pieces
first when the K/V is at hand, so that the own pieces overlap the dK/dV return, with the same bits either way.
(tests/distributed/test_context_parallel.py checks the results over gloo with the exchange.)"""

from __future__ import annotations

import pytest
import torch

import mmsparse.distributed.local as local_module
from mmsparse import reference_mask
from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces
from tests.helpers import CYCLIC, check_outputs

LENS, HEADS, KV_HEADS, DIM = (24, 70, 33), 2, 1, 16


def test_a_non_causal_bit_mask_runs_its_own_keys_apart():
    problem = RankProblem(CYCLIC, LENS, 0, 2, tile=16)
    pieces = problem.pieces(torch.device("cpu"))
    assert [p.local_keys for p in pieces] == [True, False]
    own, gathered = pieces
    assert own.k_rows == own.q_rows == slice(0, problem.local_len)
    # The gathered piece sees none of the rank's own keys, and all of the others' as they are.
    positions = problem.gathered_positions()
    is_own = torch.isin(positions, problem.token_index)
    assert is_own.any() and (~is_own).any()
    assert (gathered.info.k_bits[:, is_own] == 0).all()
    assert (gathered.info.k_bits[:, ~is_own] != 0).any()


def _rank_inputs(problem: RankProblem, seed: int):
    seq = sum(LENS)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, h, seq, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    return (q, k, v, do), [t[:, :, problem.token_index] for t in (q, k, v, do)]


@pytest.mark.parametrize("gathered_first", [False, True])
def test_the_backward_order_and_when_the_return_may_start(monkeypatch, gathered_first):
    problem = RankProblem(CYCLIC, LENS, 1, 2, tile=16)
    (q, k, v, do), x = _rank_inputs(problem, seed=11)
    pieces = problem.pieces(q.device)
    gathered = problem.gathered_positions()

    def gather():
        return k[:, :, gathered], v[:, :, gathered]

    events = []
    real = local_module.piece_backward
    monkeypatch.setattr(local_module, "piece_backward",
                        lambda *a, **kw: events.append("own" if a[6].local_keys else "gathered") or real(*a, **kw))
    out, lse = forward_pieces(*x[:3], pieces, [None] * len(pieces), DIM**-0.5, 0.0, gather)

    def done(dkv_g):
        events.append("return")
        returned.append(dkv_g.clone())  # complete when handed over: nothing adds to it afterwards

    returned: list[torch.Tensor] = []
    dq, dkv_own, dkv_g = backward_pieces(x[3], *x[:3], out, lse, pieces, [None] * len(pieces), DIM**-0.5, 0.0,
                                         gather, gathered_done=done, gathered_first=gathered_first)
    assert events == (["gathered", "return", "own"] if gathered_first else ["own", "gathered", "return"])
    assert torch.equal(returned[0], dkv_g)
    # Against the other order: the same bits.
    other = backward_pieces(x[3], *x[:3], out, lse, pieces, [None] * len(pieces), DIM**-0.5, 0.0, gather,
                            gathered_first=not gathered_first)
    for a, b in zip((dq, dkv_own, dkv_g), other):
        assert torch.equal(a, b)


def test_both_ranks_together_match_the_reference():
    """The two pieces of each rank, merged and put back in sequence order, against the float64 reference."""
    ranks = [RankProblem(CYCLIC, LENS, r, 2, tile=16) for r in range(2)]
    (q, k, v, do), _ = _rank_inputs(ranks[0], seed=12)
    out, dq = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))  # every row must be written
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for problem in ranks:
        index, gathered = problem.token_index, problem.gathered_positions()
        x = [t[:, :, index] for t in (q, k, v, do)]
        pieces = problem.pieces(q.device)

        def gather(gathered=gathered):
            return k[:, :, gathered], v[:, :, gathered]

        o_l, lse_l = forward_pieces(*x[:3], pieces, [None] * len(pieces), DIM**-0.5, 0.0, gather)
        dq_l, dkv_l, dkv_g = backward_pieces(x[3], *x[:3], o_l, lse_l, pieces, [None] * len(pieces), DIM**-0.5,
                                             0.0, gather, gathered_first=problem.rank == 1)
        out[:, :, index], dq[:, :, index] = o_l, dq_l
        dk[:, :, index] += dkv_l[:, :KV_HEADS]
        dv[:, :, index] += dkv_l[:, KV_HEADS:]
        dk[:, :, gathered] += dkv_g[:, :KV_HEADS]
        dv[:, :, gathered] += dkv_g[:, KV_HEADS:]
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    for t, g in zip((qd, kd, vd), (dq, dk, dv)):
        t.grad = g
    check_outputs(qd, kd, vd, out, do, reference_mask(CYCLIC, LENS, q.shape[2]))
