"""``torch.compile(mode="reduce-overhead")`` (CUDA graphs over the compiled graph) on the GPU: the frozen plan's
list ops and attention ops are captured and replayed, forward and backward, with GQA, per-sample rows and keys past
SHORT_KEYS (the backward's side stream), each replay against the float64 reference; on Hopper also the ordered dQ
writer (``KernelConfig.ordered_dq_writer``, and deterministic=True's default over this mask), whose ranks a capture
builds and its replays rewrite."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.config import SHORT_KEYS, kernel_config
from mmsparse.tuning import use_tuning
from tests.helpers import HUB, check_outputs, make_qkv, ordered_config

SEQ = SHORT_KEYS + 64
ROWS = [(300, 1500, 200), (1000, 900, 150)]  # per sample, each at most SEQ tokens; the rest is padding


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic, tuning, ordered",
                         [(True, "two-pass", False), (False, None, False), (True, "ordered", True),
                          (True, None, None)],
                         ids=["two-pass", "one-pass", "ordered-dq-writer", "default"])
def test_reduce_overhead_replays_forward_and_backward(deterministic, tuning, ordered, writer_calls):
    """Forward and backward captured and replayed, over the two passes, the one pass, the ordered dQ writer and
    deterministic=True's default over this bit mask without the causal flag (the ordered writer on Hopper)."""
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if tuning == "ordered" and not hopper:
        pytest.skip("the ordered dQ writer is a Hopper kernel")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, HUB, ROWS, deterministic=deterministic),
                             mode="reduce-overhead", fullgraph=True)
    mask = reference_mask(HUB, ROWS, SEQ).to(device)
    gen = torch.Generator().manual_seed(0)
    config = {"ordered": ordered_config(64, torch.float16),
              "two-pass": replace(kernel_config(64, torch.float16, device), ordered_max_keys=0)}.get(tuning)
    with use_tuning(config):
        for _ in range(4):  # warm-up, capture, replays
            q, k, v = make_qkv(2, 4, 2, SEQ, SEQ, 64, torch.float16, device, gen)
            grad_out = torch.randn(q.shape, generator=gen).to(device, torch.float16)
            out = compiled(q, k, v)
            out.backward(grad_out)
            check_outputs(q, k, v, out.clone(), grad_out, mask)
    if ordered is None:  # the default: the ordered writer where the device's config has the dQ-writer kernel
        ordered = kernel_config(64, torch.float16, device).one_pass_runs_dq_writer(False)
    assert (True in writer_calls.ordered) == ordered
