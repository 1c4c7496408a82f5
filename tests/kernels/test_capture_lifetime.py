"""A CUDA graph owns what it reads (GPU): a capture that outlives ``clear_caches()`` (or the eviction of its mask)
replays exactly, and the backward's side stream is none of the streams torch's pool hands out, so it can never be
another caller's. Lengths past SHORT_KEYS so that the dQ pass runs on the side stream."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from mmsparse import clear_caches, mbs_attention
from mmsparse.attention.backward import _streams
from mmsparse.runtime import capture
from tests.helpers import make_qkv

pytestmark = pytest.mark.gpu

HUB = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]
LENS = (300, 1500, 700)
SEQ = sum(LENS)


def _step(q, k, v, lens, grad_out):
    """(out, dq, dk, dv) of one call at ``lens``."""
    return _step_with(lambda q, k, v: mbs_attention(q, k, v, HUB, lens, check_lengths=False), q, k, v, grad_out)


def _step_with(attention, q, k, v, grad_out):
    """(out, dq, dk, dv) of one call of ``attention(q, k, v)``, detached: a kept autograd graph would keep the
    leaves' gradient accumulators on the stream they were made on, which a later capture on another stream cannot
    use."""
    for t in (q, k, v):
        t.grad = None
    out = attention(q, k, v)
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _overwrite_freed_memory():
    """Allocate what the caching allocator freed and fill it with garbage, as a program's next tensors would."""
    junk = [torch.full((n,), -7, dtype=torch.int32, device="cuda") for n in (16, 64, 256, 1024, 4096, 16384)
            for _ in range(64)]
    torch.cuda.synchronize()
    return junk


def _replay_after_clear_caches(graph, captured, expected):
    """``clear_caches()``, the freed memory overwritten, the captured outputs poisoned: the replay must give
    ``expected`` bit for bit."""
    clear_caches()
    gc.collect()
    junk = _overwrite_freed_memory()
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "dq", "dk", "dv"), captured, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"replayed {name} after clear_caches differs")
    del junk


@pytest.mark.parametrize("lengths", ["host", "device"], ids=["cached-mask", "mask-built-in-capture"])
def test_a_capture_replays_exactly_after_clear_caches(lengths):
    """Host lengths: the capture reads the cached mask (token tensors, block lists). Device lengths: the mask is
    built inside the capture from the cached topology's tables. Both are dropped by ``clear_caches()``."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    grad_out = torch.randn(q.shape, generator=gen).to(dev, torch.bfloat16)
    lens = LENS if lengths == "host" else torch.tensor(LENS, device=dev)
    expected = [t.clone() for t in _step(q, k, v, lens, grad_out)]  # warms up: kernels, the mask, its lists
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(q, k, v, lens, grad_out)
    _replay_after_clear_caches(graph, captured, expected)
    del captured
    kept = capture.kept_count()
    assert kept > 0, "the capture kept nothing of what it reads"
    del graph
    gc.collect()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10  # the driver runs the destructor after the graph is gone, on its own thread
    while capture.kept_count() >= kept and time.monotonic() < deadline:
        time.sleep(0.01)
    assert capture.kept_count() < kept, "what the capture kept outlived its graph"


def _compiled_step_inputs(seed: int):
    """A compiled attention over host lengths (traced afresh) and its inputs and output gradient."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, HUB, LENS), fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, torch.device("cuda"), gen)
    return compiled, q, k, v, torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)


def test_a_compiled_capture_reads_the_kept_mask_and_replays_exactly_after_clear_caches():
    """A compiled step over host lengths reads the kept mask of those lengths in its ops (the graph makes none):
    the capture reads the one kept before it, holds it, and replays exactly after ``clear_caches()`` drops the
    kept masks."""
    compiled, q, k, v, grad_out = _compiled_step_inputs(3)
    expected = [t.clone() for t in _step_with(compiled, q, k, v, grad_out)]  # compiles; builds the kept mask
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step_with(compiled, q, k, v, grad_out)
    _replay_after_clear_caches(graph, captured, expected)


def test_a_compiled_capture_without_a_kept_mask_says_to_warm_up():
    """Nothing is built in a capture: a compiled step whose kept mask was dropped before the capture raises a
    RuntimeError that says to run the step once outside the capture, not a capture error from inside."""
    compiled, q, k, v, grad_out = _compiled_step_inputs(4)
    expected = [t.clone() for t in _step_with(compiled, q, k, v, grad_out)]  # compiled outside the capture
    clear_caches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="Run the step once before capturing it"):
        with torch.cuda.graph(graph):
            _step_with(compiled, q, k, v, grad_out)
    torch.cuda.synchronize()
    for got, want in zip(_step_with(compiled, q, k, v, grad_out), expected):  # the next step builds it again
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_side_streams_are_none_of_the_pools_streams():
    """Once a program has drawn every stream of torch's pool (32 a priority), a new pool stream is one someone
    holds: a side stream must not come from there."""
    dev = torch.device("cuda")
    pool = [torch.cuda.Stream() for _ in range(64)] + [torch.cuda.Stream(priority=-1) for _ in range(64)]
    held = {s.cuda_stream for s in pool} | {torch.cuda.current_stream().cuda_stream}
    for caller in pool[:4]:
        with torch.cuda.stream(caller):
            main, side = _streams(dev)
        assert main.cuda_stream == caller.cuda_stream
        assert side.cuda_stream not in held, "the side stream is a stream of torch's pool, held by another caller"
        held.add(side.cuda_stream)


def test_captures_beside_eager_calls_on_every_pool_stream():
    """Thread A captures forward + backward on a pool stream, again and again, while thread B runs eager calls
    of another mask on each of the other pool streams in turn. A side stream from the pool would be one of B's
    streams: B's kernels would then be launched into A's capture (or fail it). Replays and eager calls are exact."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    qa, ka, va = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    qb, kb, vb = make_qkv(1, 4, 2, SEQ, SEQ, 64, torch.bfloat16, dev, gen)
    grad_out = torch.randn(qa.shape, generator=gen).to(dev, torch.bfloat16)
    pool = [torch.cuda.Stream() for _ in range(32)]
    other = (700, 1100, 700)
    expected_b = [t.clone() for t in _step(qb, kb, vb, other, grad_out)]
    expected_a = [t.clone() for t in _step(qa, ka, va, LENS, grad_out)]
    torch.cuda.synchronize()
    errors, stop, rounds = [], threading.Event(), {"captures": 0, "eager": 0}

    def captures() -> None:
        try:
            for _ in range(10):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=pool[0], capture_error_mode="thread_local"):
                    captured = _step(qa, ka, va, LENS, grad_out)
                graph.replay()
                torch.cuda.synchronize()
                for name, got, want in zip(("out", "dq", "dk", "dv"), captured, expected_a):
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"replayed {name} differs")
                rounds["captures"] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            stop.set()

    def eager() -> None:
        try:
            while not stop.is_set():
                for stream in pool[1:]:
                    with torch.cuda.stream(stream):
                        got = _step(qb, kb, vb, other, grad_out)
                        for want, t in zip(expected_b, got):
                            assert torch.equal(t, want), "an eager call beside a capture differs"
                    rounds["eager"] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=captures), threading.Thread(target=eager)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert rounds["captures"] == 10 and rounds["eager"] > 0, rounds
