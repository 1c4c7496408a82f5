"""Context-parallel calls on one process group come from one thread at a time.

Every rank must make a group's exchanges (point to point, the peer-copy barriers, all-gathers) in the same order.
Two threads of a rank inside calls on one group at once would interleave their exchanges in an order the other
ranks cannot follow: a hang, or one thread's K/V taken for another's where the sizes agree. Such an overlap is a
``RuntimeError`` that says so. A thread may nest calls (an activation-checkpoint recompute runs a forward inside
the backward, on autograd's thread), and any thread may call once no other is inside.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_INSIDE: dict[int, tuple[int, int]] = {}  # id(group) -> (the thread inside its calls, how deep)
_LOCK = threading.Lock()


@contextmanager
def one_thread_on(group: Any) -> Iterator[None]:
    """Hold ``group`` for this thread while the block runs its exchanges; another thread inside is an error."""
    key, me = id(group), threading.get_ident()
    with _LOCK:
        inside = _INSIDE.get(key)
        if inside is not None and inside[0] != me:
            raise RuntimeError(
                "a context-parallel call on this process group is running in another thread: every rank must "
                "make the group's exchanges in the same order, which calls from two threads at once cannot keep. "
                "Make the calls on one group from one thread at a time, or give each thread a group of its own "
                "(dist.new_group)")
        _INSIDE[key] = (me, 1 if inside is None else inside[1] + 1)
    try:
        yield
    finally:
        with _LOCK:
            thread, depth = _INSIDE[key]
            if depth == 1:
                del _INSIDE[key]
            else:
                _INSIDE[key] = (thread, depth - 1)
