"""Masks go when nothing uses them: freed by reference counting alone, not left for the cyclic garbage collector.

A mask that has run a kernel holds its kernel arguments (``info.kernel_args``: per-tile arguments, call launches).
When those held the mask back, every mask formed a cycle, and a training loop with new lengths every step kept
each evicted cached mask and each mask built from a length tensor, with its token bits and block lists on the
device, until the collector's next full collection: on an H100 the soak (tests/stress/soak.py) grew by ~100 KB a
step and dropped back every ~1000 steps. Here the collector is off while the steps run, so any such cycle stays.
"""

from __future__ import annotations

import gc
import random
import weakref
from contextlib import contextmanager

import torch
from einops import rearrange

import mmsparse
from mmsparse import TritonMBSAttnKernel, functional, mbs_attention
from mmsparse.mask import build
from mmsparse.mask.cache import CACHE
from mmsparse.mask.info import MaskInfo
from mmsparse.nn import MultimodalSelfAttention

TOPOLOGY = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]


@contextmanager
def _no_cycle_collector():
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _live_masks() -> dict[int, MaskInfo]:
    """The masks alive by id, collectable ones included (the collector is off). Holding the result keeps their ids
    from going to new masks. ``type(o)``, not ``isinstance``: isinstance reads ``o.__class__``, and on one object
    torch keeps that read is itself a deprecated API (``torch.distributed.reduce_op`` warns on every attribute)."""
    return {id(o): o for o in gc.get_objects() if issubclass(type(o), MaskInfo)}


def _rows(rng: random.Random, batch: int, seq: int) -> list[tuple[int, int, int]]:
    rows = []
    for _ in range(batch):
        total = rng.randint(seq // 2, seq)
        text = rng.randint(1, total // 3)
        audio = rng.randint(0, total - text)
        rows.append((text, total - text - audio, audio))
    return rows


def test_a_mask_that_ran_forward_and_backward_is_freed_by_refcount(device):
    q, k, v = (torch.randn(2, 2, 24, 16, device=device, requires_grad=True) for _ in range(3))
    lens = torch.tensor([[4, 12, 8], [6, 10, 0]], dtype=torch.int32, device=device)
    with _no_cycle_collector():
        before = _live_masks()  # other tests' cached masks
        info = build.build_mask_info(TOPOLOGY, lens, 24, 24, True, device, check_lengths=False)
        mbs_attention(q, k, v, TOPOLOGY, lens, causal=True).sum().backward()  # builds its own mask, as the step
        out = functional.attention_with_info(q, k, v, info, None, 0.0)
        out.sum().backward()
        assert info.kernel_args is not None and info.kernel_args.calls  # it ran the kernels
        ref = weakref.ref(info)
        del info, out
        assert ref() is None, "the mask outlives its last user: a reference cycle keeps it"
        assert _live_masks().keys() <= before.keys()


def test_training_steps_with_new_lengths_keep_only_the_cached_masks(device):
    """The soak's two layer kinds (host lengths through the mask cache, device lengths built every call), new
    lengths every step: the masks alive are the cached ones, however many steps have run."""
    mmsparse.clear_caches()
    with CACHE.limits(max_entries=4):
        _steps_keep_only_cached_masks(device)


def _steps_keep_only_cached_masks(device):
    torch.manual_seed(0)
    rng = random.Random(0)
    batch, dim, heads = 2, 32, 2
    cached = MultimodalSelfAttention(dim, heads, TOPOLOGY, (4, 8, 4), num_kv_heads=1).to(device)
    kernel = TritonMBSAttnKernel(TOPOLOGY, (4, 8, 4), causal_mask=True)
    qkv = torch.nn.Linear(dim, 3 * dim).to(device)
    opt = torch.optim.AdamW([*cached.parameters(), *qkv.parameters()], lr=1e-3)

    def step():
        seq = rng.choice((16, 24, 32))
        rows = _rows(rng, batch, seq)
        lens = torch.tensor(rows, dtype=torch.int32).to(device)
        x = torch.randn(batch, seq, dim, device=device)
        h = cached(x, seg_lens=rows)
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", h=heads) for t in qkv(h).chunk(3, dim=-1))
        loss = kernel(q, k, v, seg_lens=lens, check_lengths=False).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with _no_cycle_collector():
        before = _live_masks()  # other tests' cached masks
        counts = []
        for _ in range(4):
            for _ in range(2):
                step()
            cached_masks = {id(mask) for mask in CACHE.masks()}
            new = _live_masks().keys() - before.keys()
            counts.append(len(new))
            assert new <= cached_masks, (
                f"{len(new)} masks alive, {len(cached_masks)} cached: masks that no cache holds are kept")
        assert 1 <= counts[-1] == counts[-2] <= CACHE.max_entries, counts  # flat once the cache is full


def test_clear_caches_forgets_masks_and_plans(device):
    """``mmsparse.clear_caches()`` drops every cached mask, topology and plan; the next call builds them again and
    gives the same result, bit for bit."""
    from mmsparse.attention.plan import plan_attention

    q = torch.randn(1, 2, 50, 16, device=device)
    before = mmsparse.mbs_attention(q, q, q, [[1, 0], [1, 1]], (20, 30))
    info = build.build_mask_info([[1, 0], [1, 1]], (20, 30), 50, 50, False, q.device)
    assert CACHE.masks() and len(CACHE) > len(CACHE.masks())  # the topology and first-query positions too
    assert plan_attention.cache_info().currsize
    mmsparse.clear_caches()
    assert not len(CACHE) and not plan_attention.cache_info().currsize
    assert build.build_mask_info([[1, 0], [1, 1]], (20, 30), 50, 50, False, q.device) is not info
    torch.testing.assert_close(mmsparse.mbs_attention(q, q, q, [[1, 0], [1, 1]], (20, 30)), before, rtol=0, atol=0)


def test_a_modules_masks_live_in_the_module_only(device):
    """A TritonMBSAttnKernel keeps its masks itself: the package's cache holds none of them, and they go with the
    module."""
    mmsparse.clear_caches()
    module = TritonMBSAttnKernel(TOPOLOGY, (4, 8, 4), causal_mask=True)
    q, k, v = (torch.randn(1, 2, 16, 16, device=device, requires_grad=True) for _ in range(3))
    module(q, k, v).sum().backward()
    (info,) = module._infos.masks()
    assert info.kernel_args is not None  # it ran the kernels
    assert not any(mask is info for mask in CACHE.masks(copies=True)), "the package's cache holds the module's mask"
    ref = weakref.ref(info)
    del info, module
    gc.collect()
    assert ref() is None, "the module's mask outlives the module"
