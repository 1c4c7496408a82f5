"""The tl dQ pass computes delta = rowsum(dO * O) itself where it runs first on one stream (``OWN_DELTA``); where the
dK/dV pass goes first (a context-parallel rank's exchange, ``ExchangeHooks``) the delta kernel computes it. Both
orders must give the same gradients, bit for bit: the same rowsum of the same products, read by the same passes."""

from __future__ import annotations

import pytest
import torch

from mmsparse.attention.backward import ExchangeHooks
from mmsparse.attention.call import call_launch
from mmsparse.attention.config import kernel_config
from mmsparse.mask.build import build_mask_info
from mmsparse.runtime.launch import interpreter_active
from tests.helpers import make_qkv

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="the tl passes through the interpreter (CPU)")


@pytest.mark.parametrize("causal, group, head_dim", [(False, 1, 32), (True, 2, 40)])
def test_delta_from_the_dq_pass_equals_the_delta_kernels(causal, group, head_dim):
    g = torch.Generator().manual_seed(7)
    seq = 96
    q, k, v = (t.detach() for t in make_qkv(1, 2 * group, 2, seq, seq, head_dim, torch.float32, torch.device("cpu"), g))
    do = torch.randn(q.shape, generator=g)
    info = build_mask_info([[1, 2, 0], [2, 1, 1], [1, 0, 2]], (20, 40, 36), seq, seq, causal, q.device)
    launch = call_launch(q, k, v, info, head_dim**-0.5, 0.0, None, True, kernel_config(head_dim, q.dtype, q.device))
    out, lse = launch.run_forward(q, k, v, None)
    own = launch.run_backward(info, do, q, k, v, out, lse, None)
    assert launch._backward.dq_owns_delta  # the plain call's dQ pass computes delta
    kernel = launch.run_backward(info, do, q, k, v, out, lse, None, ExchangeHooks())  # dK/dV first: the kernel's
    for name, a, b in zip(("dq", "dk", "dv"), own, kernel):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name
