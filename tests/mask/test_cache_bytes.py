"""The cache's byte bound counts what its masks hold now. A mask grows after it is stored (block lists and tile
classes built as its kernels run); it was measured only while it was the newest entry, so a mask that grew after a
later store stayed counted at its first size and the bound let the cache hold more than it says."""

from __future__ import annotations

import torch

from mmsparse.mask.build import build_mask_info
from mmsparse.mask.cache import MaskCache

TOPOLOGY = [[1, 1], [0, 1]]


def _mask(device: torch.device, first: int):
    # a length tensor: built afresh, in no cache
    return build_mask_info(TOPOLOGY, torch.tensor([[first, 64 - first]]), 64, 64, False, device)


def test_a_mask_that_grows_after_a_later_store_is_counted(device):
    masks = [_mask(device, n) for n in (10, 20, 30)]
    start = sum(m.nbytes for m in masks)
    cache = MaskCache(max_bytes=start + 1024)  # room for the three as built, not for a few KiB more
    cache.store_mask("oldest", masks[0])
    cache.store_mask("middle", masks[1])
    built = masks[0].nbytes
    masks[0].classes(1, 1)  # its tile classes at 1 x 1: two 64 x 64 bool tensors, 8 KiB
    assert masks[0].nbytes >= built + 8192
    cache.store_mask("newest", masks[2])
    assert cache.nbytes == sum(m.nbytes for m in cache.masks()), "the cache's count differs from its masks' sizes"
    assert cache.nbytes <= cache.max_bytes, f"{cache.nbytes} bytes held against a bound of {cache.max_bytes}"
    assert [m is masks[0] for m in cache.masks()] == [False, False], "the grown mask, least recently used, stays"


def test_the_count_follows_masks_as_they_grow(device):
    cache = MaskCache()
    masks = [_mask(device, n) for n in (5, 15)]
    for n, mask in enumerate(masks):
        cache.store_mask(n, mask)
    before = cache.nbytes
    masks[0].classes(2, 2)
    masks[1].classes(4, 1)
    assert cache.nbytes == sum(m.nbytes for m in masks) > before
