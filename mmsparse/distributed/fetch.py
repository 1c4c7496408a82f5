"""A started fetch of K/V: its result once every key has landed, or at once with what is still landing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime.arrival import KeysArrival

Arriving = Callable[[], tuple[torch.Tensor, torch.Tensor, KeysArrival | None]]


class Fetch:
    """Call it for the gathered ``(k, v)``, the current stream waiting for every key. :meth:`arriving` gives them
    at once, with a :class:`KeysArrival` over the keys still landing (None where the transport has no arrival
    flag: then it has waited as a call does)."""

    def __init__(self, finish: Callable[[], tuple[torch.Tensor, torch.Tensor]], arriving: Arriving | None = None):
        self._finish, self._arriving = finish, arriving

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._finish()

    def arriving(self) -> tuple[torch.Tensor, torch.Tensor, KeysArrival | None]:
        if self._arriving is None:
            return (*self._finish(), None)
        return self._arriving()
