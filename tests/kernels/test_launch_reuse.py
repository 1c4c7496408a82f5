"""Host work per call, counted rather than timed (counts cannot flake): a repeated call plans nothing, builds no
block list, and on a GPU launches every kernel straight through its bound launcher, never through Triton's
binding."""

from __future__ import annotations

import pytest
import torch

from mmsparse import clear_caches, mbs_attention, reference_mask
from mmsparse.attention import call
from mmsparse.attention.config import kernel_config
from mmsparse.attention.kernel_args import MAX_CALLS, kernel_args
from mmsparse.mask.build import build_mask_info
from mmsparse.mask.info import MaskInfo
from mmsparse.mask.lengths import lens_tensor
from mmsparse.runtime import launch
from tests.helpers import check_outputs, make_qkv

HUB, LENS = [[1, 1, 1], [1, 1, 0], [1, 0, 1]], (7, 20, 13)


@pytest.fixture
def counts(monkeypatch):
    """How often a call was planned, and how often a mask was asked to build lists."""
    seen = {"plans": 0, "prepares": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(call, "plan_attention", counting("plans", call.plan_attention))
    monkeypatch.setattr(MaskInfo, "prepare", counting("prepares", MaskInfo.prepare))
    return seen


def launches_through_triton(monkeypatch) -> list[str]:
    """The names of the kernels launched from now on through ``FastKernel.launch`` (Triton's key), not through a
    bound launcher."""
    names: list[str] = []
    original = launch.FastKernel.launch

    def counting(self, grid, args, kwargs):
        names.append(self.fn.__name__)
        return original(self, grid, args, kwargs)

    monkeypatch.setattr(launch.FastKernel, "launch", counting)
    return names


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_repeated_call_plans_and_builds_nothing(device, counts, deterministic):
    clear_caches()  # a cold mask: the first call plans and builds
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, device, torch.Generator().manual_seed(0))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    mbs_attention(q, k, v, HUB, LENS, deterministic=deterministic).backward(grad)
    # one plan for the call, read by its backward; the forward's lists and the backward's, built once each
    assert counts == {"plans": 1, "prepares": 2}
    for _ in range(3):
        mbs_attention(q, k, v, HUB, LENS, deterministic=deterministic).backward(grad)
    assert counts == {"plans": 1, "prepares": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("seg_lens", [(50, 375, 500), (700, 1500, 600)])  # below and past SHORT_KEYS
def test_a_repeated_call_launches_through_bound_launchers(monkeypatch, seg_lens):
    dev = torch.device("cuda")
    seq = sum(seg_lens)
    q, k, v = make_qkv(2, 4, 4, seq, seq, 64, torch.bfloat16, dev)
    grad = torch.randn_like(q)
    for _ in range(2):
        mbs_attention(q, k, v, HUB, seg_lens).backward(grad)
    through_triton = launches_through_triton(monkeypatch)
    before = launch.fast_launches
    for _ in range(3):
        mbs_attention(q, k, v, HUB, seg_lens).backward(grad)
    torch.cuda.synchronize()
    assert through_triton == [], through_triton
    assert launch.fast_launches - before >= 3 * 4  # forward, delta, dQ, dK/dV


def test_dynamic_batching_keeps_the_launches_of_every_batch_size(device, counts):
    """17 batch sizes over one mask, round after round: once each is planned, no round plans again (a cache
    that is cleared when full plans every call of every round)."""
    clear_caches()
    info = build_mask_info(HUB, LENS, sum(LENS), sum(LENS), False, device)
    config = kernel_config(16, torch.float32, device)
    for _ in range(3):
        for batch in range(1, 18):
            q = torch.empty(batch, 2, sum(LENS), 16, device=device)
            call.call_launch(q, q[:, :1], q[:, :1], info, 0.25, 0.0, None, True, config)
    assert counts["plans"] == 17


def test_the_least_recently_used_launch_goes_first(device):
    clear_caches()
    info = build_mask_info(HUB, LENS, sum(LENS), sum(LENS), False, device)
    config = kernel_config(16, torch.float32, device)
    calls = kernel_args(info).calls

    def launch(batch):
        q = torch.empty(batch, 1, sum(LENS), 16, device=device)
        return call.call_launch(q, q, q, info, 0.25, 0.0, None, True, config)

    first, second = launch(1), launch(2)
    for batch in range(3, MAX_CALLS + 1):
        launch(batch)
    assert launch(1) is first  # a hit: batch 1 is now the most recently used
    launch(MAX_CALLS + 1)  # full: batch 2, the least recently used, goes
    assert len(calls) == MAX_CALLS and launch(1) is first and launch(2) is not second


def test_new_lengths_every_call_share_one_launch(device, monkeypatch):
    """A training loop's lengths: a new tensor every call, so a new mask and new block lists every call. The
    launches (grids, constexprs, bound launchers) are found by what they specialise on and made once for every mask
    alike, while each call still reads its own mask's lists: the float64 reference of each call's lengths."""
    clear_caches()
    made = {"forward": 0, "backward": 0}

    def counted(cls, name):
        class Counted(cls):
            def __init__(self, *args, **kwargs):
                made[name] += 1
                super().__init__(*args, **kwargs)

        return Counted

    monkeypatch.setattr(call, "ForwardLaunch", counted(call.ForwardLaunch, "forward"))
    monkeypatch.setattr(call, "BackwardLaunch", counted(call.BackwardLaunch, "backward"))
    gen = torch.Generator().manual_seed(3)
    for lens in [(7, 20, 13), (12, 15, 13), (0, 31, 9), (7, 20, 13)]:
        q, k, v = make_qkv(2, 2, 1, 40, 40, 16, torch.float32, device, gen)
        out = mbs_attention(q, k, v, HUB, torch.tensor(lens, device=device), causal=True, check_lengths=False)
        grad = torch.randn(out.shape, generator=gen).to(device)
        out.backward(grad)
        check_outputs(q, k, v, out, grad, reference_mask(HUB, lens, 40, causal=True))
    assert made == {"forward": 1, "backward": 1}


def test_an_unchecked_length_tensor_is_not_read_back():
    """``check_lengths=False`` with one row of lengths as a tensor: the kernels read the tensor itself (a view),
    nothing goes through the host (on a GPU, a read would wait for every kernel queued before it)."""
    lens = torch.tensor([7, 20, 13])
    row = lens_tensor(lens, 3, 40, lens.device, check_lengths=False)
    assert row.shape == (1, 3) and row.data_ptr() == lens.data_ptr()
    # checked, it is read (and a sum that does not cover the sequence is refused)
    with pytest.raises(ValueError, match="sum"):
        lens_tensor(lens, 3, 41, lens.device)


@pytest.mark.gpu
@pytest.mark.parametrize("per_sample", [False, True])
def test_new_device_lengths_sync_nothing(monkeypatch, per_sample):
    """Device lengths new every call with ``check_lengths=False``: a forward and backward that never waits for the
    GPU (``torch.cuda.set_sync_debug_mode`` turns a sync into an error), with every kernel launched through a bound
    launcher but the block-list builders'."""
    dev = torch.device("cuda")
    q, k, v = make_qkv(2, 4, 2, 925, 925, 64, torch.bfloat16, dev)
    grad = torch.randn_like(q)
    rows = [(50, 375, 500), (100, 325, 500)] if per_sample else [(50, 375, 500)]
    # made before the checked calls: a copy from the host's pageable memory is a sync of its own
    fresh = iter([torch.tensor(rows if per_sample else rows[0], device=dev) for _ in range(4)])

    def step():
        mbs_attention(q, k, v, HUB, next(fresh), check_lengths=False).backward(grad)

    step()
    torch.cuda.synchronize()
    through_triton = launches_through_triton(monkeypatch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert through_triton and not [name for name in through_triton if name.startswith("attention_")], through_triton


def test_shared_launches_keep_each_masks_kind_apart(device):
    """Launches are kept by plan, shapes and the mask's integers, not by mask: calls that alternate between masks of
    other kinds (segment bits, segment codes with causal pairs, a window, per-sample rows) with new lengths every
    call each read their own mask, checked against the float64 reference."""
    clear_caches()
    gen = torch.Generator().manual_seed(11)
    codes = [[2, 1, 0], [0, 2, 1], [1, 0, 2]]  # causal pairs: the segment-code mask
    calls = [(HUB, [(7, 20, 13)], True, {}), (codes, [(10, 18, 12)], True, {}), (HUB, [(9, 20, 11)], False, {}),
             (HUB, [(5, 25, 10)], True, {"window": 9}), (codes, [(7, 20, 13), (0, 30, 6)], True, {}),
             (HUB, [(12, 15, 13)], True, {})]
    for topology, rows, causal, extra in calls:
        q, k, v = make_qkv(2, 2, 1, 40, 40, 16, torch.float32, device, gen)
        lens = torch.tensor(rows[0] if len(rows) == 1 else rows, device=device)
        out = mbs_attention(q, k, v, topology, lens, causal=causal, check_lengths=False, **extra)
        grad = torch.randn(out.shape, generator=gen).to(device)
        out.backward(grad)
        mask = reference_mask(topology, rows[0] if len(rows) == 1 else rows, 40, causal=causal, **extra)
        check_outputs(q, k, v, out, grad, mask)
