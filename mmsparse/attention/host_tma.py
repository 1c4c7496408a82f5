"""Host-side TMA descriptors for the Gluon kernels: one per ``[B, H, S, D]`` tensor, with ``[1, 1, rows, D_pad]``
boxes that a program addresses as ``[b, h, row, 0]``.

A descriptor made on the host reaches every program as a launch parameter. Made in the kernel instead, each
program would write and fence its own four to six descriptors before its first load; on an H100 the host-side ones
make the Gluon forward 1.04-1.08x, the dQ pass 1.05-1.11x and the dK/dV pass up to 1.03x faster
(docs/performance.md). The box reads rows past S and columns past D as zeros and drops writes there, per (b, h):
a tile never touches the next head's rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


@functools.cache
def _box_layout(rows: int, width: int, dtype: torch.dtype, rank: int = 4) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([1] * (rank - 2) + [rows, width], _GL_DTYPES[dtype])


def box_descriptor(t: torch.Tensor, rows: int, width: int) -> TensorDescriptor:
    """The descriptor of ``t`` ([B, H, S, D], half precision, unit stride in D, 16-byte aligned base and strides,
    as ``kernel_layout`` leaves the inputs and as fresh outputs are) with ``[1, 1, rows, width]`` boxes.

    Built without ``TensorDescriptor``'s own checks: they cost ~6 us per descriptor, six per backward, on calls
    whose host time decides the wall time (the seed config). A tensor that breaks the alignment rules still fails
    loudly: the launcher's ``cuTensorMapEncodeTiled`` rejects it."""
    desc = object.__new__(TensorDescriptor)
    desc.base = t
    desc.shape = t.shape
    desc.strides = t.stride()
    desc.block_shape = [1, 1, rows, width]
    desc.layout = _box_layout(rows, width, t.dtype)
    desc.padding = "zero"
    return desc


def head_rows_descriptor(t: torch.Tensor, rows: int, width: int) -> TensorDescriptor:
    """The descriptor of ``t`` ([B, H, S, D], float32 or half precision, B and H contiguous to each other, rules as
    :func:`box_descriptor`'s) seen as ``[B * H, S, D]``, with ``[1, rows, width]`` boxes that a program addresses as
    ``[b * H + h, row, col]``: one coordinate fewer to hold than ``[b, h, row, col]``; rows past S and columns past
    D are still dropped per head, and each coordinate stays 32-bit however large ``t`` is."""
    batch, heads, seq, dim = t.shape
    if t.stride(0) != heads * t.stride(1):
        raise ValueError(
            f"head_rows_descriptor: batch and head must be contiguous to each other (stride(0) == H * "
            f"stride(1)), e.g. a contiguous tensor; got shape {tuple(t.shape)}, strides {t.stride()}"
        )
    desc = object.__new__(TensorDescriptor)
    desc.base = t
    desc.shape = (batch * heads, seq, dim)
    desc.strides = t.stride()[1:]
    desc.block_shape = [1, rows, width]
    desc.layout = _box_layout(rows, width, t.dtype, 3)
    desc.padding = "zero"
    return desc


class HostBox(NamedTuple):
    """The box of a kernel's descriptor argument (``runtime.tma_args.Box``): ``rows`` x ``width``, over the tensor
    as ``[B, H, S, D]`` (:func:`box_descriptor`) or, with ``head_rows``, as ``[B * H, S, D]``
    (:func:`head_rows_descriptor`). A launcher passes the tensor and this box; the descriptor is made only where a
    launch needs one (a new value, or a launch through Triton)."""

    rows: int
    width: int
    head_rows: bool = False

    def describe(self, t: torch.Tensor) -> TensorDescriptor:
        if self.head_rows:
            return head_rows_descriptor(t, self.rows, self.width)
        return box_descriptor(t, self.rows, self.width)
