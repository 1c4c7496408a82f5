"""Output allocation for the launchers. Tests set ``POISON = True`` so that every output starts as NaN: an
element a kernel forgets to write then shows up instead of passing as leftover memory."""

from __future__ import annotations

import torch

POISON = False


def new_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        out.fill_(float("nan"))
    return out
