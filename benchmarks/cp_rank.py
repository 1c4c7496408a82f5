"""One rank's local attention as ``ContextParallel.attention`` runs it, the gathered K/V already there: what
``cp_nccl`` times as its compute alone, and ``tools.cp_local`` for every rank on one GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces


@dataclass
class RankInputs:
    """One rank's tensors, laid out as in a real run: q, k, v, dout of its own tokens ``[B, H, S_local, D]`` and
    the gathered K/V, views of one ``[B, 2 Hkv, S_gathered, D]`` tensor as the exchange delivers them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    k_gathered: torch.Tensor
    v_gathered: torch.Tensor


def local_forward(problem: RankProblem, x: RankInputs, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's forward as ``ContextParallel.attention`` runs it, the gathered K/V already there: (out, lse)."""
    pieces = problem.pieces(x.q.device)
    return forward_pieces(x.q, x.k, x.v, pieces, [None] * len(pieces), scale, 0.0,
                          lambda: (x.k_gathered, x.v_gathered))


def local_backward(problem: RankProblem, x: RankInputs, out: torch.Tensor, lse: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The rank's backward, without the exchange: (dq, dK/dV of its own keys or None, dK/dV of the gathered
    keys), see :func:`mmsparse.distributed.local.backward_pieces`."""
    pieces = problem.pieces(x.q.device)
    return backward_pieces(x.dout, x.q, x.k, x.v, out, lse, pieces, [None] * len(pieces), scale, 0.0,
                           lambda: (x.k_gathered, x.v_gathered))
