"""Saved-tensor hooks (activation offloading: ``save_on_cpu(pin_memory=True)``, torchtune's and Megatron's
offloading) hand the backward its saved q, k, v, out and lse in another layout than the forward saw: contiguous
copies of strided views, or views into a buffer of their own. Calls of one mask and shapes, some offloaded and
some not, in either order, must each get their own exact gradients: a backward reads the layout of the tensors it
is given, never one kept from another call."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.config import cuda_kernel_config
from mmsparse.tuning import use_tuning
from tests.helpers import check_outputs

CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]


def _contiguous_copies():
    """A hook that keeps a contiguous copy of each saved tensor (what pinned-memory offloading hands back)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().contiguous().clone(), lambda t: t)


def _misaligned_views():
    """A hook that keeps each saved tensor in a buffer of its own, one element past a 16-byte boundary, and hands
    back a view there: contiguous, but on a base the kernels cannot read as it is."""

    def pack(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:].copy_(t.detach().reshape(-1))
        return buf, t.shape

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[0][1:].view(packed[1]))


def _pinned_offload():
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def _views(batch, heads, seq, head_dim, dtype, device, generator):
    """Leaves q, k, v that are strided views of one ``[B, S, 3 H D]`` projection, as a layer's are."""
    x = torch.randn(batch, seq, 3 * heads * head_dim, generator=generator).to(device=device, dtype=dtype)
    q, k, v = (t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in x.split(heads * head_dim, dim=-1))
    return [t.requires_grad_() for t in (q, k, v)]  # views of a leaf-free tensor: leaves themselves


def _run_and_check(hook, seg_lens, head_dim, dtype, device, generator, heads=2):
    seq = sum(seg_lens)
    q, k, v = _views(2, heads, seq, head_dim, dtype, device, generator)
    assert not q.is_contiguous()
    with hook() if hook is not None else contextlib.nullcontext():
        out = mbs_attention(q, k, v, CYCLIC, seg_lens)
    grad_out = torch.randn(out.shape, generator=generator).to(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, seg_lens, seq))


CPU_HOOKS = {"contiguous-copies": _contiguous_copies, "misaligned-views": _misaligned_views}


@pytest.mark.parametrize("hook_first", [False, True], ids=["plain-first", "hooked-first"])
@pytest.mark.parametrize("hook", list(CPU_HOOKS), ids=list(CPU_HOOKS))
def test_hooked_and_plain_calls_of_one_mask_each_get_their_gradients(device, hook, hook_first):
    generator = torch.Generator().manual_seed(11)
    order = [CPU_HOOKS[hook], None] if hook_first else [None, CPU_HOOKS[hook]]
    for h in order:  # the second call reuses the first one's kept launch
        _run_and_check(h, (9, 20, 11), 16, torch.float32, device, generator)


# On an H200 (12 heads: enough programs for the forward not to split its key lists), bf16 at D=64 below
# SHORT_KEYS runs the Gluon forward and dK/dV passes beside the tl dQ pass; fp32 runs tl alone; the tl table runs
# every pass as tl.
GPU_CASES = {
    "bf16-D64-gluon-dkdv-tl-dq": (torch.bfloat16, 64, (300, 700, 500), None),
    "bf16-D128-long": (torch.bfloat16, 128, (700, 1500, 600), None),
    "bf16-D128-tl": (torch.bfloat16, 128, (700, 1500, 600), False),
    "fp32-D64": (torch.float32, 64, (300, 700, 500), None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("hook_first", [False, True], ids=["plain-first", "hooked-first"])
@pytest.mark.parametrize("hook", ["pinned-offload", "misaligned-views"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_offloaded_and_plain_calls_on_the_gpu(case, hook, hook_first):
    dtype, head_dim, seg_lens, gluon = GPU_CASES[case]
    device = torch.device("cuda")
    hooks = {"pinned-offload": _pinned_offload, "misaligned-views": _misaligned_views}
    order = [hooks[hook], None] if hook_first else [None, hooks[hook]]
    generator = torch.Generator().manual_seed(12)
    tuning = contextlib.nullcontext()
    if gluon is False:
        table = cuda_kernel_config(head_dim, dtype, torch.cuda.get_device_capability(), gluon=False)
        tuning = use_tuning(table)
    with tuning:
        for h in order:
            _run_and_check(h, seg_lens, head_dim, dtype, device, generator, heads=12)
