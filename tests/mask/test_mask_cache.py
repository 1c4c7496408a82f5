"""The one cache: least recently used out first past its byte or entry bound, masks by the current stream,
pickled as its bounds only."""

import pickle

import torch

from mmsparse.mask.build import build_mask_info
from mmsparse.mask.cache import MaskCache


def test_bytes_bound_evicts_the_least_recently_used():
    cache = MaskCache(max_bytes=3000, max_entries=100)
    for name in "abc":
        cache.store_value(name, torch.zeros(250, dtype=torch.int32))  # 1000 bytes each
    assert len(cache) == 3 and cache.nbytes == 3000
    assert cache.value("a") is not None  # a is now the most recent
    cache.store_value("d", torch.zeros(250, dtype=torch.int32))
    assert cache.value("b") is None and all(cache.value(k) is not None for k in "acd") and cache.nbytes == 3000


def test_entry_bound_and_limits():
    cache = MaskCache(max_bytes=1 << 30, max_entries=2)
    with cache.limits(max_entries=3):
        for name in "abcd":
            cache.store_value(name, name)
        assert len(cache) == 3 and cache.value("a") is None
    assert cache.max_entries == 2
    cache.store_value("e", "e")
    assert len(cache) == 2 and cache.value("e") == "e"


def test_masks_are_measured_with_the_lists_they_built(device):
    cache = MaskCache()
    info = cache.store_mask("m", build_mask_info([[1, 1], [0, 1]], (40, 24), 64, 64, True, device))
    tokens = cache.nbytes
    assert tokens >= 2 * 64 * 4  # row and column bits
    info.prepare([(16, 16, False), (16, 16, True)])
    cache.store_value("next", torch.zeros(1))  # the newest entry is measured again now
    assert cache.nbytes > tokens + 4 and cache.mask("m") is info and cache.masks() == [info]


def test_pickles_as_its_bounds():
    cache = MaskCache(max_bytes=123, max_entries=7)
    cache.store_value("a", torch.zeros(3))
    again = pickle.loads(pickle.dumps(cache))
    assert (again.max_bytes, again.max_entries, len(again)) == (123, 7, 0)
