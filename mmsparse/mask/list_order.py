"""The order in which the attention kernels' programs take the row blocks of their block lists: longest list first.

A grid runs in waves, and the hardware starts each program as a multiprocessor frees up, in launch order. Launched
in block order, the long lists of a mask whose long rows come last (the keys every segment sees, the early key
blocks of a causal mask) finish alone on a few multiprocessors after the rest. Launched longest first, the short
lists fill the last wave (LPT scheduling, as FlashAttention-3/4's tile schedulers). The kernels map their program to
a row block through this order (``kernels.lists.ordered_program``): heads a few at a time, as many as keep the
rows they all read in L2, and within them each row block for every head in turn.
"""

from __future__ import annotations

import torch

from ..kernels.tl.list_order import list_order_kernel
from ..runtime.launch import FastKernel, interpreter_active

_ORDER = FastKernel(list_order_kernel)
# Entries a program ranks, and the others it compares them with at a time: a [64, 128] tile of comparisons on a
# GPU (registers); larger in the interpreter, where each tile op is one numpy call.
_GPU_SIZES = (64, 128)
_INTERPRETER_SIZES = (256, 1024)


def longest_first(counts: torch.Tensor) -> torch.Tensor:
    """int32 ``[Bm, R]``: each sample's rows of block lists' ``counts`` (int32 ``[Bm, R, 3]``, contiguous: full,
    partial, start) by descending list length (full + partial), ties in row order. One launch where the list
    kernels run (CUDA, or Triton's interpreter), torch's stable sort elsewhere; both give the same order."""
    samples, rows = counts.shape[0], counts.shape[1]
    if counts.device.type == "cuda" or interpreter_active():
        order = torch.empty((samples, rows), dtype=torch.int32, device=counts.device)
        if order.numel():
            entries, chunk = _INTERPRETER_SIZES if counts.device.type != "cuda" else _GPU_SIZES
            _ORDER[(-(-rows // entries), samples)](counts, order, rows, E=entries, CHUNK=chunk)
        return order
    lengths = counts[..., :2].sum(-1, dtype=torch.int64)
    return torch.sort(lengths, dim=1, descending=True, stable=True).indices.to(torch.int32)
