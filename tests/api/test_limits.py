"""Past the stated limits a call gets a clear ValueError, never a launch that CUDA refuses or a wrong answer."""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention
from mmsparse.runtime.limits import MAX_BATCH_HEADS
from tests.helpers import CYCLIC


def test_too_many_batch_heads_is_a_clear_error(device):
    q = torch.randn(2, MAX_BATCH_HEADS // 2 + 1, 3, 16, device=device)
    k = torch.randn(2, 1, 3, 16, device=device)
    with pytest.raises(ValueError, match=r"batch x query heads = 2 x 32768 = 65536 .* at most 1 sample$"):
        mbs_attention(q, k, k, CYCLIC, (1, 1, 1))


@pytest.mark.gpu
def test_the_largest_batch_heads_runs():
    """65,535 programs on the second grid axis (too many for the interpreter in CI time)."""
    q = torch.randn(1, MAX_BATCH_HEADS, 3, 16, device="cuda")
    k = torch.randn(1, 1, 3, 16, device="cuda")
    out = mbs_attention(q, k, k, [[1]], (3,))
    ref = torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ k
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
