"""The host work of one call, counted rather than timed (a count cannot flake): a repeated call with host lengths
launches exactly the attention kernels and allocates exactly its outputs and one scratch tensor a pass, and
builds nothing; a call with new device lengths launches the mask builders once each.

Counted through the interpreter, where every launch goes through :class:`~mmsparse.runtime.launch.FastKernel`'s
``launch`` (on a GPU the bound relaunches skip it), and with a torch dispatch mode that sees every torch op the
call runs on the host side, outside the launches (the interpreter's own copies of the arguments are not the
call's work).
"""

from __future__ import annotations

import collections

import pytest
import torch

from mmsparse import mbs_attention
from mmsparse.runtime.launch import interpreter_active
from tests.helpers import TorchOps

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="counts the interpreter's launches (CPU)")

TOPOLOGY = [[1, 0, 0], [1, 1, 0], [1, 1, 2]]
LENGTHS = (24, 40, 32)
# The tl passes of one forward + backward. Through the interpreter the forward's key list is split over several
# programs (plan.num_splits: 8 programs are its bar), so the combine runs too. The dQ pass computes delta, which the
# dK/dV pass after it reads: no delta kernel.
ATTENTION_KERNELS = {"attention_fwd_tl": 1, "attention_combine_tl": 1, "attention_dq_tl": 1, "attention_dkdv_tl": 1}
# The split forward's partial out and lse; out, dq, dk, dv at their inputs' strides, and lse and delta contiguous.
# autograd's two detaches of the saved outputs are its own.
STEADY_OPS = {"aten.empty.memory_format": 2, "aten.empty_strided.default": 6, "aten.detach.default": 2}


@pytest.fixture(autouse=True)
def plain_empty(monkeypatch):
    """torch's empty factories without the test session's NaN poison (tests/poison.py), whose fills are not the
    call's work."""
    for name in ("empty", "empty_strided", "empty_like"):
        factory = getattr(torch, name)
        monkeypatch.setattr(torch, name, getattr(factory, "__wrapped__", factory))


def _step(q, k, v, grad_out, seg_lens, launches) -> collections.Counter[str]:
    launches.clear()
    with TorchOps() as mode:
        out = mbs_attention(q, k, v, TOPOLOGY, seg_lens)
        torch.autograd.grad(out, (q, k, v), grad_out)
    return mode.ops


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 96, 32, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(1, 2, 96, 32, generator=g)


def test_a_repeated_call_launches_the_passes_and_allocates_their_outputs_only(launches):
    q, k, v, grad_out = _inputs(0)
    first = _step(q, k, v, grad_out, LENGTHS, launches)
    assert set(launches) > set(ATTENTION_KERNELS), "the first call builds the mask's lists"
    assert first["aten.empty.memory_format"] > STEADY_OPS["aten.empty.memory_format"]
    for _ in range(2):
        ops = _step(q, k, v, grad_out, LENGTHS, launches)
        assert dict(launches) == ATTENTION_KERNELS
        assert dict(ops) == STEADY_OPS


def test_new_device_lengths_build_the_mask_once_a_call(launches):
    q, k, v, grad_out = _inputs(1)
    for lengths in ((24, 40, 32), (30, 30, 36), (10, 50, 36)):
        _step(q, k, v, grad_out, torch.tensor(lengths), launches)
        builders = {name: n for name, n in launches.items() if name not in ATTENTION_KERNELS}
        assert {name: n for name, n in launches.items() if name in ATTENTION_KERNELS} == ATTENTION_KERNELS
        # per call: the segment codes' runs, the run summaries and the block lists of the two list shapes the passes
        # read (the forward's and dQ's share one; dK/dV's is by key); on a GPU each lists' launch order one more
        # (mask.list_order; a CPU sorts in torch)
        assert builders == {"code_runs_kernel": 1, "run_summary_kernel": 2, "segment_lists_kernel": 2}, builders


def test_the_one_pass_backward_zeroes_its_dq_sum_in_the_delta_kernel(launches):
    """``deterministic=False``: the float32 dQ accumulator is zeroed by the delta kernel, not by a fill of its own
    (each launch costs a small call its host time); in float32 it is dQ itself, with no conversion after."""
    q, k, v, grad_out = _inputs(2)
    for _ in range(3):
        launches.clear()
        with TorchOps() as mode:
            out = mbs_attention(q, k, v, TOPOLOGY, LENGTHS, deterministic=False)
            torch.autograd.grad(out, (q, k, v), grad_out)
    assert dict(launches) == {**{name: 1 for name in ATTENTION_KERNELS if name != "attention_dq_tl"},
                              "attention_delta_tl": 1}
    # the float32 sum (contiguous, as q here) in place of dq
    assert dict(mode.ops) == {**STEADY_OPS, "aten.empty.memory_format": STEADY_OPS["aten.empty.memory_format"] + 1,
                              "aten.empty_strided.default": STEADY_OPS["aten.empty_strided.default"] - 1}
