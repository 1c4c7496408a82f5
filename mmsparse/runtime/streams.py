"""CUDA streams of mmsparse's own: the backward's concurrent dQ pass, and the builds of what is kept past a call.

``torch.cuda.Stream()`` hands out streams round-robin from a pool of 32 per device and priority, shared with every
other user of the process: once a program has drawn more than that (per-request streams, FSDP, other libraries),
a new one is a stream someone else already uses. A side stream that is another caller's stream would take that
caller's work into a CUDA-graph capture (or fail the capture) and serialise with it. So the side streams are
created through the driver, each a stream no one else holds; torch sees them as external streams.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

from .cuda_driver import CU_STREAM_NON_BLOCKING, CudaDriverError, bind_context, call, driver
from .own_thread import on_own_thread


def own_stream(device_index: int) -> torch.cuda.Stream:
    """A new CUDA stream on the device that no pool hands out, kept for the process (never destroyed: a captured
    graph or a kernel in flight may still use it). Where the driver library cannot be used, a stream from torch's
    pool, with a warning."""
    if driver() is None:
        warnings.warn("mmsparse: the CUDA driver library could not be loaded; the backward's side stream comes from "
                      "torch's shared stream pool and may be another caller's", RuntimeWarning, stacklevel=2)
        return torch.cuda.Stream(device=device_index)
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        try:
            bind_context(device_index)
            call("cuStreamCreate", ctypes.byref(handle), CU_STREAM_NON_BLOCKING)
        except CudaDriverError as err:
            raise RuntimeError(f"mmsparse could not create a CUDA stream on device {device_index}: {err}") from err
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", device_index))


_BUILD_STREAMS: dict[int, torch.cuda.Stream] = {}
_BUILD_LOCK = threading.Lock()


def build_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for building what mmsparse keeps past a call (kept masks and their lists, the dQ adds'
    ranks): one for the process, made on first use. Its users make it wait for the caller's stream before a build,
    and the readers wait for it after."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return kept_own_stream(_BUILD_STREAMS, _BUILD_LOCK, index, index)


def kept_own_stream(streams: dict, lock: threading.Lock, key: Hashable, device_index: int) -> torch.cuda.Stream:
    """``streams[key]``: an :func:`own_stream` of the device, made on first use (under ``lock``, so that threads
    asking at once share one) and kept for the process."""
    stream = streams.get(key)
    if stream is None:
        with lock:
            stream = streams.get(key)
            if stream is None:
                stream = streams[key] = own_stream(device_index)
    return stream


T = TypeVar("T")


def on_build_stream(device: torch.device, make: Callable[[], T]) -> T:
    """``make()`` run on mmsparse's own thread (:mod:`mmsparse.runtime.own_thread`) and the device's build stream,
    after the current stream's work so far: for what is kept past a call, whose memory must come from neither the
    caller's stream nor, under ``torch.compile(mode="reduce-overhead")``, a CUDA graph's private pool (the warm-up
    routes every allocation of the calling thread there). Readers make their stream wait for the build stream."""
    build = build_stream(device)
    build.wait_stream(torch.cuda.current_stream(device))

    def run() -> T:
        with torch.cuda.device(device), torch.cuda.stream(build):
            return make()

    return on_own_thread(run)
