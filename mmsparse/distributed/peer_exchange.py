"""The exchange by peer copies (:mod:`.peer_memory`): each rank writes its K and V (the fetch) or its gathered
keys' dK/dV (the return) into its slot as they are, meets the peers at a barrier, and copies what it needs out of
theirs: on GPUs one 2-D copy per run of chunks and batch row, straight into place, by copy engines on a stream
per peer (no SMs, beside the work that follows), with nothing packed per peer and nothing to unpack. A fetch's
barrier and copies are queued on a side stream, so a rank's kernels go on while it waits for its peers. The same
bytes as point to point, summed in the same order by :mod:`.exchange`, so the same bits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.arrival import KeysArrival
from ..runtime.cuda_driver import copy_rows_on_stream
from .fetch import Fetch, leading_tokens
from .peer_memory import MAX_PITCH, PeerMemory
from .token_runs import chunk_ranges, copy_tokens, merged_runs, message_spans, served_chunks


def start_fetch(cp: Any, memory: PeerMemory, k: torch.Tensor, v: torch.Tensor, by_position: bool,
                lengths: list[int], first: Callable[[], None] | None = None) -> Fetch:
    """:func:`.exchange.start_fetch` by peer copies. ``lengths``: every rank's local tokens; each rank's slot, reserved
    for them, holds its K then its V, ``[B, Hkv, S_local, D]`` each. The exchange runs on a side stream
    (:meth:`PeerMemory.fork`): its barrier waits for the peers there, not on the current stream. ``first`` is
    queued on the current stream before it, beside it. Its :meth:`Fetch.arriving` gives the gathered K/V once the
    barrier is passed, with a :class:`KeysArrival` over the keys after the rank's own leading chunks."""
    plan, rank = cp.plan, cp.rank
    batch, hkv, local_len, dim = k.shape
    token = dim * k.element_size()
    needed = cp.gathered_chunks(by_position)
    into = chunk_ranges(plan, needed)
    gathered = k.new_empty((batch, 2 * hkv, plan.tokens_of(needed), dim))
    aside = memory.fork()
    if first is not None:
        first()
    own_copied = None
    with aside:
        own = chunk_ranges(plan, plan.local_chunks[rank])
        _copy_own(gathered, (k, v), [(own[c][0], into[c][0], plan.chunk_tokens(c))
                                     for c in needed if plan.owner[c] == rank])
        if k.is_cuda:
            own_copied = torch.cuda.Event()
            own_copied.record()
            for t in (k, v, gathered):  # made on the current stream, used on the side stream too
                t.record_stream(torch.cuda.current_stream(k.device))
        slot = memory.slot()
        half = batch * hkv * local_len * token
        _view(slot, 0, k.dtype, k.shape).copy_(k)
        _view(slot, half, v.dtype, v.shape).copy_(v)
        memory.barrier()  # every rank's K/V is in its slot
        for peer in range(cp.world_size):
            from_peer = [c for c in needed if plan.owner[c] == peer]
            if peer == rank or not from_peer:
                continue
            where, held = chunk_ranges(plan, plan.local_chunks[peer]), lengths[peer]
            for s, d, n in merged_runs([(where[c][0], into[c][0], plan.chunk_tokens(c)) for c in from_peer]):
                for b in range(batch):
                    for part in range(2):  # K, then V
                        offset = ((part * batch + b) * hkv * held + s) * token
                        memory.pull(peer, offset, held * token, gathered[b, part * hkv : (part + 1) * hkv], d, n)
            cp.bytes_received += plan.tokens_of(from_peer) * 2 * batch * hkv * token
    cp.bytes_sent += sum(plan.tokens_of(served_chunks(plan, rank, peer)) for peer in range(cp.world_size)
                         if peer != rank) * 2 * batch * hkv * token

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        memory.join()
        return gathered[:, :hkv], gathered[:, hkv:]

    def arriving() -> tuple[torch.Tensor, torch.Tensor, KeysArrival | None]:
        signal = memory.signal_arrival()
        if signal is None:
            return (*finish(), None)
        # The kernels that wait on the flag may hold every SM while they wait: where the barrier is a kernel, it
        # is done before they start; else they wait only for the rank's own chunks.
        if memory.barrier_takes_sm or own_copied is None:
            memory.join(pulls=False)
        else:
            torch.cuda.current_stream(k.device).wait_event(own_copied)
        present = leading_tokens(plan, rank, needed)
        return gathered[:, :hkv], gathered[:, hkv:], KeysArrival(*signal, present, memory.join)

    return Fetch(finish, arriving)


def start_return(cp: Any, memory: PeerMemory, dkv_gathered: torch.Tensor, by_position: bool,
                 lengths: list[int]) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
    """The return's transfer by peer copies: each owner copies its chunks' contributions out of each peer's slot.
    ``lengths``: every rank's gathered keys; each rank's slot, reserved for them, holds their dK/dV as they are,
    ``[B, 2 Hkv, S_gathered, D]``. Returns (each peer's contributions to this rank's chunks, in ``served_chunks``
    order, once ``wait()`` has returned; ``wait``)."""
    plan, rank = cp.plan, cp.rank
    batch, heads, _, dim = dkv_gathered.shape
    token = dim * dkv_gathered.element_size()
    slot = memory.slot()
    _view(slot, 0, dkv_gathered.dtype, tuple(dkv_gathered.shape)).copy_(dkv_gathered)
    memory.barrier()  # every rank's contributions are in its slot
    received = {}
    for peer in range(cp.world_size):
        served = served_chunks(plan, rank, peer)
        if peer == rank or not served:
            continue
        where, held = chunk_ranges(plan, cp.gathered_chunks(by_position, rank=peer)), lengths[peer]
        count = plan.tokens_of(served)
        received[peer] = dkv_gathered.new_empty((batch, heads, count, dim))
        rows = received[peer].view(batch * heads, count, dim)
        for s, d, n in merged_runs(message_spans(plan, served, where)):
            memory.pull(peer, s * token, held * token, rows, d, n)
        cp.bytes_received += count * batch * heads * token
    cp.bytes_sent += plan.tokens_of([c for c in plan.needed_kv[rank] if plan.owner[c] != rank]) * batch * heads * token
    return received, memory.wait


def _copy_own(gathered: torch.Tensor, srcs: tuple[torch.Tensor, ...], spans: list[tuple[int, int, int]]) -> None:
    """:func:`.token_runs.copy_tokens` on the current stream, by copy engines on a GPU where each source's heads
    are rows of contiguous tokens (no SM: it runs beside kernels that hold every SM); else by copy_tokens."""
    size = gathered.element_size()
    rows_apart = [gathered.stride(1) * size, *(t.stride(1) * size for t in srcs)]
    if not gathered.is_cuda or max(rows_apart) > MAX_PITCH or any(
            t.stride(3) != 1 or t.stride(2) != t.shape[3] for t in (gathered, *srcs)):
        copy_tokens(gathered, srcs, spans)
        return
    stream = torch.cuda.current_stream(gathered.device).cuda_stream
    for s, d, n in merged_runs(spans):
        head = 0
        for src in srcs:
            width = src.shape[3] * size  # one token's bytes
            for b in range(src.shape[0]):
                copy_rows_on_stream(gathered[b, head].data_ptr() + d * width, gathered.stride(1) * size,
                                    src[b, 0].data_ptr() + s * width, src.stride(1) * size, n * width,
                                    src.shape[1], stream, gathered.device.index)
            head += src.shape[1]


def _view(slot: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a uint8 slot from ``offset`` as a contiguous tensor of ``dtype`` and ``shape``."""
    return slot[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
