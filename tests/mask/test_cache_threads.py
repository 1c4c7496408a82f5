"""The mask cache and a mask's size under threads, with many entries and a thread switch every microsecond.

A hit moved its entry to the newest end without the cache's lock while a store, holding it, iterated the entries
("OrderedDict mutated during iteration"); a mask measured its size by iterating its tables of block lists and tile
classes while another thread's call added to them ("dictionary changed size during iteration")."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from mmsparse.mask.build import build_mask_info
from mmsparse.mask.cache import CACHE, MaskCache

ENTRIES = 64


@pytest.fixture
def switch_often() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


class SlowSize:
    """A cached value whose size takes a while to measure, as a large mask's does: stores last longer."""

    def __init__(self, size: int) -> None:
        self.size = size

    @property
    def nbytes(self) -> int:
        for _ in range(20):  # Python steps: threads switch here
            pass
        return self.size


def _run_threads(workers: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers))

    def run(work: Callable[[], None]) -> None:
        try:
            barrier.wait()
            work()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    return errors


def test_hits_and_stores_from_many_threads(switch_often):
    """Six threads hit 64 entries while two store new ones (each store evicts one): no thread raises, every hit
    gets its own key's value, and the cache keeps its bounds."""
    cache = MaskCache(max_entries=ENTRIES)
    for n in range(ENTRIES):
        cache.store_value(n, SlowSize(n))

    def hits(offset: int) -> Callable[[], None]:
        def work() -> None:
            for i in range(20000):
                key = (i * 7 + offset) % (2 * ENTRIES)
                value = cache.value(key)
                assert value is None or value.size == key, (key, value.size)
        return work

    def stores(offset: int) -> Callable[[], None]:
        def work() -> None:
            for i in range(3000):
                key = (i * 2 + offset) % (2 * ENTRIES)
                cache.store_value(key, SlowSize(key))
        return work

    errors = _run_threads([hits(n) for n in range(6)] + [stores(n) for n in range(2)])
    assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
    assert len(cache) <= ENTRIES


def test_a_masks_size_while_another_thread_adds_to_it(device, switch_often):
    """One thread classifies a mask's tiles at many sizes (each a new entry of its tables) while others measure
    it: no measure raises, and once the tables are full the size counts every one of them."""
    info = build_mask_info([[1, 1], [0, 1]], torch.tensor([[40, 24]]), 64, 64, False, device)
    done = threading.Event()

    def classify() -> None:
        try:
            for block_m in range(1, 33):
                for block_n in range(1, 17):
                    info.classes(block_m, block_n)
        finally:
            done.set()

    def measure() -> None:
        while not done.is_set():
            assert info.nbytes > 0

    errors = _run_threads([classify, measure, measure, measure])
    assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
    held = [*info.tensors(), *(t for pair in list(info._classes.values()) for t in pair)]
    assert len(list(info._classes.values())) == 32 * 16
    assert info.nbytes == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())


def test_masks_through_the_cache_from_many_threads(device, switch_often):
    """Eight threads build and hit 32 masks through the package's cache (each build runs the interpreter, slowly
    with threads switching this often: fewer masks than the other tests' entries)."""
    lengths = [(n + 1, 69 - n) for n in range(ENTRIES // 2)]

    def work(offset: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(20 * len(lengths)):
                lens = lengths[(i * 5 + offset) % len(lengths)]
                info = build_mask_info([[1, 1], [0, 1]], lens, 70, 70, False, device)
                assert info.seq_k == 70 and int(info.k_bits[0, lens[0]]) == 2 and int(info.k_bits[0, lens[0] - 1]) == 1
        return run

    with CACHE.limits(max_entries=ENTRIES):
        errors = _run_threads([work(n) for n in range(8)])
    assert not errors, f"{len(errors)} thread(s) failed, first: {errors[0]!r}"
