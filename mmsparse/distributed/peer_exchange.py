"""The exchange's transport by peer copies (:mod:`.peer_memory`): a rank packs its messages straight into its
slot, meets the peers at a barrier, and copies each message meant for it out of its sender's slot, one copy per
peer on a stream of that peer's (copy engines on GPUs: no SMs, beside the work that follows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .peer_memory import PeerMemory


class PeerCopies:
    """One exchange's messages in the ranks' slots: rank r's message to rank q sits in r's slot after its messages
    to the ranks before q, so every rank knows where to find its own in every sender's slot.

    Args:
        cp: the ContextParallel (rank, world size, byte counters).
        memory: the group's peer memory, its slots reserved for the exchange.
        tokens: tokens of each message, ``[sender][receiver]`` (every rank passes the same).
        token_bytes: bytes of one token of a message (``B x H x D x`` the element size).
    """

    def __init__(self, cp: Any, memory: PeerMemory, tokens: list[list[int]], token_bytes: int) -> None:
        self.cp, self.memory, self.tokens, self.token_bytes = cp, memory, tokens, token_bytes
        self.mine = memory.slot()

    def outboxes(self, like: torch.Tensor, shapes: dict[int, tuple[int, ...]]) -> dict[int, torch.Tensor]:
        rank = self.cp.rank
        return {peer: _message(self.mine, self._offset(rank, peer), like.dtype, shape)
                for peer, shape in shapes.items()}

    def post(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
             like: torch.Tensor) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
        cp, memory, rank = self.cp, self.memory, self.cp.rank
        memory.barrier()  # every rank's messages are packed
        received = {}
        for peer, shape in recv_shapes.items():
            if peer == rank or not shape[2]:
                continue
            received[peer] = like.new_empty(shape)
            memory.pull(received[peer], peer, self._offset(peer, rank))
            cp.bytes_received += received[peer].numel() * received[peer].element_size()
        cp.bytes_sent += sum(t.numel() * t.element_size() for t in sends.values())
        return received, memory.wait

    def _offset(self, sender: int, receiver: int) -> int:
        return sum(self.tokens[sender][:receiver]) * self.token_bytes


def _message(slot: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a uint8 slot from ``offset`` as a contiguous tensor of ``dtype`` and ``shape``."""
    count = 1
    for n in shape:
        count *= n
    size = torch.empty((), dtype=dtype).element_size()
    return slot[offset : offset + count * size].view(dtype).view(shape)
