"""How many multiprocessors a kernel launched on a stream may hold at once: the device's, or fewer where the process
runs under MPS with an SM limit (set by its control daemon or by ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) or the
stream belongs to a green context of fewer SMs (``torch.cuda.green_contexts``).

The ordered dQ writer ranks its adds for the programs that run side by side (``mask.add_order``): where fewer run at
once than it ranked for, a program can wait for one that starts only once it has ended, and the kernel never ends.
So that count is read when the call launches, from the driver: the current context's execution affinity (MPS
limits), and the SMs of the stream's green context. A query that fails (an older driver, no context) is skipped;
the environment's MPS percentage still counts, and the device's own count stands where nothing else is known.
"""

from __future__ import annotations

import ctypes
import functools
import os
from types import SimpleNamespace

import torch

from .cuda_driver import CudaDriverError, bind_context, driver

CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0
CU_DEV_RESOURCE_TYPE_SM = 1
MPS_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
SMS_PER_TPC = 2  # MPS and green contexts hand out whole TPCs (thread processing clusters) of two SMs


class ExecAffinity(ctypes.Structure):
    """CUexecAffinityParam of type CU_EXEC_AFFINITY_TYPE_SM_COUNT: the SMs the context may use."""

    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]


class DevResource(ctypes.Structure):
    """CUdevResource of type CU_DEV_RESOURCE_TYPE_SM: its type, 92 bytes of padding, then the SM count, which the
    union's SM member holds first. The header's struct takes 144 bytes; the rest is room for later drivers'."""

    _fields_ = [("type", ctypes.c_int), ("padding", ctypes.c_ubyte * 92), ("sm_count", ctypes.c_uint),
                ("rest", ctypes.c_ubyte * 412)]


def usable_multiprocessors(device: torch.device, stream: int) -> int:
    """The SMs that a kernel launched on ``stream`` (a ``torch.cuda.Stream.cuda_stream`` handle) of the CUDA
    ``device`` may hold at once: the least of the device's count, an MPS limit in this process's environment, the
    current context's execution affinity and the SMs of the stream's green context. While the stream is captured
    into a CUDA graph the driver is not asked (a call that capture does not allow would void the graph)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = device_multiprocessors(index)
    limits = [count, mps_limit(count, os.environ.get(MPS_PERCENTAGE))]
    if not torch.cuda.is_current_stream_capturing():
        limits += driver_limits(index, stream)
    return max(1, min(limit for limit in limits if limit))


@functools.cache
def device_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def mps_limit(count: int, percentage: str | None) -> int | None:
    """The SMs of ``count`` that an MPS client may use under ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=percentage``, in
    whole TPCs, rounded down (at least one TPC); None without a limit (unset, not a number, or not below 100)."""
    try:
        share = float(percentage) if percentage else 100.0
    except ValueError:
        return None
    if not 0.0 < share < 100.0:
        return None
    return max(SMS_PER_TPC, int(count * share / 100.0) // SMS_PER_TPC * SMS_PER_TPC)


def driver_limits(index: int, stream: int) -> list[int]:
    """The SM counts the driver reports for a kernel on ``stream``: the current context's execution affinity, and
    the SMs of the stream's green context (where it has one). Empty where the driver cannot say."""
    calls = optional_calls()
    if calls is None:
        return []
    try:
        bind_context(index)  # the affinity is the current context's: the device's primary one where none is
    except CudaDriverError:
        return []
    found = []
    affinity = ExecAffinity()
    if calls.exec_affinity is not None and calls.exec_affinity(
            ctypes.byref(affinity), CU_EXEC_AFFINITY_TYPE_SM_COUNT) == 0:
        found.append(affinity.sm_count)
    context, green = ctypes.c_void_p(), ctypes.c_void_p()
    if calls.stream_context is not None and calls.green_resource is not None and calls.stream_context(
            ctypes.c_void_p(stream), ctypes.byref(context), ctypes.byref(green)) == 0 and green.value:
        resource = DevResource()
        if calls.green_resource(green, ctypes.byref(resource), CU_DEV_RESOURCE_TYPE_SM) == 0 and (
                resource.type == CU_DEV_RESOURCE_TYPE_SM):
            found.append(resource.sm_count)
    return [sms for sms in found if sms > 0]


@functools.cache
def optional_calls() -> SimpleNamespace | None:
    """The driver calls this module makes, each None where the driver lacks it (execution affinity since CUDA 11.4,
    a stream's green context since 12.5); None without a driver library."""
    lib = driver()
    if lib is None:
        return None
    p = ctypes.POINTER

    def bound(name: str, argtypes: list) -> object | None:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    return SimpleNamespace(
        exec_affinity=bound("cuCtxGetExecAffinity", [p(ExecAffinity), ctypes.c_int]),
        stream_context=bound("cuStreamGetCtx_v2", [ctypes.c_void_p, p(ctypes.c_void_p), p(ctypes.c_void_p)]),
        green_resource=bound("cuGreenCtxGetDevResource", [ctypes.c_void_p, p(DevResource), ctypes.c_int]),
    )
