"""The exchange of a context-parallel attention: K/V fetched from the chunks' owners, dK/dV returned to them.

Each exchange packs one message per peer (``[B, H, n, D]``, the chunks end to end in the order the peer holds
them), moves the messages, and unpacks (the fetch) or sums (the return) what came in. Two transports move them:

- ``p2p``: the process group's point to point (NCCL on GPUs, gloo on CPUs);
- ``peer_copy`` (:mod:`.peer_exchange`): the messages are packed straight into memory the peers have opened
  (:mod:`.peer_memory`), and each rank copies its own out of the peers' (copy engines on GPUs, no SMs).

They move the same bytes and sum in the same order, so they give the same bits. ``ContextParallel(transport=
"auto")`` takes ``peer_copy`` on GPUs of one host that reach each other where a rank's messages of one exchange
fit in :data:`PEER_COPY_MAX_BYTES`, and ``p2p`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .peer_exchange import PeerCopies
from .peer_memory import peer_memory
from .token_runs import add_tokens, chunk_ranges, copy_tokens, message_spans, served_chunks

TRANSPORTS = ("auto", "p2p", "peer_copy")
# The most bytes of messages a rank packs for one exchange that ``auto`` moves by peer copies; each rank keeps two
# slots of that size for the process. Below it copy engines beat NCCL's point to point most (1.32x at 85 MiB on 2
# H200s, 1.11x at 256 MiB: docs/context_parallel.md); above it NCCL is near its link rate and the slots would hold
# memory that the step wants.
PEER_COPY_MAX_BYTES = 128 * 2**20

Finish = Callable[[], tuple[torch.Tensor, torch.Tensor]]


class Transport(Protocol):
    """How one exchange's messages move: buffers to pack them in, then the transfer."""

    def outboxes(self, like: torch.Tensor, shapes: dict[int, tuple[int, ...]]) -> dict[int, torch.Tensor]:
        """A buffer of each shape (by peer) to pack that peer's message in."""

    def post(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
             like: torch.Tensor) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
        """Start the transfer of the packed ``sends``: (the receive buffers by peer, readable once ``wait()`` has
        returned; ``wait``)."""


def start_fetch(cp: Any, k: torch.Tensor, v: torch.Tensor, by_position: bool = False) -> Finish:
    """Start fetching K and V of the chunks this rank needs: each owner serves each rank just the chunks that
    rank's queries see (the plan's ``needed_kv``). Returns ``finish()``: it waits for the exchange (this rank's
    part in it included) and gives the gathered K and V in ``cp.gathered_chunks(by_position)``' order."""
    plan, rank = cp.plan, cp.rank
    batch, hkv, _, dim = k.shape
    tokens = [[_tokens(plan, served_chunks(plan, r, q)) if q != r else 0 for q in range(cp.world_size)]
              for r in range(cp.world_size)]  # [sender][receiver]
    transport = _transport(cp, k, tokens, batch * 2 * hkv * dim * k.element_size())
    mine = chunk_ranges(plan, plan.local_chunks[rank])
    wanted = {peer: served_chunks(plan, rank, peer) for peer in range(cp.world_size) if tokens[rank][peer]}
    sends = transport.outboxes(k, {peer: (batch, 2 * hkv, tokens[rank][peer], dim) for peer in wanted})
    for peer, chunks in wanted.items():  # K and V into one message, straight from the rank's own tensors
        copy_tokens(sends[peer], (k, v), message_spans(plan, chunks, mine))
    received, wait = transport.post(sends, {peer: (batch, 2 * hkv, tokens[peer][rank], dim)
                                            for peer in range(cp.world_size)}, k)
    needed = cp.gathered_chunks(by_position)
    into = chunk_ranges(plan, needed)
    gathered = k.new_empty((batch, 2 * hkv, _tokens(plan, needed), dim))
    copy_tokens(gathered, (k, v), [(mine[c][0], into[c][0], plan.chunk_tokens(c))
                                   for c in needed if plan.owner[c] == rank])

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        wait()
        for peer, buffer in received.items():
            from_peer = [c for c in needed if plan.owner[c] == peer]
            copy_tokens(gathered, (buffer,), message_spans(plan, from_peer, into, source_first=False))
        return gathered[:, :hkv], gathered[:, hkv:]

    return finish


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
    plan, rank = cp.plan, cp.rank
    batch, heads, _, dim = dkv_gathered.shape
    # each rank returns to each owner the contributions to what that owner served it
    tokens = [[_tokens(plan, served_chunks(plan, o, r)) if o != r else 0 for o in range(cp.world_size)]
              for r in range(cp.world_size)]  # [sender][owner]
    transport = _transport(cp, dkv_gathered, tokens, batch * heads * dim * dkv_gathered.element_size())
    gathered = chunk_ranges(plan, cp.gathered_chunks(by_position))
    owed = {owner: served_chunks(plan, owner, rank) for owner in range(cp.world_size) if tokens[rank][owner]}
    sends = transport.outboxes(dkv_gathered, {o: (batch, heads, tokens[rank][o], dim) for o in owed})
    for owner, chunks in owed.items():
        copy_tokens(sends[owner], (dkv_gathered,), message_spans(plan, chunks, gathered))
    received, wait = transport.post(sends, {peer: (batch, heads, tokens[peer][rank], dim)
                                            for peer in range(cp.world_size)}, dkv_gathered)
    mine = chunk_ranges(plan, plan.local_chunks[rank])
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


def _tokens(plan: Any, chunks: list[int] | tuple[int, ...]) -> int:
    return sum(plan.chunk_tokens(c) for c in chunks)


def _transport(cp: Any, like: torch.Tensor, tokens: list[list[int]], token_bytes: int) -> Transport:
    """The exchange's transport: peer copies where ``cp.transport`` takes them for messages of ``tokens``
    ([sender][receiver]) of ``token_bytes`` each, else point to point. Every rank decides alike (the sizes come
    from the plan, the peer memory's verdict from all ranks)."""
    if cp.transport == "p2p" or cp.world_size == 1:
        return PointToPoint(cp)
    sizes = [sum(row) * token_bytes for row in tokens]
    if cp.transport == "auto" and (like.device.type != "cuda" or max(sizes) > PEER_COPY_MAX_BYTES):
        return PointToPoint(cp)
    memory = peer_memory(cp.group, like.device)
    memory.reserve(max(sizes))
    if memory.reason is not None:
        if cp.transport == "peer_copy":
            raise RuntimeError(f"ContextParallel(transport='peer_copy') cannot run on this group: {memory.reason}. "
                               "Pass transport='auto' or 'p2p'.")
        return PointToPoint(cp)
    return PeerCopies(cp, memory, tokens, token_bytes)


class PointToPoint:
    """The process group's batched isend/irecv, one message per peer each way."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp

    def outboxes(self, like: torch.Tensor, shapes: dict[int, tuple[int, ...]]) -> dict[int, torch.Tensor]:
        return {peer: like.new_empty(shape) for peer, shape in shapes.items()}

    def post(self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
             like: torch.Tensor) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
        cp = self.cp
        ops, received = [], {}
        for peer in range(cp.world_size):
            if peer == cp.rank:
                continue
            global_peer = dist.get_global_rank(cp.group, peer)
            if sends.get(peer) is not None and sends[peer].numel():
                ops.append(dist.P2POp(dist.isend, sends[peer], global_peer, cp.group))
                cp.bytes_sent += sends[peer].numel() * sends[peer].element_size()
            shape = recv_shapes.get(peer)
            if shape is not None and shape[2]:
                received[peer] = like.new_empty(shape)
                ops.append(dist.P2POp(dist.irecv, received[peer], global_peer, cp.group))
                cp.bytes_received += received[peer].numel() * received[peer].element_size()
        requests = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> None:
            for request in requests:
                request.wait()

        return received, wait
