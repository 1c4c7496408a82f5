"""A small thread-safe map that keeps its most recently used entries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class RecentlyUsed(Generic[V]):
    """At most ``max_entries`` values by key; the least recently used goes first, one at a time, so a workload
    that cycles through a few more keys than fit loses only those, not everything. One lock, held for dictionary
    operations only: a value is made outside it (two threads missing on one key may both make one; the first
    stored is kept and returned to both)."""

    __slots__ = ("_entries", "_lock", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def store(self, key: Hashable, value: V) -> V:
        """Keep ``value`` under ``key`` and return the value kept there (another thread's, if it stored first)."""
        with self._lock:
            kept = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return kept

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def values(self) -> list[V]:
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
