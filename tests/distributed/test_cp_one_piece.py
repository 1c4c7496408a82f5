"""A rank whose attention is one piece (token bits, no causal flag, no window, no dropout): its gradients come
straight from that piece in the inputs' dtype, with no float32 sums, and its dK/dV go back to the owners in that
dtype. Every rank in one process (``RankProblem``); test_context_parallel.py runs a half-precision case of it
over gloo with the exchange."""

from __future__ import annotations

import pytest
import torch

from mmsparse import reference_mask
from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces
from tests.helpers import CYCLIC, HUB, check_outputs, record_backward_passes

ONE_PIECE = [
    # topology, seg_lens, heads, kv heads
    (CYCLIC, (9, 30, 21), 2, 1),
    ([[1, 1], [0, 0]], (37, 20), 2, 2),  # the second segment attends nothing
    (HUB, [(12, 0, 41), (20, 20, 13)], 2, 1),  # per-sample lengths
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ONE_PIECE, ids=lambda c: f"k{len(c[0])}-{c[1]}-H{c[2]}x{c[3]}")
def test_one_piece_ranks_give_exact_gradients_in_the_inputs_dtype(case, world, device):
    topology, lens, heads, kv_heads = case
    batch = len(lens) if isinstance(lens, list) else 1
    seq = max(sum(r) for r in (lens if isinstance(lens, list) else [lens]))
    gen = torch.Generator().manual_seed(world)
    q, k, v, do = (torch.randn(batch, h, seq, 16, generator=gen).to(device, torch.half)
                   for h in (heads, kv_heads, kv_heads, heads))
    out = torch.full_like(q, float("nan"))
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    for rank in range(world):
        problem = RankProblem(topology, lens, rank, world, tile=16)
        assert problem.one_piece() and not problem.one_piece(by_position=True)
        assert problem.kv_grad_dtype(torch.float16) == torch.float16
        index, gathered = problem.token_index, problem.gathered_positions()
        pieces = problem.pieces(q.device)
        assert len(pieces) == 1 and not pieces[0].local_keys
        # held own chunks first, then each other rank's: the exchange moves and sums each rank's as one run
        owners = [problem.plan.owner[c] for c in problem.gathered_chunks()]
        assert owners == sorted(owners, key=lambda r: (r != rank, r))
        x = [t[:, :, index] for t in (q, k, v, do)]

        def gather(gathered=gathered):
            return k[:, :, gathered], v[:, :, gathered]

        o_l, lse_l = forward_pieces(*x[:3], pieces, [None], 16**-0.5, 0.0, gather)
        dq_l, dkv_l, dkv_g = backward_pieces(x[3], *x[:3], o_l, lse_l, pieces, [None], 16**-0.5, 0.0, gather)
        assert dkv_l is None and dq_l.dtype == dkv_g.dtype == torch.float16
        out[:, :, index], dq[:, :, index] = o_l, dq_l.float()
        # the owners' sum, in float32 (any order here: the test's tolerance is the reference's)
        dk[:, :, gathered] += dkv_g[:, :kv_heads]
        dv[:, :, gathered] += dkv_g[:, kv_heads:]
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    for t, g in zip((qd, kd, vd), (dq, dk, dv)):
        t.grad = g.half()
    check_outputs(qd, kd, vd, out, do, reference_mask(topology, lens, seq))


@pytest.mark.parametrize("causal, window, topology", [
    (True, None, CYCLIC), (False, 9, CYCLIC), (False, None, [[2, 0], [1, 1]]),  # causal; window; pair types
])
def test_other_ranks_sum_their_pieces_in_float32(causal, window, topology):
    """Several pieces share query rows or keys there: their gradients are float32 sums, and so is the return."""
    problem = RankProblem(topology, (30, 34) if len(topology) == 2 else (9, 30, 21), 0, 2, causal=causal, tile=16,
                          window=window)
    assert not problem.one_piece() and problem.kv_grad_dtype(torch.float16) == torch.float32


@pytest.mark.parametrize("one_piece", [True, False], ids=["one-piece", "pieces"])
def test_the_return_starts_before_the_dq_pass(one_piece, monkeypatch, device):
    """A one-piece rank hands its dK/dV to the return (``on_kv_grads``) as soon as the dK/dV pass is queued and
    only then queues the dQ pass, so that the return's transfer runs beside it; a rank of several pieces hands
    both sums over after its last piece. What it hands over is what ``backward_pieces`` returns."""
    events = []
    record_backward_passes(monkeypatch, events)
    topology, lens = (CYCLIC, (9, 30, 21)) if one_piece else ([[2, 0], [1, 1]], (30, 34))
    problem = RankProblem(topology, lens, 0, 2, tile=16)
    assert problem.one_piece() == one_piece
    seq = sum(lens)
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, seq, 16, generator=gen).to(device, torch.half) for _ in range(4))
    index, gathered = problem.token_index, problem.gathered_positions()
    pieces = problem.pieces(q.device)
    x = [t[:, :, index] for t in (q, k, v, do)]

    def gather():
        return k[:, :, gathered], v[:, :, gathered]

    handed = []

    def on_kv_grads(dkv_local, dkv_gathered):
        events.append("return")
        handed.append((dkv_local, dkv_gathered))

    seeds = [None] * len(pieces)
    o_l, lse_l = forward_pieces(*x[:3], pieces, seeds, 16**-0.5, 0.0, gather)
    events.clear()
    _, dkv_l, dkv_g = backward_pieces(x[3], *x[:3], o_l, lse_l, pieces, seeds, 16**-0.5, 0.0, gather,
                                      on_kv_grads=on_kv_grads)
    (dkv_l_handed, dkv_g_handed), = handed
    assert dkv_g_handed is dkv_g and dkv_l_handed is dkv_l
    if one_piece:
        assert events == ["dkdv", "return", "dq"]
    else:
        assert events[-1] == "return" and events.count("return") == 1 and events.count("dq") == len(pieces)
