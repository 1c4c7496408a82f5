"""The exchange of a context-parallel attention: K/V fetched from the chunks' owners, dK/dV returned to them.

Two transports move the same bytes, and the return sums them in the same order, so they give the same bits:

- ``p2p``: the process group's point to point (NCCL on GPUs, gloo on CPUs): one message per peer
  (``[B, H, n, D]``, the chunks end to end in the order the peer holds them), packed before and unpacked after;
- ``peer_copy`` (:mod:`.peer_exchange`): each rank copies what it needs straight out of memory its peers have
  opened to it (:mod:`.peer_memory`), by copy engines on GPUs: no SMs, nothing packed per peer or unpacked.

``ContextParallel(transport="auto")`` takes ``peer_copy`` on GPUs of one host that reach each other where a
rank's slot for the exchange fits in :data:`PEER_COPY_MAX_BYTES`, and ``p2p`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import peer_exchange
from .fetch import Fetch
from .peer_memory import PeerMemory, peer_memory
from .token_runs import copy_tokens
from .token_sums import TokenSum

TRANSPORTS = ("auto", "p2p", "peer_copy")
# The largest slot (a rank's K/V, or its gathered keys' dK/dV) that ``auto`` moves by peer copies; each rank keeps
# two slots of the largest size it has used, for the process. Below it copy engines beat NCCL's point to point
# most (1.32x at 85 MiB on 2 H200s, 1.11x at 256 MiB: docs/context_parallel.md); above it NCCL is near its link
# rate and the slots would hold memory that the step wants.
PEER_COPY_MAX_BYTES = 128 * 2**20

def start_fetch(cp: Any, k: torch.Tensor, v: torch.Tensor, by_position: bool = False) -> Fetch:
    """Start fetching K and V of the chunks this rank needs: each owner serves each rank just the chunks that
    rank's queries see (the plan's ``needed_kv``). Returns a :class:`.fetch.Fetch`: called, it waits for the
    exchange (this rank's part in it included) and gives the gathered K and V in
    ``cp.gathered_chunks(by_position)``' order; by peer copies its ``arriving()`` gives them with the keys still
    landing."""
    routes = cp.routes(by_position)
    token_bytes = k.shape[0] * 2 * k.shape[1] * k.shape[3] * k.element_size()
    memory = _peer_memory(cp, k.device, [n * token_bytes for n in routes.local_lengths])
    if memory is not None:
        return peer_exchange.start_fetch(cp, memory, k, v, routes)
    batch, hkv, _, dim = k.shape
    sends = {}
    for peer, message in routes.fetch_sends.items():
        # K and V packed into one message, [B, 2 Hkv, n, D], straight from the rank's own tensors
        sends[peer] = k.new_empty((batch, 2 * hkv, message.tokens, dim))
        copy_tokens(sends[peer], (k, v), message.spans)
    recv_shapes = {peer: (batch, 2 * hkv, m.tokens, dim) for peer, m in routes.fetch_receives.items()}
    received, wait = _post_p2p(cp, sends, recv_shapes, k)
    gathered = k.new_empty((batch, 2 * hkv, routes.gathered, dim))
    copy_tokens(gathered, (k, v), routes.own)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        wait()
        for peer, buffer in received.items():
            copy_tokens(gathered, (buffer,), routes.fetch_receives[peer].spans)
        return gathered[:, :hkv], gathered[:, hkv:]

    return Fetch(finish)


def return_kv_grads(cp: Any, dkv_gathered: torch.Tensor, dkv_local: torch.Tensor | None,
                    wire: torch.dtype = torch.float32, by_position: bool = False,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Send each gathered chunk's dK/dV to its owner, in ``wire`` dtype; every owner sums its chunks'
    contributions in float32, its own first (while the transfer runs), then the peers' in rank order: deterministic,
    no atomics. dkv_*: ``[B, 2 Hkv, ., D]``, float32 or (``wire`` the inputs' dtype, exact there) the inputs' dtype;
    ``dkv_local`` None: no piece read the rank's own keys. ``by_position``: the gathered keys' order is the dropout
    pieces'. Returns the summed dK/dV of this rank's keys, ``[B, 2 Hkv, S_local, D]`` in ``out_dtype`` (summed in
    float32 whatever it is)."""
    return start_return(cp, dkv_gathered, dkv_local, wire, by_position, out_dtype)()


def start_return(cp: Any, dkv_gathered: torch.Tensor, dkv_local: torch.Tensor | None,
                 wire: torch.dtype = torch.float32, by_position: bool = False,
                 out_dtype: torch.dtype = torch.float32) -> Callable[[], torch.Tensor]:
    """:func:`return_kv_grads`, started: the transfer is queued and the rank's own contributions are summed on the
    current stream; ``finish()`` waits for the peers' and adds them. Work queued between the two (a dQ pass) runs
    beside the transfer."""
    if dkv_gathered.dtype != wire:
        if wire != torch.float32 and dkv_gathered.numel():
            raise ValueError(f"dK/dV of the gathered keys is {dkv_gathered.dtype}, but this plan returns it in "
                             f"{wire} (cp.kv_grad_dtype): pass it in that dtype")
        dkv_gathered = dkv_gathered.to(wire)  # float32 from the inputs' dtype: exact
    routes = cp.routes(by_position)
    batch, heads, _, dim = dkv_gathered.shape
    token_bytes = batch * heads * dim * dkv_gathered.element_size()
    memory = _peer_memory(cp, dkv_gathered.device, [n * token_bytes for n in routes.gathered_lengths])
    if memory is not None:
        received, wait = peer_exchange.start_return(cp, memory, dkv_gathered, routes)
    else:
        sends = {}
        for owner, message in routes.return_sends.items():  # what each owner served this rank
            sends[owner] = dkv_gathered.new_empty((batch, heads, message.tokens, dim))
            copy_tokens(sends[owner], (dkv_gathered,), message.spans)
        recv_shapes = {peer: (batch, heads, tokens, dim) for peer, tokens in routes.served.items()}
        received, wait = _post_p2p(cp, sends, recv_shapes, dkv_gathered)
    # The rank's own contributions are summed while the peers' are in flight, then each peer's in rank order: one
    # fixed order, so a run repeats bit for bit (and both transports give the same bits).
    rows = cp.contribution_rows(by_position, dkv_gathered.device)
    summed = TokenSum((batch, heads, cp.local_len, dim), out_dtype, dkv_gathered.device)
    ordered = [] if dkv_local is None else [(dkv_local, rows.local)]
    ordered += [] if rows.own is None else [(dkv_gathered, rows.own)]
    early = len(ordered) if received else 0  # the rank's own, added while the peers' are in flight
    ordered += [(received[peer], rows.by_peer[peer]) for peer in sorted(received)]
    for source, index in ordered[:early]:
        summed.add(source, index)

    def finish() -> torch.Tensor:
        wait()
        for source, index in ordered[early:-1]:
            summed.add(source, index)
        return summed.finish(*ordered[-1]) if ordered else summed.finish()

    return finish


def _peer_memory(cp: Any, device: torch.device, sizes: list[int]) -> PeerMemory | None:
    """The group's peer memory, its slots reserved for ``sizes`` (each rank's bytes), where ``cp.transport`` takes
    peer copies for this exchange; else None (point to point). Every rank decides alike (the sizes come from the
    plan, the peer memory's verdict from all ranks)."""
    if cp.transport == "p2p" or cp.world_size == 1:
        return None
    if cp.transport == "auto" and (device.type != "cuda" or max(sizes) > PEER_COPY_MAX_BYTES):
        return None
    memory = peer_memory(cp.group, device)
    memory.reserve(max(sizes))
    if memory.reason is not None:
        if cp.transport == "peer_copy":
            raise RuntimeError(f"ContextParallel(transport='peer_copy') cannot run on this group: {memory.reason}. "
                               "Pass transport='auto' or 'p2p'.")
        return None
    return memory


def _post_p2p(cp: Any, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple[int, ...]],
              like: torch.Tensor) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
    """Point to point, started: ``sends[peer]`` goes to each peer, and a tensor of ``recv_shapes[peer]`` comes from
    each (group ranks; empty tensors are not sent). Returns the receive buffers, readable once ``wait()`` has
    returned, and ``wait``."""
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
