"""The exchange by peer copies (:mod:`.peer_memory`): each rank writes its K and V (the fetch) or its gathered
keys' dK/dV (the return) into its slot as they are, meets the peers at a barrier, and copies what it needs out of
theirs: on GPUs one 2-D copy per run of chunks and batch row, straight into place, by copy engines on a stream
per peer (no SMs, beside the work that follows), with nothing packed per peer and nothing to unpack. The same
bytes as point to point, summed in the same order by :mod:`.exchange`, so the same bits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..runtime.arrival import KeysArrival
from .fetch import Fetch
from .peer_memory import PeerMemory
from .routes import Routes
from .token_runs import copy_tokens


def start_fetch(cp: Any, memory: PeerMemory, k: torch.Tensor, v: torch.Tensor, routes: Routes) -> Fetch:
    """:func:`.exchange.start_fetch` by peer copies, along ``routes`` (the call's key order). Each rank's slot,
    reserved for ``routes.local_lengths``, holds its K then its V, ``[B, Hkv, S_local, D]`` each. Its
    :meth:`Fetch.arriving` gives the gathered K/V at once, with a :class:`KeysArrival` over the keys after the rank's
    own leading chunks."""
    batch, hkv, local_len, dim = k.shape
    token = dim * k.element_size()
    slot = memory.slot()
    half = batch * hkv * local_len * token
    _view(slot, 0, k.dtype, k.shape).copy_(k)
    _view(slot, half, v.dtype, v.shape).copy_(v)
    memory.barrier()  # every rank's K/V is in its slot
    gathered = k.new_empty((batch, 2 * hkv, routes.gathered, dim))
    for peer, message in routes.fetch_pulls.items():
        held = routes.local_lengths[peer]
        for s, d, n in message.spans:
            for b in range(batch):
                for part in range(2):  # K, then V
                    offset = ((part * batch + b) * hkv * held + s) * token
                    memory.pull(peer, offset, held * token, gathered[b, part * hkv : (part + 1) * hkv], d, n)
        cp.bytes_received += message.tokens * 2 * batch * hkv * token
    cp.bytes_sent += sum(routes.served.values()) * 2 * batch * hkv * token
    copy_tokens(gathered, (k, v), routes.own)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        memory.wait()
        return gathered[:, :hkv], gathered[:, hkv:]

    def arriving() -> tuple[torch.Tensor, torch.Tensor, KeysArrival | None]:
        signal = memory.signal_arrival()
        if signal is None:
            return (*finish(), None)
        # the own chunks' copy above is queued on the current stream, so those keys are there for its kernels
        return gathered[:, :hkv], gathered[:, hkv:], KeysArrival(*signal, routes.present, memory.wait)

    return Fetch(finish, arriving)


def start_return(cp: Any, memory: PeerMemory, dkv_gathered: torch.Tensor,
                 routes: Routes) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
    """The return's transfer by peer copies, along ``routes``: each owner copies its chunks' contributions out of
    each peer's slot. Each rank's slot, reserved for ``routes.gathered_lengths``, holds its gathered keys' dK/dV as
    they are, ``[B, 2 Hkv, S_gathered, D]``. Returns (each peer's contributions to this rank's chunks, in
    ``served_chunks`` order, once ``wait()`` has returned; ``wait``)."""
    batch, heads, _, dim = dkv_gathered.shape
    token = dim * dkv_gathered.element_size()
    slot = memory.slot()
    _view(slot, 0, dkv_gathered.dtype, tuple(dkv_gathered.shape)).copy_(dkv_gathered)
    memory.barrier()  # every rank's contributions are in its slot
    received = {}
    for peer, message in routes.return_pulls.items():
        held = routes.gathered_lengths[peer]
        received[peer] = dkv_gathered.new_empty((batch, heads, message.tokens, dim))
        rows = received[peer].view(batch * heads, message.tokens, dim)
        for s, d, n in message.spans:
            memory.pull(peer, s * token, held * token, rows, d, n)
        cp.bytes_received += message.tokens * batch * heads * token
    cp.bytes_sent += routes.fetched * batch * heads * token
    return received, memory.wait


def _view(slot: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes of a uint8 slot from ``offset`` as a contiguous tensor of ``dtype`` and ``shape``."""
    return slot[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
