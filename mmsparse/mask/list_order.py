"""The order in which the attention kernels' programs take the row blocks of their block lists: longest list first.

A grid runs in waves, and the hardware starts each program as a multiprocessor frees up, in launch order. Launched
in block order, the long lists of a mask whose long rows come last (the keys every segment sees, the query blocks
at the end of a causal mask) start late and finish alone after the rest. Launched longest first, the short lists
fill each head's end (LPT scheduling, as FlashAttention-3/4's tile schedulers). The order is the fourth word of each
row of the lists' counts, so the kernels take no argument more; a program finds its row through it
(``kernels.lists.ordered_row``). The heads keep their launch order. Taken all at once instead, the programs running
together read every head's K and V and lost L2's reuse; taken a few at a time, a head derived from the order held
registers that a program id does not, and a dQ-writer variant spilled (``docs/performance.md``, "Launch order").
"""

from __future__ import annotations

import torch

from ..kernels.tl.list_order import list_order_kernel
from ..runtime.launch import FastKernel

_ORDER = FastKernel(list_order_kernel)
# Rows a program ranks, and the others it compares them with at a time: a [64, 128] tile of comparisons on a GPU
# (registers, one compiled kernel for every size). In the interpreter each tile op is one numpy call: tiles as large
# as the rows, up to 256 x 1024, which compiles nothing there.
_GPU_SIZES = (64, 128)
_INTERPRETER_MAX = (256, 1024)


def _interpreter_sizes(rows: int) -> tuple[int, int]:
    fit = max(16, 1 << (rows - 1).bit_length())
    return min(fit, _INTERPRETER_MAX[0]), min(fit, _INTERPRETER_MAX[1])


def write_launch_order(counts: torch.Tensor) -> None:
    """Write the launch order into block lists' ``counts`` (int32 ``[Bm, R, 4]``, contiguous): word 3 of row i of a
    sample is the sample's row with the i-th longest list (full + partial, words 0 and 1), ties in row order. On a
    GPU one launch (:func:`rank_rows`); on a CPU torch's stable sort, which gives the same order (through Triton's
    interpreter the kernel costs milliseconds a build, and builds are many in the CPU tests, which check the two
    against each other)."""
    if counts.device.type == "cuda":
        rank_rows(counts)
        return
    lengths = counts[..., :2].sum(-1, dtype=torch.int64)
    counts[..., 3] = torch.sort(lengths, dim=1, descending=True, stable=True).indices.to(torch.int32)


def rank_rows(counts: torch.Tensor) -> None:
    """:func:`write_launch_order` by ``list_order_kernel``: one launch (CUDA, or Triton's interpreter)."""
    samples, rows = counts.shape[0], counts.shape[1]
    if samples and rows:
        entries, chunk = _GPU_SIZES if counts.device.type == "cuda" else _interpreter_sizes(rows)
        _ORDER[(-(-rows // entries), samples)](counts, rows, E=entries, CHUNK=chunk)
