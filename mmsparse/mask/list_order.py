"""The order in which the attention kernels' programs take the row blocks of their block lists: longest list first.

A grid runs in waves, and the hardware starts each program as a multiprocessor frees up, in launch order. Launched
in block order, the long lists of a mask whose long rows come last (the keys every segment sees, the early key
blocks of a causal mask) finish alone on a few multiprocessors after the rest. Launched longest first, the short
lists fill the last wave (LPT scheduling, as FlashAttention-3/4's tile schedulers). The order is the fourth word of
each row of the lists' counts, so the kernels take no argument more; they map their program to a row block through
it (``kernels.lists.ordered_program``): heads a few at a time, as many as keep the rows they all read in L2, and
within them each row block for every head in turn.
"""

from __future__ import annotations

import torch

from ..kernels.tl.list_order import list_order_kernel
from ..runtime.launch import FastKernel, interpreter_active

_ORDER = FastKernel(list_order_kernel)
# Rows a program ranks, and the others it compares them with at a time: a [64, 128] tile of comparisons on a GPU
# (registers); larger in the interpreter, where each tile op is one numpy call.
_GPU_SIZES = (64, 128)
_INTERPRETER_SIZES = (256, 1024)


def write_launch_order(counts: torch.Tensor) -> None:
    """Write the launch order into block lists' ``counts`` (int32 ``[Bm, R, 4]``, contiguous): word 3 of row i of a
    sample is the sample's row with the i-th longest list (full + partial, words 0 and 1), ties in row order. One
    launch where the list kernels run (CUDA, or Triton's interpreter), torch's stable sort elsewhere; both give the
    same order."""
    samples, rows = counts.shape[0], counts.shape[1]
    if counts.device.type == "cuda" or interpreter_active():
        if samples and rows:
            entries, chunk = _INTERPRETER_SIZES if counts.device.type != "cuda" else _GPU_SIZES
            _ORDER[(-(-rows // entries), samples)](counts, rows, E=entries, CHUNK=chunk)
        return
    lengths = counts[..., :2].sum(-1, dtype=torch.int64)
    counts[..., 3] = torch.sort(lengths, dim=1, descending=True, stable=True).indices.to(torch.int32)
