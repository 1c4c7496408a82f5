"""A context-parallel rank's pieces carry their forward's settings and launches to the backward by value
(``PiecesCall``): a backward run outside the forward's ``use_tuning`` block, on another thread, still runs the
forward's tiles and plans nothing again. Every rank in one process (``RankProblem``)."""

from __future__ import annotations

import threading

import torch

from mmsparse import reference_mask
from mmsparse.attention import backward as backward_module
from mmsparse.attention import call as call_module
from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces
from mmsparse.distributed.pieces import PiecesCall
from mmsparse.tuning import KernelConfig, Tile, use_tuning
from tests.helpers import check_outputs

TOPOLOGY, LENS = [[1, 0, 1], [1, 1, 0], [0, 1, 1]], (9, 30, 21)
ODD = KernelConfig(fwd=Tile(16, 16), bwd_dkdv=Tile(16, 16), bwd_dq=Tile(16, 16), decode=Tile(16, 16))


def test_pieces_run_their_backward_with_the_forwards_settings(monkeypatch, device):
    backward_tiles, plans = [], []
    original_call, original_plan = backward_module.BackwardLaunch.__call__, call_module.plan_attention

    def recording_call(self, *args, **kwargs):
        backward_tiles.append((self.plan.dkdv.tile, self.plan.dq.tile))
        return original_call(self, *args, **kwargs)

    def counting_plan(*args, **kwargs):
        plans.append(args[0])
        return original_plan(*args, **kwargs)

    monkeypatch.setattr(backward_module.BackwardLaunch, "__call__", recording_call)
    monkeypatch.setattr(call_module, "plan_attention", counting_plan)
    seq, world = sum(LENS), 2
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, seq, 16, generator=gen).to(device) for _ in range(4))
    out = torch.full_like(q, float("nan"))
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    for rank in range(world):
        problem = RankProblem(TOPOLOGY, LENS, rank, world, tile=16)
        index, gathered = problem.token_index, problem.gathered_positions()
        pieces = problem.pieces(q.device)
        x = [t[:, :, index] for t in (q, k, v, do)]

        def gather(gathered=gathered):
            return k[:, :, gathered], v[:, :, gathered]

        with use_tuning(ODD):
            call = PiecesCall()
            o_l, lse_l = forward_pieces(*x[:3], pieces, [None] * len(pieces), 16**-0.5, 0.0, gather, call)
        planned = len(plans)
        result = []
        args = (x[3], *x[:3], o_l, lse_l, pieces, [None] * len(pieces), 16**-0.5, 0.0, gather, call)
        # outside the block, on another thread (as autograd's engine runs a backward)
        worker = threading.Thread(target=lambda args=args, result=result: result.append(backward_pieces(*args)))
        worker.start()
        worker.join()
        (dq_l, dkv_l, dkv_g), = result
        assert len(plans) == planned, "the backward planned its pieces again"
        out[:, :, index], dq[:, :, index] = o_l, dq_l.to(q.dtype)
        if dkv_l is not None:
            dk[:, :, index] += dkv_l[:, :2]
            dv[:, :, index] += dkv_l[:, 2:]
        dk[:, :, gathered] += dkv_g[:, :2]
        dv[:, :, gathered] += dkv_g[:, 2:]
    assert plans and all(config.fwd == ODD.fwd for config in plans)
    assert backward_tiles and all(tiles == (ODD.bwd_dkdv, ODD.bwd_dq) for tiles in backward_tiles), backward_tiles
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    for t, g in zip((qd, kd, vd), (dq, dk, dv)):
        t.grad = g
    check_outputs(qd, kd, vd, out, do, reference_mask(TOPOLOGY, LENS, seq))


def test_pieces_keep_the_two_passes_where_a_call_alone_runs_the_ordered_writer():
    """A context-parallel call's pieces plan the two passes over a mask whose ordered dQ writer would launch
    longest list first (where a call alone runs that writer by default: its one pass would end the landing of keys
    and the return of dK/dV beside the dQ pass), with the thread's other settings kept."""
    from mmsparse.attention.config import kernel_config
    from mmsparse.attention.plan import plan_attention
    from tests.helpers import writer_config

    cpu = torch.device("cpu")
    with use_tuning(writer_config(128), short_samples=1000):
        alone, call = kernel_config(128, torch.bfloat16, cpu), PiecesCall()
    pieces = kernel_config(128, torch.bfloat16, cpu, call.settings)
    assert alone.ordered_max_keys > 0 and pieces.ordered_max_keys == 0
    assert pieces.short_samples == 1000 and pieces.bwd_dkdv == alone.bwd_dkdv

    def plan(config):
        return plan_attention(config, 1, 4, 2, 8192, 8192, cpu, deterministic=True, longest_first=True)

    assert plan(alone).dkdv.ordered and plan(pieces).dq is not None and not plan(pieces).dkdv.one_pass
