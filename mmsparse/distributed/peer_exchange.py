"""The exchange by peer copies (:mod:`.peer_memory`): each rank writes what its peers need into its slot once, and
copies what it needs straight out of theirs into place. The same bytes as point to point, summed in the same
order by :mod:`.exchange`, so the same bits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .peer_memory import PeerMemory
from .token_runs import chunk_ranges, copy_tokens, local_lengths, message_spans, served_chunks


def start_fetch(cp: Any, memory: PeerMemory, k: torch.Tensor, v: torch.Tensor,
                by_position: bool) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`.exchange.start_fetch` by peer copies: every rank's K and V go into its slot as ``[B, 2 Hkv,
    S_local, D]``, and each rank copies the chunks it needs from each peer's slot into the gathered keys, one
    copy per run of chunks, beside the work that follows on its stream."""
    plan, rank = cp.plan, cp.rank
    batch, hkv, local_len, dim = k.shape
    lengths = local_lengths(plan)
    token_bytes = batch * 2 * hkv * dim * k.element_size()
    mine, theirs = memory.slot([n * token_bytes for n in lengths])
    torch.cat((k, v), dim=1, out=_tokens(mine, k.dtype, (batch, 2 * hkv, local_len, dim)))
    memory.barrier()  # every rank's K/V is in its slot
    needed = cp.gathered_chunks(by_position)
    into = chunk_ranges(plan, needed)
    gathered = k.new_empty((batch, 2 * hkv, sum(plan.chunk_tokens(c) for c in needed), dim))
    for peer in range(cp.world_size):
        from_peer = [c for c in needed if plan.owner[c] == peer]
        if peer == rank or not from_peer:
            continue
        where = chunk_ranges(plan, plan.local_chunks[peer])
        source = _tokens(theirs[peer], k.dtype, (batch, 2 * hkv, lengths[peer], dim))
        memory.pull(gathered, source, [(where[c][0], into[c][0], plan.chunk_tokens(c)) for c in from_peer], peer)
        cp.bytes_received += sum(plan.chunk_tokens(c) for c in from_peer) * token_bytes
    cp.bytes_sent += sum(plan.chunk_tokens(c) for peer in range(cp.world_size) if peer != rank
                         for c in served_chunks(plan, rank, peer)) * token_bytes
    own = chunk_ranges(plan, plan.local_chunks[rank])
    copy_tokens(gathered, (k, v), [(own[c][0], into[c][0], plan.chunk_tokens(c))
                                   for c in needed if plan.owner[c] == rank])

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        memory.wait()
        return gathered[:, :hkv], gathered[:, hkv:]

    return finish


def start_return(cp: Any, memory: PeerMemory, dkv_gathered: torch.Tensor,
                 by_position: bool) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
    """The return's transfer by peer copies, started: every rank's dK/dV of its gathered keys go into its slot as
    they are, and each owner copies its chunks' contributions out of each peer's. Returns (each peer's
    contributions to this rank's chunks, in ``served_chunks`` order, once ``wait()`` has returned; ``wait``)."""
    plan, rank = cp.plan, cp.rank
    batch, heads, _, dim = dkv_gathered.shape
    orders = [cp.gathered_chunks(by_position, rank=r) for r in range(cp.world_size)]
    lengths = [sum(plan.chunk_tokens(c) for c in order) for order in orders]
    token_bytes = batch * heads * dim * dkv_gathered.element_size()
    mine, theirs = memory.slot([n * token_bytes for n in lengths])
    _tokens(mine, dkv_gathered.dtype, tuple(dkv_gathered.shape)).copy_(dkv_gathered)
    memory.barrier()  # every rank's contributions are in its slot
    received = {}
    for peer in range(cp.world_size):
        served = served_chunks(plan, rank, peer)
        if peer == rank or not served:
            continue
        count = sum(plan.chunk_tokens(c) for c in served)
        received[peer] = dkv_gathered.new_empty((batch, heads, count, dim))
        source = _tokens(theirs[peer], dkv_gathered.dtype, (batch, heads, lengths[peer], dim))
        memory.pull(received[peer], source, message_spans(plan, served, chunk_ranges(plan, orders[peer])), peer)
        cp.bytes_received += count * token_bytes
    cp.bytes_sent += sum(plan.chunk_tokens(c) for c in plan.needed_kv[rank] if plan.owner[c] != rank) * token_bytes
    return received, memory.wait


def _tokens(slot: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The first bytes of a uint8 slot as a contiguous tensor of ``dtype`` and ``shape``."""
    count = 1
    for n in shape:
        count *= n
    size = torch.empty((), dtype=dtype).element_size()
    return slot[: count * size].view(dtype).view(shape)
