"""What a CUDA graph reads lives as long as the graph.

A kernel captured in a graph reads its tensors' addresses at every replay. Tensors allocated during the capture
belong to the graph's private memory pool, which lives as long as the graph; but a capture also reads what was
made before it: a cached mask's token tensors and block lists, a topology's tables. Those are kept by caches
that ``clear_caches()`` or an eviction empties, and their memory could then hold other data at the next replay.
So whatever a capture reads from outside its pool is handed to :func:`keep_while_captured`, which ties it to the
graph being captured: a CUDA user object that the graph (and every executable graph made from it) holds, whose
destructor tells us when the last of them is gone. The references are dropped later, on a thread of the program:
the destructor runs on a driver thread, where no CUDA call may be made, and freeing a tensor can make one.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

import torch

from .cuda_driver import (
    CU_GRAPH_USER_OBJECT_MOVE,
    CU_STREAM_CAPTURE_STATUS_ACTIVE,
    CU_USER_OBJECT_NO_DESTRUCTOR_SYNC,
    HOST_FN,
    CudaDriverError,
    call,
    driver,
)

_lock = threading.Lock()
_kept: dict[int, list[Any]] = {}  # token -> what the capture of that token reads
_by_capture: dict[tuple[int, int], int] = {}  # (device, capture id) -> token of the capture in progress
_released: list[int] = []  # tokens whose graphs are gone (appended by the destructor)
_tokens = itertools.count(1)


def _graph_gone(user_data: int | None) -> None:
    """The destructor of a capture's user object, on a driver thread: only note it (a list append)."""
    _released.append(int(user_data or 0))


_DESTRUCTOR = HOST_FN(_graph_gone)  # kept for the process: the driver calls it after its graphs are gone


def keep_while_captured(device: torch.device, *objects: Any) -> None:
    """Keep ``objects`` alive as long as the CUDA graph being captured on the current stream of ``device``, if
    one is (else nothing happens). Where the driver cannot tell which graph is being captured, they are kept for
    the process."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return
    _drop_released()
    stream = torch.cuda.current_stream(device)
    capture = _capture(stream)
    key = None if capture is None else (stream.device_index, capture[0])
    with _lock:
        token = _by_capture.get(key) if key is not None else None
        if token is None:
            token = next(_tokens)
            _kept[token] = []
            if capture is not None:
                _by_capture[key] = token
                _attach(capture[1], token)
        _kept[token].extend(objects)


def kept_count() -> int:
    """How many captures' objects are kept now (for tests)."""
    _drop_released()
    with _lock:
        return len(_kept)


def _drop_released() -> None:
    """Drop what the captures whose graphs are gone kept (on this thread: freeing a tensor may call CUDA)."""
    if not _released:
        return
    with _lock:
        while _released:
            token = _released.pop()
            _kept.pop(token, None)
            for key in [key for key, value in _by_capture.items() if value == token]:
                del _by_capture[key]


def _capture(stream: torch.cuda.Stream) -> tuple[int, ctypes.c_void_p] | None:
    """(id, graph) of the capture in progress on ``stream``, or None where the driver cannot say."""
    if driver() is None:
        return None
    status, capture, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
    try:
        call("cuStreamGetCaptureInfo_v2", ctypes.c_void_p(stream.cuda_stream), ctypes.byref(status),
             ctypes.byref(capture), ctypes.byref(graph), None, None)
    except CudaDriverError:
        return None
    return (capture.value, graph) if status.value == CU_STREAM_CAPTURE_STATUS_ACTIVE else None


def _attach(graph: ctypes.c_void_p, token: int) -> None:
    """Give ``graph`` a user object whose destructor releases ``token``. Where that fails, the token's objects
    stay kept for the process."""
    user_object = ctypes.c_void_p()
    try:
        call("cuUserObjectCreate", ctypes.byref(user_object), ctypes.c_void_p(token), _DESTRUCTOR, 1,
             CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)
        call("cuGraphRetainUserObject", graph, user_object, 1, CU_GRAPH_USER_OBJECT_MOVE)
    except CudaDriverError:
        return
