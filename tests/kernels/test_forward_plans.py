"""The forward keeps one launch plan per (mask, shapes, strides, dtype, scale, dropout): a later call with other
strides, heads or scale on the same cached mask must get its own plan, never a stale one."""

from __future__ import annotations

import pytest
import torch

from mmsparse import clear_caches, mbs_attention
from mmsparse.attention.kernel_args import kernel_args
from mmsparse.mask.build import build_mask_info
from mmsparse.runtime import launch
from tests.helpers import HUB, check_against_reference, make_qkv

LENS = (5, 9, 7)
S = sum(LENS)


@pytest.fixture(autouse=True)
def fresh_masks():
    clear_caches()  # plans live on the cached masks: count only this test's


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values stored [B, S, H, D] (the layout of a fused projection), viewed [B, H, S, D]."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


def test_plans_follow_layout_heads_and_scale(device):
    calls = [
        # (heads, kv_heads, transposed, softmax_scale)
        (2, 2, False, None),
        (2, 2, False, None),  # the same key: the plan is reused
        (2, 2, True, None),  # other strides
        (2, 2, False, 0.3),  # another scale
        (4, 2, False, None),  # GQA: other heads
        (2, 2, True, None),
        (2, 2, False, None),
    ]
    generator = torch.Generator().manual_seed(0)
    for heads, kv_heads, transposed, scale in calls:
        q, k, v = make_qkv(2, heads, kv_heads, S, S, 16, torch.float32, device, generator)
        if transposed:
            q, k, v = _transposed(q), _transposed(k), _transposed(v)
        check_against_reference(q, k, v, HUB, LENS, softmax_scale=scale)
    assert len(kernel_args(build_mask_info(HUB, LENS, S, S, False, q.device)).calls) == 4


def test_decode_plans_split_and_combine(device):
    """A short query block over the keys, alone on its head: the plan launches the split forward and the combine."""
    seq_q = 1
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        q, k, v = make_qkv(1, 2, 1, seq_q, S, 16, torch.float32, device, generator)
        check_against_reference(q, k, v, HUB, LENS, causal=True)
    (call,) = kernel_args(build_mask_info(HUB, LENS, seq_q, S, True, q.device)).calls.values()
    plan = call.forward
    if device.type == "cpu":
        assert plan.n_splits > 1


@pytest.mark.gpu
def test_repeated_call_skips_the_launch_path():
    """After the first call a plan launches through the compiled kernel's launcher directly."""
    dev = torch.device("cuda")
    q, k, v = make_qkv(2, 2, 2, S, S, 64, torch.bfloat16, dev)
    check_against_reference(q, k, v, HUB, LENS)
    before = launch.fast_launches
    q, k, v = make_qkv(2, 2, 2, S, S, 64, torch.bfloat16, dev)
    with torch.no_grad():
        mbs_attention(q, k, v, HUB, LENS)
    assert launch.fast_launches - before == 1
