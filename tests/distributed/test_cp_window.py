"""Context parallelism under a sliding window, every rank in one process (``RankProblem``: no process group): the
plan counts only the pairs inside the window and fetches no key chunk wholly outside it; the ranks' pieces, put
back together, give the float64 reference's output and gradients, and with dropout the single-process call's.
(tests/distributed/test_context_parallel.py runs windows over gloo with the exchange.)"""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.dropout import new_dropout_seed
from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces
from mmsparse.distributed.pieces import piece_seeds
from mmsparse.distributed.plan import chunk_pairs, plan_context_parallel
from tests.helpers import CYCLIC, HUB, check_outputs

CASES = [
    # topology, seg_lens, causal, window, heads, kv heads
    (HUB, (12, 0, 41), True, 9, 4, 2),
    (CYCLIC, [(9, 30, 21), (5, 20, 10)], False, 13, 2, 1),
    ([[2, 0, 0], [1, 1, 0], [1, 2, 2]], (20, 25, 18), False, 7, 2, 1),  # pair types: segment codes
    ([[2, 1, 0], [0, 2, 1], [1, 0, 2]], [(20, 25, 18), (5, 40, 3)], True, 30, 2, 2),
    ([[1, 1], [1, 1]], (40, 31), False, 1, 2, 2),  # each query sees itself and the future only
]


def _case_id(case) -> str:
    topo, lens, causal, window, h, hk = case
    return f"k{len(topo)}-W{window}-H{h}x{hk}{'-causal' if causal else ''}-{lens}"


def _all_ranks(case, world: int, device: torch.device, dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """Every rank's forward and backward from the full inputs, put back in sequence order: (out, dq, dk, dv)."""
    topology, lens, causal, window, heads, kv_heads = case
    seq = max(sum(r) for r in (lens if isinstance(lens, list) else [lens]))
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(len(lens) if isinstance(lens, list) else 1, h, seq, 16, generator=gen).to(device)
                   for h in (heads, kv_heads, kv_heads, heads))
    out, dq, dk, dv = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(world):
        problem = RankProblem(topology, lens, rank, world, causal=causal, tile=16, window=window)
        index, gathered = problem.token_index, problem.gathered_positions()
        pieces = problem.pieces(q.device, by_position=seed is not None)
        seeds = [None] * len(pieces) if seed is None else piece_seeds(pieces, seed)
        scale = 16**-0.5
        x = [t[:, :, index] for t in (q, k, v, do)]

        def gather(gathered=gathered):
            return k[:, :, gathered], v[:, :, gathered]

        o_l, lse_l = forward_pieces(*x[:3], pieces, seeds, scale, dropout_p, gather)
        dq_l, dkv_l, dkv_g = backward_pieces(x[3], *x[:3], o_l, lse_l, pieces, seeds, scale, dropout_p, gather)
        out[:, :, index], dq[:, :, index] = o_l, dq_l
        dk[:, :, index] += dkv_l[:, :kv_heads]
        dv[:, :, index] += dkv_l[:, kv_heads:]
        dk[:, :, gathered] += dkv_g[:, :kv_heads]
        dv[:, :, gathered] += dkv_g[:, kv_heads:]
    return (q, k, v, do), (out, dq, dk, dv)


# Two ranks run every case; three ranks a case of each mask mode: token bits (causal, GQA) and segment codes
# (per-sample lengths, causal). (Over gloo, test_context_parallel.py runs windows on 2, 3 and 4 ranks.)
RUNS = [(case, 2) for case in CASES] + [(CASES[0], 3), (CASES[3], 3)]


@pytest.mark.parametrize("case, world", RUNS, ids=[f"{_case_id(c)}-{w}" for c, w in RUNS])
def test_ranks_together_match_the_reference(case, world, device):
    topology, lens, causal, window, _, _ = case
    (q, k, v, do), (out, dq, dk, dv) = _all_ranks(case, world, device)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    for t, g in zip((qd, kd, vd), (dq, dk, dv)):
        t.grad = g
    check_outputs(qd, kd, vd, out, do, reference_mask(topology, lens, q.shape[2], causal=causal, window=window))


def test_ranks_together_match_the_single_call_with_dropout(device):
    """Dropout draws the bits of global positions: the windowed pieces' seeds place them as a single call does."""
    case = (HUB, [(9, 30, 21), (5, 20, 10)], True, 11, 2, 1)
    topology, lens, causal, window, _, _ = case
    torch.manual_seed(21)
    seed = new_dropout_seed(device)
    (q, k, v, do), (out, dq, dk, dv) = _all_ranks(case, 2, device, 0.3, seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(21)  # the same Philox key
    single = mbs_attention(*leaves, topology, [list(r) for r in lens], causal=causal, dropout_p=0.3, window=window)
    single.backward(do)
    assert not torch.equal(single, mbs_attention(q, k, v, topology, [list(r) for r in lens], causal=causal,
                                                  window=window))  # dropout did drop something
    for name, got, want in (("out", out, single), ("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                            ("dv", dv, leaves[2].grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 10, 37])
def test_chunk_pairs_count_the_window(causal, window):
    """Pairs between chunks under a window, pair types included, equal the dense windowed mask's."""
    topology, lens, chunk = [[2, 1, 0], [1, 1, 2], [0, 2, 1]], [(20, 25, 18), (5, 40, 3)], 16
    seq = 63
    got = chunk_pairs(topology, lens, chunk, seq, causal, window)
    mask = reference_mask(topology, lens, seq, causal=causal, window=window).sum(0).to(torch.int64)
    n = -(-seq // chunk)
    pad = torch.zeros(n * chunk, n * chunk, dtype=torch.int64)
    pad[:seq, :seq] = mask
    want = pad.view(n, chunk, n, chunk).sum((1, 3))
    assert torch.equal(got, want)


def test_no_chunk_outside_the_window_is_fetched():
    """A causal window of 20 over 16-token chunks: each rank fetches only the chunks its queries' windows reach.
    Each rank holds one run of chunks, so rank 1 fetches the two chunks before its run and rank 0 nothing, where
    the causal mask alone has the ranks fetch every earlier chunk the other one holds."""
    lens, world = (256,), 2
    windowed = plan_context_parallel([[1]], lens, world, causal=True, chunk=16, tile=16, window=20)
    plain = plan_context_parallel([[1]], lens, world, causal=True, chunk=16, tile=16)
    for rank in range(world):
        for c2 in windowed.needed_kv[rank]:
            last_key = c2 * 16 + 15
            assert any(last_key > c * 16 - 20 for c in windowed.local_chunks[rank]), (rank, c2)

    def fetched(plan):
        return [[c for c in plan.needed_kv[r] if plan.owner[c] != r] for r in range(world)]

    assert fetched(windowed) == [[], [6, 7]] and windowed.local_chunks == (tuple(range(8)), tuple(range(8, 16)))
    assert sum(map(len, fetched(plain))) >= 8 and windowed.imbalance() <= 1.05
    assert windowed.window == 20 and plain.window is None


def test_bad_window():
    with pytest.raises(ValueError, match="positive int"):
        RankProblem([[1]], (32,), 0, 2, window=0)
    with pytest.raises(TypeError, match="positive int"):
        RankProblem([[1]], (32,), 0, 2, window=1.5)
