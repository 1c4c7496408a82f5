"""CUDA-graph capture beside eager calls (GPU): work captured in a graph runs only when the graph replays, so
nothing built during a capture may reach an eager call (the block lists of a cached mask), and a capture in one
thread must not take in another caller's kernels (the backward's side stream). Lengths past SHORT_KEYS so that
the dQ pass runs on the side stream."""

from __future__ import annotations

import threading

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.config import SHORT_KEYS
from tests.helpers import assert_replay_matches_eager, check_outputs, make_qkv

pytestmark = pytest.mark.gpu

HUB = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]
LENS, OTHER_LENS = (300, 1500, 700), (700, 1100, 700)  # same total: OTHER_LENS warms the kernels up
SEQ = sum(LENS)
assert SEQ >= SHORT_KEYS


def _grads(q, k, v, lens, grad_out):
    for t in (q, k, v):
        t.grad = None
    out = mbs_attention(q, k, v, HUB, lens)
    out.backward(grad_out)
    return out


def test_eager_backward_before_replay_of_a_capture_that_built_its_lists():
    """An eager forward builds and caches the mask with its forward's lists; a capture of forward + backward then
    builds the backward's lists; an eager backward before the first replay must not read those (unwritten)."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    grad_out = torch.randn(q.shape, generator=gen).to(dev, torch.bfloat16)
    _grads(q, k, v, OTHER_LENS, grad_out)  # compiles every kernel, on another mask
    with torch.no_grad():
        mbs_attention(q, k, v, HUB, LENS)  # forward only: the backward's lists are not built
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _grads(q, k, v, LENS, grad_out)

    q2, k2, v2 = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    out = mbs_attention(q2, k2, v2, HUB, LENS)
    out.backward(grad_out)
    check_outputs(q2, k2, v2, out, grad_out, reference_mask(HUB, LENS, SEQ, SEQ))

    assert_replay_matches_eager(graph, captured, (q, k, v), lambda: _grads(q, k, v, LENS, grad_out))


def test_a_capture_in_one_thread_beside_eager_backwards_in_another():
    """Thread A captures forward + backward again and again while thread B runs eager forward + backward on a
    stream of its own. Autograd runs both backwards on its one thread of the device; the dQ pass of each caller's
    stream has its own side stream, so B's never joins A's capture (nor fails it), and both match."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    qa, ka, va = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    qb, kb, vb = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    grad_out = torch.randn(qa.shape, generator=gen).to(dev, torch.bfloat16)
    _grads(qb, kb, vb, LENS, grad_out)  # compiles and builds every list outside the capture
    expected = [qb.grad.clone(), kb.grad.clone(), vb.grad.clone()]
    _grads(qa, ka, va, LENS, grad_out)
    torch.cuda.synchronize()
    errors: list[BaseException] = []
    stop = threading.Event()
    rounds = {"captures": 0, "eager": 0}

    def capture() -> None:
        try:
            for _ in range(20):
                graph = torch.cuda.CUDAGraph()
                # thread_local: the other thread's own syncs and allocations stay legal during the capture
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    _grads(qa, ka, va, LENS, grad_out)
                graph.replay()
                rounds["captures"] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            stop.set()

    def eager() -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    _grads(qb, kb, vb, LENS, grad_out)
                    for want, t in zip(expected, (qb, kb, vb)):
                        assert torch.equal(t.grad, want), "an eager backward beside a capture differs"
                    rounds["eager"] += 1
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=capture), threading.Thread(target=eager)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert rounds["captures"] == 20 and rounds["eager"] > 0, rounds
