"""The layouts of the tensors the attention kernels read and write: inputs read in place where the kernels can, one
aligned copy where not; outputs and gradients in their inputs' memory order."""

from __future__ import annotations

import torch


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``: 4-D. The kernels take any strides whose head dim is unit-stride and whose other strides are multiples
    of 8 elements on a 16-byte aligned base (every ordinary layout of a tensor with such a head dim); else one copy,
    in ``t``'s memory order where that can be read in place (:func:`output_like`)."""
    return t if read_in_place(t) else aligned_copy(t)


def read_in_place(t: torch.Tensor) -> bool:
    """The kernels read 4-D ``t`` as it is (:func:`kernel_layout` copies nothing)."""
    s = t.stride()
    return s[3] == 1 and not (s[0] | s[1] | s[2]) & 7 and not t.data_ptr() & 15


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in a new tensor that the kernels read in place (:func:`output_like`: torch's allocations
    are 16-byte aligned)."""
    copy = output_like(t)
    copy.copy_(t)
    return copy


def output_like(t: torch.Tensor) -> torch.Tensor:
    """A new 4-D tensor of ``t``'s shape and dtype that the kernels write and read in place: in
    ``t``'s memory order (as ``torch.empty_like`` lays it out, dense) where that keeps the head dim unit-stride and
    the other strides multiples of 8 elements, else contiguous. Outputs and gradients follow their inputs' layout
    this way, as SDPA's do: q, k, v seen as ``[B, H, S, D]`` in a ``[B, S, H, D]`` buffer (a layer's projections)
    give out, dq, dk and dv of that layout, whose transpose back to ``[B, S, H * D]`` is a view, not a copy. A
    function of ``t``'s shape and strides alone, so a traced op's fake outputs are laid out alike."""
    new = torch.empty_like(t)
    s = new.stride()
    if s[3] == 1 and s[0] % 8 == 0 and s[1] % 8 == 0 and s[2] % 8 == 0:
        return new
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def in_eights(strides: tuple[int, ...]) -> tuple[int, ...]:
    """Strides in units of 8 elements, as the tl kernels take those of their outputs and of dO
    (``kernels.tl.common.element_strides``); each is a multiple of 8 (:func:`read_in_place`, :func:`output_like`)."""
    return tuple(s // 8 for s in strides)


def output_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of :func:`output_like` of ``t``, worked out without allocating (once per launch)."""
    return output_like(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")).stride()
