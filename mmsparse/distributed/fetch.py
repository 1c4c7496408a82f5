"""A started fetch of K/V: its result once every key has landed, at once with what is still landing, or just the
rank's own keys that lead the gathered ones."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from ..runtime.arrival import KeysArrival
from .plan import ContextParallelPlan

Arriving = Callable[[], tuple[torch.Tensor, torch.Tensor, KeysArrival | None]]


class Fetch:
    """Call it for the gathered ``(k, v)``, the current stream waiting for every key. :meth:`arriving` gives them
    at once, with a :class:`KeysArrival` over the keys still landing (None where the transport has no arrival
    flag: then it has waited as a call does). ``leading``: the gathered ``(k, v)`` of the rank's own chunks that
    lead them, ``[B, Hkv, n, D]`` views already in place for the current stream (``n`` may be 0)."""

    def __init__(self, finish: Callable[[], tuple[torch.Tensor, torch.Tensor]], leading: tuple[torch.Tensor, ...],
                 arriving: Arriving | None = None):
        self._finish, self._arriving = finish, arriving
        self.leading = leading

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._finish()

    def arriving(self) -> tuple[torch.Tensor, torch.Tensor, KeysArrival | None]:
        if self._arriving is None:
            return (*self._finish(), None)
        return self._arriving()


def leading_tokens(plan: ContextParallelPlan, rank: int, gathered_chunks: Sequence[int]) -> int:
    """How many of the gathered keys are ``rank``'s own chunks at their front (copied there from its own K/V when
    the fetch starts, so in place before any peer's land)."""
    return plan.tokens_of(list(itertools.takewhile(lambda c: plan.owner[c] == rank, gathered_chunks)))


def leading_views(gathered: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) views of the first ``tokens`` keys of a gathered ``[B, 2 Hkv, S, D]`` buffer."""
    hkv = gathered.shape[1] // 2
    return gathered[:, :hkv, :tokens], gathered[:, hkv:, :tokens]
