"""Work on a thread of mmsparse's own, for allocations that must stay out of a CUDA graph's private pool.

Under ``torch.compile(mode="reduce-overhead")`` the warm-up routes every allocation of the calling thread to the
CUDA graph's pool, whatever the stream, and the graph checks that it tracks everything live there. What mmsparse
keeps past a call (a kept mask and its lists, the scratch of device-side descriptors) is therefore allocated on this
thread. One worker for the process, made on first use; work already on it runs in place (a kept mask's build may
launch a kernel that asks for scratch)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_EXECUTOR: ThreadPoolExecutor | None = None
_LOCK = threading.Lock()
_ON_IT = threading.local()


def on_own_thread(work: Callable[[], T]) -> T:
    """``work()``, run on mmsparse's own thread (in place when called there), its result or its exception."""
    if getattr(_ON_IT, "value", False):
        return work()
    return _executor().submit(work).result()


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        with _LOCK:
            if _EXECUTOR is None:
                _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmsparse-own",
                                               initializer=_mark)
    return _EXECUTOR


def _mark() -> None:
    _ON_IT.value = True
