"""Under a ``torch.func`` transform (grad, vmap, jacrev) the entry points raise a TypeError that says to use
torch.autograd, before they build anything: a call under one used to keep tables built from the transform's wrapper
tensors, so that every later call of the process failed, plain ones too."""

from __future__ import annotations

import pytest
import torch

import mmsparse
from mmsparse import mbs_attention, reference_attention, reference_mask
from tests.helpers import HUB, assert_close

LENS = (6, 7, 5)  # lengths no other test of the process has cached
S = sum(LENS)
MESSAGE = "does not run under torch.func transforms"


def test_transforms_are_refused_and_leave_later_calls_working(device):
    q, k, v = (torch.randn(1, 2, S, 16, device=device) for _ in range(3))
    transforms = {
        "grad": lambda: torch.func.grad(lambda q: mbs_attention(q, k, v, HUB, LENS).sum())(q),
        "vmap": lambda: torch.func.vmap(lambda q: mbs_attention(q[None], k, v, HUB, LENS)[0])(q.expand(3, -1, -1, -1)),
        "jacrev": lambda: torch.func.jacrev(lambda q: mbs_attention(q, k, v, HUB, LENS)[0, 0, 0])(q),
        "prepare_mask": lambda: torch.func.grad(
            lambda q: (mmsparse.prepare_mask(HUB, LENS, S, device=device), q.sum())[1])(q),
    }
    for call in transforms.values():
        with pytest.raises(TypeError, match=MESSAGE):
            call()
    out = mbs_attention(q, k, v, HUB, LENS)
    assert_close("out", out, reference_attention(q, k, v, reference_mask(HUB, LENS, S)), torch.float32)
