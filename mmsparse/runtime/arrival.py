"""Keys still landing when a kernel starts: what a dK/dV launch needs to take the keys already there first and the
others as they land (a context-parallel rank's fetched K/V, :mod:`mmsparse.distributed.peer_exchange`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class KeysArrival:
    """The first ``present`` keys are in place when the kernel is launched; the others are once the int32 in
    ``flag`` reads ``epoch`` or more, which a stream memory operation writes after their copies (no SM waits on
    an SM). ``wait()`` makes the current stream wait for all of them, for work that cannot wait in a kernel."""

    flag: torch.Tensor
    epoch: int
    present: int
    wait: Callable[[], None]
