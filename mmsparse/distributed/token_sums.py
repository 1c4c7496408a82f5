"""The dK/dV return's sum: each of a rank's local tokens adds its contributions from several sources (its own
local pieces' dK/dV, its own gathered keys', each peer's message) in a fixed order, in float32, and the last
step writes the result in the dtype the caller wants. One pass per source over ``[B, H, S_local, D]``, each a
gather by a per-token index, where strided slice adds over every run of chunks took several passes (about 0.5 ms a
step at 43k on 2 H200s)."""

from __future__ import annotations

import torch

from ..kernels.tl.token_sums import add_token_rows_kernel
from ..mask.blocks import cdiv, next_power_of_2
from ..runtime.launch import FastKernel

_BLOCK = 64  # tokens a program: [64, D] float32 in registers
_ADD = FastKernel(add_token_rows_kernel)


class TokenSum:
    """A sum over sources taken one at a time, so that some are added while others are still in flight:
    :meth:`add` each source but the last, in order, then :meth:`finish` with the last.

    Args:
        shape: ``[B, H, S_local, D]`` of the result.
        dtype: the result's dtype (the sum itself is float32).
        device: where it runs.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self._acc: torch.Tensor | None = None

    def add(self, source: torch.Tensor, index: torch.Tensor) -> None:
        """Add ``source`` (``[B, H, L, D]``) at each local token t's row ``index[t]`` (int32 ``[S_local]`` on the
        device; -1: nothing from this source), in float32."""
        first = self._acc is None
        if first:
            self._acc = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        self._launch(source, index, self._acc, first=first, last=False)

    def finish(self, source: torch.Tensor | None = None, index: torch.Tensor | None = None) -> torch.Tensor:
        """The sum with the last source added, ``[B, H, S_local, D]`` in the result's dtype; zeros where no source
        gave anything (no source at all: pass none)."""
        if source is None:
            if self._acc is not None:
                raise ValueError("finish takes the last source once others were added")
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._launch(source, index, out, first=self._acc is None, last=True)
        return out

    def _launch(self, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor, first: bool, last: bool) -> None:
        batch, heads, n_tokens, width = self.shape
        if source.shape[0] != batch or source.shape[1] != heads or source.shape[3] != width:
            raise ValueError(f"a source of {tuple(source.shape)} does not add to a sum of {tuple(self.shape)}")
        acc = self._acc if self._acc is not None else out
        _ADD[(cdiv(n_tokens, _BLOCK), batch * heads)](
            acc, source.contiguous(), index, out, n_tokens, source.shape[2],
            WIDTH=width, WIDTH_PAD=next_power_of_2(width), BLOCK=_BLOCK, FIRST=first, LAST=last,
        )
