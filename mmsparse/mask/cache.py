"""The one cache of what calls build and reuse: masks, validated topologies and first-query positions.

One policy for all of them: least recently used goes first once the entries' device bytes pass ``max_bytes`` or
their number passes ``max_entries``. A mask grows after it is stored (its kernels build block lists as they run,
and each CUDA stream that reads it builds its own copy's), so every store measures every entry again, copies
included, and evicts by those sizes: the bound holds at each store, and between two stores it is passed by at
most the lists that the cached masks build meanwhile. A mask measures itself again only when it has grown, so a
store costs little more than a look at each entry.

Thread-safe: one lock guards the entries, taken by hits (which move the entry to the newest end) as by stores,
evictions and per-stream copies; it is held for dictionary operations only (and on a store the sizes), never
while a mask is built. Stream-safe: a mask read on a CUDA stream other than the one that built it comes as that
stream's own copy (:class:`CachedMask`).

The package keeps one instance for the functional API (:data:`CACHE`); a ``TritonMBSAttnKernel`` keeps its own
masks in another, which goes with the module (its masks are never in :data:`CACHE`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from ..runtime.capture import keep_while_captured
from ..runtime.launch import stream_key, stream_of

MAX_BYTES = 1 << 30  # masks of 128k tokens hold a few MiB each: a bound for long-running processes, not a tuning knob
MAX_ENTRIES = 256


class CachedMask:
    """A cached mask, the CUDA stream it was built on (None off the GPU), and a copy for each other stream that
    has used it: :meth:`get`."""

    __slots__ = ("info", "stream", "copies", "lock")

    def __init__(self, info: Any, lock: threading.Lock) -> None:
        self.info = info
        self.stream = stream_key(info.device)
        self.copies: dict[tuple[int, int, int], Any] = {}
        self.lock = lock

    def get(self) -> Any:
        """The mask for the current stream: on the stream that built it (or off the GPU), the mask itself.

        Another stream must not read the mask's tensors before the building stream has written them, nor may the
        allocator hand their memory to the building stream while the other one still reads them. So the first
        time another stream asks, it waits for the building stream's work so far, the token-level tensors are
        recorded as used on it, and it gets a mask over those tensors whose block lists (built lazily) are its own
        and are only ever written and read on it. During CUDA-graph capture: a copy that shares what is built so
        far (torch.cuda.graph synchronises before capturing) and keeps the lists it builds in the capture to
        itself, since those are written only when the graph replays (:meth:`MaskInfo.sharing_built`); the graph
        keeps that copy, and so the tensors it reads, alive (:func:`keep_while_captured`), whatever the cache drops.
        """
        if self.stream is None:
            return self.info
        if torch.cuda.is_current_stream_capturing():
            captured = self.info.sharing_built()
            keep_while_captured(captured.device, captured)
            return captured
        current = stream_key(self.info.device)
        if current == self.stream:
            return self.info
        copy = self.copies.get(current)
        return copy if copy is not None else self._copy_for(current)

    def _copy_for(self, current: tuple[int, int, int]) -> Any:
        with self.lock:
            copy = self.copies.get(current)
            if copy is None:
                stream = stream_of(current)
                stream.wait_stream(stream_of(self.stream))
                for tensor in self.info.tensors():
                    tensor.record_stream(stream)
                copy = self.copies[current] = self.info.same_tensors()
        return copy

    @property
    def nbytes(self) -> int:
        """The mask's bytes and its copies' (a copy shares the token-level tensors, counted again in it)."""
        return self.info.nbytes + sum(copy.nbytes for copy in list(self.copies.values()))


class MaskCache:
    """Masks, topologies and small tensors under keys, least recently used out first past ``max_bytes`` device
    bytes or ``max_entries`` entries (see the module docstring)."""

    def __init__(self, max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()  # key -> (value, bytes when measured)
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        # Pickled (with a module) as its bounds only: its entries are device tensors, rebuilt on first use.
        return MaskCache, (self.max_bytes, self.max_entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Device bytes the entries hold now (measured again)."""
        with self._lock:
            return sum(_nbytes(value) for value, _ in self._entries.values())

    def mask(self, key: Any) -> Any | None:
        """The mask stored under ``key`` for the current stream, or None."""
        entry = self._hit(key)
        return None if entry is None else entry.get()

    def store_mask(self, key: Any, info: Any) -> Any:
        """Keep ``info`` under ``key`` and return it."""
        self._store(key, CachedMask(info, self._lock))
        return info

    def masks(self, copies: bool = False) -> list[Any]:
        """The stored masks as built, oldest first, and with ``copies`` the other streams' copies after each."""
        with self._lock:
            cached = [value for value, _ in self._entries.values() if isinstance(value, CachedMask)]
            return [m for c in cached for m in (c.info, *(list(c.copies.values()) if copies else ()))]

    def value(self, key: Any) -> Any | None:
        """Anything else stored under ``key`` (a topology, a small tensor), or None."""
        return self._hit(key)

    def store_value(self, key: Any, value: Any) -> Any:
        """Keep ``value`` (a topology, a tensor) under ``key`` and return it."""
        self._store(key, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    @contextlib.contextmanager
    def limits(self, max_bytes: int | None = None, max_entries: int | None = None) -> Iterator[MaskCache]:
        """Other bounds inside the block (tests of eviction, tight memory); the old ones after it."""
        previous = self.max_bytes, self.max_entries
        self.max_bytes = previous[0] if max_bytes is None else max_bytes
        self.max_entries = previous[1] if max_entries is None else max_entries
        try:
            yield self
        finally:
            self.max_bytes, self.max_entries = previous

    # internals ---------------------------------------------------------------------------------------------------

    def _hit(self, key: Any) -> Any | None:
        with self._lock:  # uncontended but for stores: a store iterates the entries this reorders
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        return entry[0]

    def _store(self, key: Any, value: Any) -> None:
        size = _nbytes(value)
        with self._lock:
            self._entries[key] = (value, size)
            self._entries.move_to_end(key)
            # Every entry as it is now: the masks stored earlier have built lists (and copies) since.
            sizes = [(k, v, _nbytes(v)) for k, (v, _) in self._entries.items()]
            for k, v, now in sizes:  # sizes replaced in place: the order and the keys stay
                self._entries[k] = (v, now)
            total = sum(now for _, _, now in sizes)
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or total > self.max_bytes):
                _, (_, evicted) = self._entries.popitem(last=False)
                total -= evicted


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    return int(getattr(value, "nbytes", 0))


CACHE = MaskCache()
