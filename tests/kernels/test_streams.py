"""Cached masks across CUDA streams: a mask built on stream A, its kernels queued behind a long one, then used on
stream B, must give B the finished mask (B waits for A), and the result must match the float64 reference (GPU).

A mask built from host lengths first copies them to the GPU, and that copy waits for A's queue, so the long kernel
is queued after the copy (``slow_builds``): the token bits, query starts and block lists then sit behind it.

On any device: the copy another stream gets (its own block lists over the same token-level tensors) is the same
mask, for each kind of mask."""

from __future__ import annotations

import pytest
import torch

from mmsparse import CAUSAL, TritonMBSAttnKernel, clear_caches, mbs_attention, reference_mask
from mmsparse.functional import attention_with_info
from mmsparse.mask import build
from mmsparse.mask.build import build_mask_info
from mmsparse.mask.cache import MaskCache
from tests.helpers import check_outputs, make_qkv

TOPOLOGY = [[1, 1, 0], [0, 1, 1], [1, 0, 1]]
SLEEP_CYCLES = 1 << 28  # ~0.15-0.2 s at GPU clocks: far longer than queueing B's forward and backward


@pytest.fixture
def slow_builds(monkeypatch):
    """While ``slow_builds["on"]``, a mask build queues a long kernel right after its lengths reach the GPU."""
    state = {"on": False}
    lens_tensor = build.lens_tensor

    def slow_lens_tensor(*args, **kwargs):
        lens = lens_tensor(*args, **kwargs)
        if state["on"]:
            torch.cuda._sleep(SLEEP_CYCLES)
        return lens

    monkeypatch.setattr(build, "lens_tensor", slow_lens_tensor)
    yield state
    torch.cuda.synchronize()


def _inputs(batch, heads, kv_heads, seq_q, seq, seed):
    dev = torch.device("cuda")
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q, seq, 64, torch.float16, dev, torch.Generator().manual_seed(seed))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dev, torch.float16)
    return q, k, v, grad_out


def _warm_up(attention, q, k, v, seq) -> None:
    """Run ``attention(q, k, v, lengths)`` forward and backward once with other lengths, then forget the masks: the
    kernels are compiled for exactly these shapes and the topology's tables are on the GPU, so nothing compiles or
    copies from the host (which would wait for the long kernel) once the streams run."""
    attention(q, k, v, (seq - 2, 1, 1)).sum().backward()
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    clear_caches()


def _streams() -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (a, b):
        s.wait_stream(torch.cuda.current_stream())  # the inputs, made on the default stream
    return a, b


@pytest.mark.gpu
def test_mask_built_on_one_stream_is_waited_for_on_another(slow_builds):
    dev, lens, seq = torch.device("cuda"), (300, 500, 224), 1024
    q, k, v, grad_out = _inputs(2, 4, 2, seq, seq, 0)
    _warm_up(lambda q, k, v, lens: mbs_attention(q, k, v, TOPOLOGY, lens, causal=True), q, k, v, seq)
    a, b = _streams()
    with torch.cuda.stream(a):
        slow_builds["on"] = True
        info = build_mask_info(TOPOLOGY, lens, seq, seq, True, dev)  # its kernels wait behind the long one
        slow_builds["on"] = False
        assert build_mask_info(TOPOLOGY, lens, seq, seq, True, dev) is info  # the building stream: the mask itself
    with torch.cuda.stream(b):
        out = mbs_attention(q, k, v, TOPOLOGY, lens, causal=True)
        out.backward(grad_out)
        on_b = build_mask_info(TOPOLOGY, lens, seq, seq, True, dev)
        assert on_b is not info and build_mask_info(TOPOLOGY, lens, seq, seq, True, dev) is on_b  # one copy for B
    torch.cuda.synchronize()
    check_outputs(q, k, v, out, grad_out, reference_mask(TOPOLOGY, lens, seq, seq, causal=True))


@pytest.mark.gpu
def test_default_query_start_is_filled_on_the_stream_that_reads_it(slow_builds):
    """Two masks with the same first-query position (the last seq_q positions) built on two streams: B's lengths
    differ, so B builds a mask of its own, but the position tensor used to be shared by every stream."""
    dev, seq, seq_q = torch.device("cuda"), 512, 77
    lens_a, lens_b = (100, 200, 212), (300, 100, 112)
    q, k, v, grad_out = _inputs(2, 4, 2, seq_q, seq, 2)
    _warm_up(lambda q, k, v, lens: mbs_attention(q, k, v, TOPOLOGY, lens, causal=True), q, k, v, seq)
    a, b = _streams()
    with torch.cuda.stream(a):
        slow_builds["on"] = True
        build_mask_info(TOPOLOGY, lens_a, seq_q, seq, True, dev)
        slow_builds["on"] = False
    with torch.cuda.stream(b):
        out = mbs_attention(q, k, v, TOPOLOGY, lens_b, causal=True)
        out.backward(grad_out)
    torch.cuda.synchronize()
    check_outputs(q, k, v, out, grad_out, reference_mask(TOPOLOGY, lens_b, seq, seq_q, causal=True))


@pytest.mark.gpu
def test_module_mask_built_on_one_stream_used_on_another(slow_builds):
    lens, seq = (64, 600, 360), 1024
    attn = TritonMBSAttnKernel(TOPOLOGY, lens, causal_mask=True)
    q, k, v, grad_out = _inputs(1, 4, 4, seq, seq, 4)
    _warm_up(lambda q, k, v, lens: attn(q, k, v, seg_lens=lens), q, k, v, seq)  # the module's own Topology
    a, b = _streams()
    with torch.cuda.stream(a):
        slow_builds["on"] = True
        on_a = attn(q.detach(), k.detach(), v.detach())  # builds and keeps the module's mask behind the long one
        slow_builds["on"] = False
    with torch.cuda.stream(b):
        out = attn(q, k, v)
        out.backward(grad_out)
    torch.cuda.synchronize()
    check_outputs(q, k, v, out, grad_out, reference_mask(TOPOLOGY, lens, seq, seq, causal=True))
    torch.testing.assert_close(on_a, out.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["bits", "per-sample", "q_start", "pair types"])
def test_a_stream_copy_is_the_same_mask(kind, device):
    """What another stream gets (``same_tensors``: the mask's tensors, no block list) gives the same outputs and
    gradients, bit for bit, as the mask it copies; off the GPU a cached mask is always the mask itself."""
    topology, lens, seq, seq_q, q_start = TOPOLOGY, (9, 20, 15), 44, 44, None
    if kind == "per-sample":
        lens = [(9, 20, 15), (30, 2, 5)]
    elif kind == "q_start":
        seq_q, q_start = 3, [40, 30]
    elif kind == "pair types":
        topology = [[CAUSAL, 1, 0], [0, CAUSAL, 1], [1, 0, 1]]
    info = build_mask_info(topology, lens, seq_q, seq, True, device, q_start=q_start)
    copy = info.same_tensors()
    assert type(copy) is type(info) and not copy._lists
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(copy.tensors(), info.tensors(), strict=True))
    assert (copy.batch, copy.seq_q, copy.seq_k, copy.causal) == (info.batch, info.seq_q, info.seq_k, info.causal)
    results = []
    for mask in (info, copy):
        q, k, v = make_qkv(2, 2, 1, seq_q, seq, 16, torch.float32, device, torch.Generator().manual_seed(6))
        out = attention_with_info(q, k, v, mask, None, 0.0)
        out.backward(torch.ones_like(out))
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if device.type == "cpu":
        cache = MaskCache()
        assert cache.store_mask("key", info) is info and cache.mask("key") is info


def test_a_kept_own_stream_is_made_once_per_key(monkeypatch):
    """Threads asking for the same key at once (the backward's side stream, the build stream) share the one stream
    made for it; another key gets its own (any device: the driver call is replaced)."""
    import threading

    from mmsparse.runtime import streams

    made = []

    def fake_own_stream(device_index):
        made.append(device_index)
        return object()

    monkeypatch.setattr(streams, "own_stream", fake_own_stream)
    kept, lock, got = {}, threading.Lock(), []
    start = threading.Barrier(8)

    def ask():
        start.wait()
        got.append(streams.kept_own_stream(kept, lock, (0, 7), 0))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(stream) for stream in got}) == 1 and made == [0]
    assert streams.kept_own_stream(kept, lock, (1, 7), 1) is not got[0] and made == [0, 1]
