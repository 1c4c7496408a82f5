"""Host-side TMA descriptors of the Gluon kernels (mmsparse.ops.host_tma): what a kernel receives for a
[B, H, S, D] tensor. The kernels themselves need an sm_90 GPU (tests/test_hopper_*.py)."""

from __future__ import annotations

import pytest
import torch

from mmsparse.ops.host_tma import box_descriptor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_descriptor_describes_the_tensor_as_it_is_stored(dtype):
    q = torch.empty(2, 7, 3, 96, dtype=dtype).transpose(1, 2)  # [B, S, H, D] storage seen as [B, H, S, D]
    desc = box_descriptor(q, 64, 128)
    assert desc.base is q
    assert tuple(desc.shape) == (2, 3, 7, 96)  # the true head dim: TMA zero-fills the box past it
    assert tuple(desc.strides) == q.stride() == (7 * 3 * 96, 96, 3 * 96, 1)
    assert desc.block_shape == [1, 1, 64, 128]
    assert desc.padding == "zero"
    assert desc.layout.rank == 4 and desc.layout.element_bitwidth == 16 and desc.layout.swizzle_byte_width == 128


def test_layouts_are_shared_between_calls():
    """The layout is computed once per (box, dtype): Gluon's get_default_for costs ~18 us a call."""
    a = box_descriptor(torch.empty(1, 1, 8, 64, dtype=torch.bfloat16), 64, 64)
    b = box_descriptor(torch.empty(3, 2, 90, 64, dtype=torch.bfloat16), 64, 64)
    c = box_descriptor(torch.empty(1, 1, 8, 64, dtype=torch.bfloat16), 128, 64)
    assert a.layout is b.layout
    assert c.layout is not a.layout


def test_descriptor_matches_the_checked_constructor():
    """box_descriptor skips TensorDescriptor's checks for speed; on a valid tensor it must build the same object."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    k = torch.empty(2, 4, 130, 64, dtype=torch.bfloat16)
    fast = box_descriptor(k, 64, 64)
    checked = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, 64, 64], fast.layout)
    assert (list(fast.shape), list(fast.strides), fast.block_shape, fast.layout, fast.padding) == (
        checked.shape, checked.strides, checked.block_shape, checked.layout, checked.padding)
