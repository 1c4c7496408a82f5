"""Eight Python threads call the functional API and the module at once, each with its own topology and lengths,
forward and backward, while the module-level mask caches are kept tiny (constant evictions and clears) and the
interpreter switches threads often. Every output and gradient is checked against the float64 reference, and no
thread may raise. A second test hammers the mask cache alone (a hit evicted by another thread before it moved
to the front raised KeyError)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from mmsparse import TritonMBSAttnKernel, mbs_attention, reference_mask
from mmsparse.mask.build import build_mask_info
from mmsparse.mask.cache import CACHE
from tests.helpers import check_outputs, make_qkv

# (topology, lengths A, lengths B, seq_q or None for all positions, causal, heads, kv_heads, dtype). Each thread
# calls with two sets of lengths, then its module with the first; with the shared module (each of its query counts
# asked for by two threads) the calls both hit and miss the caches.
CASES = [
    ([[1]], (40,), (33,), None, True, 2, 2, torch.float32),
    ([[1, 1], [0, 1]], (20, 28), (31, 17), None, False, 2, 1, torch.float16),
    ([[0, 1, 0], [0, 0, 1], [1, 0, 0]], (5, 30, 21), (12, 12, 30), None, False, 2, 2, torch.float32),
    ([[1, 1, 1], [1, 1, 0], [1, 0, 1]], (7, 9, 13), (16, 4, 9), 11, True, 4, 2, torch.bfloat16),
    ([[1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], (10, 0, 25, 12), (3, 19, 19, 6), None, True, 2, 2,
     torch.float16),
    ([[1, 1], [1, 1]], [(30, 20), (12, 9)], [(5, 45), (25, 25)], None, False, 2, 2, torch.float32),  # per sample
    ([[1, 0, 1], [0, 1, 1], [1, 1, 1]], (20, 20, 24), (2, 40, 22), 1, True, 4, 1, torch.float32),  # decoding
    ([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [1, 0, 0, 1, 0], [1, 1, 1, 1, 1]], (9, 9, 9, 9, 9),
     (20, 1, 1, 1, 22), None, False, 2, 2, torch.float16),
]
CALLS = 2  # functional calls per thread (lengths A, then B); then one through the thread's module and the shared one
SHARED_TOPOLOGY, SHARED_LENS = [[1, 1, 0], [0, 1, 1], [1, 0, 1]], (10, 20, 18)


@pytest.fixture
def contended():
    """Caches of two entries (every few calls evict or clear one another thread may be reading) and a thread
    switch every 10 us instead of 5 ms."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    with CACHE.limits(max_entries=2):
        yield
    sys.setswitchinterval(interval)


def _check(q, k, v, out, topology, lens, causal):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(out.numel())).to(out)
    out.backward(grad_out)
    mask = reference_mask(topology, lens, k.shape[2], q.shape[2], causal=causal)
    check_outputs(q, k, v, out, grad_out, mask)


def _worker(index: int, device: torch.device, shared: TritonMBSAttnKernel, barrier: threading.Barrier) -> None:
    topology, lens_a, lens_b, seq_q, causal, heads, kv_heads, dtype = CASES[index]
    generator = torch.Generator().manual_seed(index)
    batch = len(lens_a) if isinstance(lens_a, list) else 1  # a second sample of the same lengths adds only work
    barrier.wait()
    for call in range(CALLS):
        lens = lens_a if call % 2 == 0 else lens_b
        seq_k = max(sum(row) for row in lens) if isinstance(lens, list) else sum(lens)
        q, k, v = make_qkv(batch, heads, kv_heads, seq_q or seq_k, seq_k, 16, dtype, device, generator)
        out = mbs_attention(q, k, v, topology, lens, causal=causal)
        _check(q, k, v, out, topology, lens, causal)
    lens = lens_a if not isinstance(lens_a, list) else lens_a[0]
    module = TritonMBSAttnKernel(topology, lens, causal_mask=causal)
    q, k, v = make_qkv(1, heads, kv_heads, seq_q or sum(lens), sum(lens), 16, dtype, device, generator)
    _check(q, k, v, module(q, k, v), topology, lens, causal)
    # the shared module: one per-length cache for all threads; two threads at once ask for each query count, so
    # that one thread's miss races another's on the same entry
    seq_q_shared = sum(SHARED_LENS) - index // 2
    q, k, v = make_qkv(1, 2, 2, seq_q_shared, sum(SHARED_LENS), 16, torch.float32, device, generator)
    _check(q, k, v, shared(q, k, v), SHARED_TOPOLOGY, SHARED_LENS, False)


def test_eight_threads_forward_and_backward(device, contended):
    shared = TritonMBSAttnKernel(SHARED_TOPOLOGY, SHARED_LENS)
    barrier = threading.Barrier(len(CASES))
    errors: list[tuple[int, BaseException]] = []

    def run(index: int) -> None:
        try:
            _worker(index, device, shared, barrier)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((index, e))
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"mbs-{i}") for i in range(len(CASES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    if errors:
        index, first = errors[0]
        summary = "; ".join(f"thread {i}: {type(e).__name__}: {e}"[:300] for i, e in errors)
        raise AssertionError(f"{len(errors)} thread(s) failed: {summary}") from first


def test_mask_cache_hits_and_evictions_from_eight_threads(device, contended):
    """Five lengths through a cache of two, from eight threads: every call gets the mask of its own lengths."""
    topology, lengths = [[1, 1], [0, 1]], [(4 + n, 4) for n in range(5)]
    # length tensors are never cached: these are built afresh
    expected = [build_mask_info(topology, torch.tensor([lens]), sum(lens), sum(lens), False, device)
                for lens in lengths]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            for n in range(60):
                choice = (n + index) % len(lengths)
                lens = lengths[choice]
                info = build_mask_info(topology, lens, sum(lens), sum(lens), False, device)
                want = expected[choice]
                assert info.seq_k == sum(lens), (lens, info.seq_k)
                assert torch.equal(info.q_bits, want.q_bits) and torch.equal(info.k_bits, want.k_bits), lens
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
