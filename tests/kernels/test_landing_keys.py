"""A context-parallel rank's backward over gathered keys that are still landing (``ExchangeHooks.keys``): the Gluon
dK/dV pass starts on the rank's own key blocks and takes each other block once the arrival flag is set; every
other pass, and the tl kernels, wait on the stream first.

On the GPU a side stream stands in for the peers: it sleeps, then copies the fetched keys into place and sets the
flag with a stream memory write, while the part of the gathered K/V that is still landing holds NaN when the
backward is queued. A kernel that read it early would carry the NaN into the gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from mmsparse import reference_mask
from mmsparse.attention import gluon_launch
from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces
from mmsparse.runtime.arrival import KeysArrival
from tests.helpers import CYCLIC, check_outputs, make_qkv, record_backward_passes

DELAY_BYTES = (1024, 1 << 20)  # rows, bytes a row: a 1 GiB copy before the keys land (about a millisecond)


def _present(problem: RankProblem) -> int:
    """The tokens of the rank's own chunks at the front of its gathered keys."""
    plan, chunks = problem.plan, problem.gathered_chunks()
    return plan.tokens_of(list(itertools.takewhile(lambda c: plan.owner[c] == problem.rank, chunks)))


def _rank_backward(problem, q, k, v, grad_out, landing_late: bool):
    """(out, dq, dK/dV of the gathered keys) of ``problem``'s one piece, its gathered keys landing late or not."""
    index = problem.token_index.to(q.device)
    gathered = problem.gathered_positions().to(q.device)
    local = [t[:, :, index].contiguous() for t in (q, k, v)]
    hkv = k.shape[1]
    full = torch.cat([k[:, :, gathered], v[:, :, gathered]], dim=1)  # [B, 2 Hkv, S_gathered, D], as the exchange

    def gather():
        return full[:, :hkv], full[:, hkv:]

    pieces = problem.pieces(q.device)
    scale = q.shape[-1] ** -0.5
    out, lse = forward_pieces(*local, pieces, [None], scale, 0.0, gather)
    present = _present(problem)
    assert 0 < present < full.shape[2]
    arriving = None
    if landing_late:
        from mmsparse.runtime.cuda_driver import copy_rows_on_stream, write_value_on_stream

        current, peers = torch.cuda.current_stream(), torch.cuda.Stream()
        buffer = full.clone()
        buffer[:, :, present:] = float("nan")  # what is not there yet
        flag = torch.zeros(1, dtype=torch.int32, device=q.device)
        delay = torch.empty(2, *DELAY_BYTES, dtype=torch.uint8, device=q.device)
        peers.wait_stream(current)
        row = full.shape[3] * full.element_size()

        def arriving():
            # Copy engines only, as the exchange: a kernel that spins while holding SMs cannot stall them. The first
            # copy only takes time, so that the own key blocks run first.
            device = q.device.index
            copy_rows_on_stream(delay[0].data_ptr(), DELAY_BYTES[1], delay[1].data_ptr(), DELAY_BYTES[1],
                                DELAY_BYTES[1], DELAY_BYTES[0], peers.cuda_stream, device)
            copy_rows_on_stream(buffer.data_ptr() + present * row, full.shape[2] * row, full.data_ptr() + present * row,
                                full.shape[2] * row, (full.shape[2] - present) * row, full.shape[0] * full.shape[1],
                                peers.cuda_stream, device)
            write_value_on_stream(flag.data_ptr(), 1, peers.cuda_stream, device)
            return buffer[:, :hkv], buffer[:, hkv:], KeysArrival(flag, 1, present, lambda: current.wait_stream(peers))

    dq, dkv_l, dkv_g = backward_pieces(grad_out[:, :, index].contiguous(), *local, out, lse, pieces, [None], scale,
                                       0.0, gather, arriving=arriving)
    assert dkv_l is None
    torch.cuda.synchronize()
    return out, dq, dkv_g


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,kv_heads", [(128, 2), (64, 1)])
def test_dkdv_pass_takes_the_keys_as_they_land(head_dim, kv_heads, monkeypatch):
    lens, world = (700, 2100, 1300), 2
    seq = sum(lens)
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = make_qkv(1, 4, kv_heads, seq, seq, head_dim, torch.bfloat16, torch.device("cuda"), gen)
    grad_out = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    landing = []
    real = gluon_launch.run_dkdv

    def spy(*args, **kwargs):
        landing.append(kwargs.get("arrival"))
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_launch, "run_dkdv", spy)
    out = torch.empty_like(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for rank in range(world):
        problem = RankProblem(CYCLIC, lens, rank, world)
        assert problem.one_piece()
        landing.clear()
        out_r, dq_r, dkv_r = _rank_backward(problem, q, k, v, grad_out, landing_late=True)
        assert len(landing) == 1 and landing[0] is not None and landing[0].present == _present(problem)
        # the same bits as the backward over keys that are all there (the programs only start in another order)
        _, dq_ref, dkv_ref = _rank_backward(problem, q, k, v, grad_out, landing_late=False)
        assert torch.equal(dq_r, dq_ref) and torch.equal(dkv_r, dkv_ref)
        index = problem.token_index.to(q.device)
        gathered = problem.gathered_positions().to(q.device)
        out[:, :, index], dq[:, :, index] = out_r, dq_r.float()
        dk[:, :, gathered] += dkv_r[:, :kv_heads].float()
        dv[:, :, gathered] += dkv_r[:, kv_heads:].float()
    for t, g in ((q, dq), (k, dk), (v, dv)):
        t.grad = g.to(t.dtype)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, seq))


def test_other_kernels_wait_for_the_keys_on_the_stream(monkeypatch, device):
    """Where the dK/dV pass is not the Gluon two-pass kernel (here the tl one, as on a CPU), the backward waits for
    every key before its first pass, and hands dK/dV over before the dQ pass."""
    events = []
    record_backward_passes(monkeypatch, events)
    problem = RankProblem(CYCLIC, (9, 30, 21), 0, 2, tile=16)
    gen = torch.Generator().manual_seed(3)
    seq = 60
    q, k, v, do = (torch.randn(1, 2, seq, 16, generator=gen).to(device, torch.half) for _ in range(4))
    index, gathered = problem.token_index, problem.gathered_positions()
    x = [t[:, :, index] for t in (q, k, v, do)]

    def gather():
        return k[:, :, gathered], v[:, :, gathered]

    def arriving():
        return (*gather(), KeysArrival(torch.zeros(1, dtype=torch.int32, device=device), 1, _present(problem),
                                       lambda: events.append("wait")))

    pieces = problem.pieces(q.device)
    o_l, lse_l = forward_pieces(*x[:3], pieces, [None], 16**-0.5, 0.0, gather)
    events.clear()
    dq_a, _, dkv_a = backward_pieces(x[3], *x[:3], o_l, lse_l, pieces, [None], 16**-0.5, 0.0, gather,
                                     on_kv_grads=lambda *_: events.append("return"), arriving=arriving)
    assert events == ["wait", "dkdv", "return", "dq"]
    dq_b, _, dkv_b = backward_pieces(x[3], *x[:3], o_l, lse_l, pieces, [None], 16**-0.5, 0.0, gather)
    assert torch.equal(dq_a, dq_b) and torch.equal(dkv_a, dkv_b)
