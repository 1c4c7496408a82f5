"""What the harness holds of one implementation: its call and the cost of its mask state (the ``setup_*`` of
:mod:`benchmarks.baselines` make them; the check and the runner read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

TensorFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Impl:
    """One implementation as the harness runs it: the call, the mask it must match, the cost of its mask state."""

    fn: TensorFn  # (q, k, v) -> out, autograd-capable
    reference: str = "topology"  # the mask kind its output must match
    build_ms: float | None = None
    state_mib: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # extra row keys (backend, tiles, ...)
