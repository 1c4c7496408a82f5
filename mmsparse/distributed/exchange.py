"""The exchange of a context-parallel attention: K/V fetched from the chunks' owners, dK/dV returned to them.

Two transports move the same bytes and sum in the same order, so they give the same bits:

- ``p2p``: the process group's point to point (NCCL on GPUs, gloo on CPUs), one packed message per peer;
- ``peer_copy`` (:mod:`.peer_exchange`): each rank copies what it needs straight out of its peers' memory
  (:mod:`.peer_memory`), by copy engines on GPUs.

``ContextParallel(transport="auto")`` takes ``peer_copy`` on GPUs of one host that reach each other, where a
rank's slot stays within :data:`PEER_COPY_MAX_BYTES`, and ``p2p`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import peer_exchange
from .peer_memory import PeerMemory, peer_memory
from .token_runs import add_tokens, chunk_ranges, copy_tokens, local_lengths, message_spans, served_chunks

TRANSPORTS = ("auto", "p2p", "peer_copy")
# The largest slot ``auto`` keeps for peer copies: two a rank, kept for the process. Below it copy engines beat
# NCCL's point to point most (1.32x at 85 MiB on 2 H200s, 1.11x at 256 MiB: docs/context_parallel.md); above it
# the messages are long enough for NCCL and the slots would hold memory that the step wants.
PEER_COPY_MAX_BYTES = 128 * 2**20

Finish = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def start_fetch(cp: Any, k: torch.Tensor, v: torch.Tensor, by_position: bool = False) -> Finish:
    """Start fetching K and V of the chunks this rank needs: each owner serves each rank just the chunks that
    rank's queries see (the plan's ``needed_kv``). Returns ``finish()``: it waits for the exchange (this rank's
    part in it included) and gives the gathered K and V in ``cp.gathered_chunks(by_position)``' order."""
    token_bytes = k.shape[0] * 2 * k.shape[1] * k.shape[3] * k.element_size()
    memory = _peer_memory(cp, k.device, [n * token_bytes for n in local_lengths(cp.plan)])
    if memory is not None:
        return peer_exchange.start_fetch(cp, memory, k, v, by_position)
    return _start_p2p_fetch(cp, k, v, by_position)


def return_kv_grads(cp: Any, dkv_gathered: torch.Tensor, dkv_local: torch.Tensor | None,
                    wire: torch.dtype = torch.float32, by_position: bool = False) -> torch.Tensor:
    """Send each gathered chunk's dK/dV to its owner, in ``wire`` dtype; every owner sums its chunks'
    contributions in float32, its own first (while the transfer runs), then the peers' in rank order: deterministic,
    no atomics. dkv_*: ``[B, 2 Hkv, ., D]``, float32 or (``wire`` the inputs' dtype, exact there) the inputs' dtype;
    ``dkv_local`` None: no piece read the rank's own keys. ``by_position``: the gathered keys' order is the dropout
    pieces'. Returns the summed dK/dV of this rank's keys, float32 ``[B, 2 Hkv, S_local, D]``."""
    if dkv_gathered.dtype != wire:
        if wire != torch.float32 and dkv_gathered.numel():
            raise ValueError(f"dK/dV of the gathered keys is {dkv_gathered.dtype}, but this plan returns it in "
                             f"{wire} (cp.kv_grad_dtype): pass it in that dtype")
        dkv_gathered = dkv_gathered.to(wire)  # float32 from the inputs' dtype: exact
    batch, heads, _, dim = dkv_gathered.shape
    token_bytes = batch * heads * dim * dkv_gathered.element_size()
    gathered_tokens = [sum(cp.plan.chunk_tokens(c) for c in cp.gathered_chunks(by_position, rank=r))
                       for r in range(cp.world_size)]
    memory = _peer_memory(cp, dkv_gathered.device, [n * token_bytes for n in gathered_tokens])
    received, wait = (peer_exchange.start_return(cp, memory, dkv_gathered, by_position) if memory is not None else
                      _start_p2p_return(cp, dkv_gathered, by_position))
    plan, rank = cp.plan, cp.rank
    mine = chunk_ranges(plan, plan.local_chunks[rank])
    gathered = chunk_ranges(plan, cp.gathered_chunks(by_position))
    # The rank's own contributions are summed while the peers' are in flight, then each peer's in rank order: one
    # fixed order, so a run repeats bit for bit.
    if dkv_local is not None:
        total = dkv_local.to(torch.float32, copy=True)
    else:
        total = torch.zeros((batch, heads, cp.local_len, dim), dtype=torch.float32, device=dkv_gathered.device)
    own = [c for c in plan.local_chunks[rank] if c in gathered]
    add_tokens(total, dkv_gathered, [(gathered[c][0], mine[c][0], plan.chunk_tokens(c)) for c in own])
    wait()
    for peer in sorted(received):
        served = served_chunks(plan, rank, peer)
        add_tokens(total, received[peer], message_spans(plan, served, mine, source_first=False))
    return total


def _peer_memory(cp: Any, device: torch.device, sizes: Sequence[int]) -> PeerMemory | None:
    """The group's peer memory where ``cp.transport`` takes peer copies for an exchange whose ranks write
    ``sizes`` bytes each, else None (point to point). Every rank decides alike: the sizes come from the plan."""
    if cp.transport == "p2p" or cp.world_size == 1:
        return None
    if cp.transport == "auto" and (device.type != "cuda" or max(sizes, default=0) > PEER_COPY_MAX_BYTES):
        return None
    memory = peer_memory(cp.group, device)
    if memory.reason is not None:
        if cp.transport == "peer_copy":
            raise RuntimeError(f"ContextParallel(transport='peer_copy') cannot run on this group: {memory.reason}. "
                               "Pass transport='auto' or 'p2p'.")
        return None
    return memory


def _post_p2p(cp: Any, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
              like: torch.Tensor) -> tuple[dict[int, torch.Tensor], list[Any]]:
    """Point to point, started: ``sends[peer]`` goes to each peer, and a tensor of ``recv_shapes[peer]`` comes from
    each (group ranks; empty tensors are not sent). Returns the receive buffers and the requests to wait for before
    reading them."""
    ops, received = [], {}
    for peer in range(cp.world_size):
        if peer == cp.rank:
            continue
        global_peer = dist.get_global_rank(cp.group, peer)
        if sends.get(peer) is not None and sends[peer].numel():
            ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), global_peer, cp.group))
            cp.bytes_sent += sends[peer].numel() * sends[peer].element_size()
        shape = recv_shapes.get(peer)
        if shape is not None and shape[2]:
            received[peer] = like.new_empty(shape)
            ops.append(dist.P2POp(dist.irecv, received[peer], global_peer, cp.group))
            cp.bytes_received += received[peer].numel() * received[peer].element_size()
    return received, dist.batch_isend_irecv(ops) if ops else []


def _start_p2p_fetch(cp: Any, k: torch.Tensor, v: torch.Tensor, by_position: bool) -> Finish:
    plan, rank = cp.plan, cp.rank
    batch, hkv, _, dim = k.shape
    mine = chunk_ranges(plan, plan.local_chunks[rank])
    sends = {}
    for peer in range(cp.world_size):
        wanted = served_chunks(plan, rank, peer)
        if peer != rank and wanted:
            # K and V packed into one message, [B, 2 Hkv, n, D], straight from the rank's own tensors
            sends[peer] = k.new_empty((batch, 2 * hkv, sum(plan.chunk_tokens(c) for c in wanted), dim))
            copy_tokens(sends[peer], (k, v), message_spans(plan, wanted, mine))
    recv_shapes = {}
    for peer in range(cp.world_size):
        n = sum(plan.chunk_tokens(c) for c in plan.needed_kv[rank] if plan.owner[c] == peer)
        recv_shapes[peer] = (batch, 2 * hkv, n, dim)
    received, requests = _post_p2p(cp, sends, recv_shapes, k)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        needed = cp.gathered_chunks(by_position)
        into = chunk_ranges(plan, needed)
        gathered = k.new_empty((batch, 2 * hkv, sum(plan.chunk_tokens(c) for c in needed), dim))
        copy_tokens(gathered, (k, v), [(mine[c][0], into[c][0], plan.chunk_tokens(c))
                                       for c in needed if plan.owner[c] == rank])
        for request in requests:
            request.wait()
        for peer, buffer in received.items():
            from_peer = [c for c in needed if plan.owner[c] == peer]
            copy_tokens(gathered, (buffer,), message_spans(plan, from_peer, into, source_first=False))
        return gathered[:, :hkv], gathered[:, hkv:]

    return finish


def _start_p2p_return(cp: Any, dkv_gathered: torch.Tensor,
                      by_position: bool) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
    """The return's transfer by point to point, started: (each peer's contributions to this rank's chunks, in
    :func:`served_chunks` order, once ``wait()`` has returned; ``wait``)."""
    plan, rank = cp.plan, cp.rank
    gathered = chunk_ranges(plan, cp.gathered_chunks(by_position))
    batch, heads, _, dim = dkv_gathered.shape
    sends = {}
    for peer in range(cp.world_size):
        chunks = [c for c in plan.needed_kv[rank] if plan.owner[c] == peer]
        if peer != rank and chunks:
            sends[peer] = dkv_gathered.new_empty((batch, heads, sum(plan.chunk_tokens(c) for c in chunks), dim))
            copy_tokens(sends[peer], (dkv_gathered,), message_spans(plan, chunks, gathered))
    recv_shapes = {}
    for peer in range(cp.world_size):
        n = sum(plan.chunk_tokens(c) for c in served_chunks(plan, rank, peer))
        recv_shapes[peer] = (batch, heads, n, dim)
    received, requests = _post_p2p(cp, sends, recv_shapes, dkv_gathered)

    def wait() -> None:
        for request in requests:
            request.wait()

    return received, wait
