"""Context-parallel calls on one process group from two threads at once are refused: each rank must make the
group's exchanges in one order, which two threads cannot keep. One thread's call may follow another's, and a
backward on autograd's thread follows the forward's. A world of one rank over gloo (CPU, the interpreter)."""

from __future__ import annotations

import threading

import pytest
import torch

import mmsparse.distributed.context_parallel as context_parallel
from mmsparse import reference_mask
from mmsparse.distributed import ContextParallel
from tests.helpers import HUB, check_outputs

LENS = (9, 20, 13)


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, sum(LENS), 16, generator=gen).requires_grad_() for h in (2, 1, 1)]


def test_a_second_thread_inside_a_call_on_the_group_is_refused(one_rank_world, monkeypatch):
    cp = ContextParallel(HUB, LENS, causal=True)
    inside, release = threading.Event(), threading.Event()
    real_fetch = context_parallel.start_fetch
    held = []

    def fetch_held_once(*args, **kwargs):
        if not held:  # the first call (thread A's forward) waits inside the exchange until released
            held.append(threading.get_ident())
            inside.set()
            release.wait(60)
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(context_parallel, "start_fetch", fetch_held_once)
    q, k, v = _inputs(0)
    result: dict[str, torch.Tensor] = {}
    a = threading.Thread(target=lambda: result.setdefault("out", cp.attention(q, k, v)))
    a.start()
    try:
        assert inside.wait(60)
        with pytest.raises(RuntimeError, match="running in another thread"):
            cp.attention(*_inputs(1))
        with pytest.raises(RuntimeError, match="running in another thread"):
            cp.unshard(torch.zeros(1, 2, sum(LENS), 16))
    finally:
        release.set()
        a.join(60)
    assert not a.is_alive() and held == [a.ident]

    # thread A's call is whole, and this thread's call after it runs: forward here, backward on autograd's thread
    out = result["out"]
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, LENS, sum(LENS), causal=True))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out2 = cp.attention(q2, k2, v2)
    out2.backward(grad_out)
    check_outputs(q2, k2, v2, out2, grad_out, reference_mask(HUB, LENS, sum(LENS), causal=True))


def test_a_thread_may_nest_calls_on_its_group(one_rank_world):
    """An activation-checkpoint recompute runs the forward inside the backward, on the same thread."""
    from torch.utils.checkpoint import checkpoint

    cp = ContextParallel(HUB, LENS, causal=True)
    q, k, v = _inputs(2)
    out = checkpoint(cp.attention, q, k, v, use_reentrant=False)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, LENS, sum(LENS), causal=True))
