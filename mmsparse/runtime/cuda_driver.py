"""The few CUDA driver calls that torch has no Python API for, through ctypes on the driver library that torch
has already loaded: streams of our own (torch's come from a shared pool) and the lifetime of what a CUDA graph
reads (user objects), and memory other processes open (CUDA IPC) with copies out of it in this device's own
context."""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

CU_STREAM_NON_BLOCKING = 0x1  # does not synchronise with the legacy default stream, as torch's streams
CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 0x1  # the only flag cuUserObjectCreate takes
CU_GRAPH_USER_OBJECT_MOVE = 0x1  # the graph takes over the caller's reference
CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
CUDA_ERROR_INVALID_CONTEXT = 201
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMORYTYPE_DEVICE = 2
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # CUhostFn: void (*)(void *user_data)


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D: ``Height`` rows of ``WidthInBytes`` between two pitched regions."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


class IpcMemHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes that name an allocation for other processes."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # bytes, not a C string: zeros inside are part of it


class CudaDriverError(RuntimeError):
    """A driver call returned an error code."""


@functools.cache
def driver() -> Any | None:
    """The CUDA driver library with the signatures used here, or None where it cannot be loaded."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    p, c_int, c_uint, c_uint64 = ctypes.POINTER, ctypes.c_int, ctypes.c_uint, ctypes.c_uint64
    signatures = {
        "cuInit": [c_uint],
        "cuDeviceGet": [p(c_int), c_int],
        "cuCtxGetCurrent": [p(ctypes.c_void_p)],
        "cuCtxGetDevice": [p(c_int)],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), c_int],
        "cuStreamCreate": [p(ctypes.c_void_p), c_uint],
        # (stream, status, capture id, graph, dependencies, dependency count): the form every driver since CUDA
        # 11.3 exports under this name
        "cuStreamGetCaptureInfo_v2": [ctypes.c_void_p, p(c_int), p(c_uint64), p(ctypes.c_void_p),
                                      p(ctypes.c_void_p), p(ctypes.c_size_t)],
        "cuUserObjectCreate": [p(ctypes.c_void_p), ctypes.c_void_p, HOST_FN, c_uint, c_uint],
        "cuGraphRetainUserObject": [ctypes.c_void_p, ctypes.c_void_p, c_uint, c_uint],
        "cuMemcpy2DAsync_v2": [p(Memcpy2D), ctypes.c_void_p],
        "cuMemAlloc_v2": [p(c_uint64), ctypes.c_size_t],
        "cuMemFree_v2": [c_uint64],
        "cuIpcGetMemHandle": [p(IpcMemHandle), c_uint64],
        "cuIpcOpenMemHandle_v2": [p(c_uint64), IpcMemHandle, c_uint],
        "cuIpcCloseMemHandle": [c_uint64],
    }
    try:
        for fn_name, argtypes in signatures.items():
            fn = getattr(lib, fn_name)
            fn.argtypes, fn.restype = argtypes, c_int
    except AttributeError:  # a driver older than these calls
        return None
    return lib


def call(name: str, *args: Any) -> None:
    """Call driver function ``name``; raise :class:`CudaDriverError` on an error code."""
    lib = driver()
    if lib is None:
        raise CudaDriverError("the CUDA driver library (libcuda) could not be loaded")
    result = getattr(lib, name)(*args)
    if result != 0:
        raise CudaDriverError(f"{name} failed with CUDA driver error {result}")


def bind_context(device_index: int) -> None:
    """Make the device's primary context current on this thread (torch's, which it has retained), unless it is:
    driver calls that create objects act on the current context, and a thread need not have one yet."""
    current, on = ctypes.c_void_p(), ctypes.c_int(-1)
    call("cuCtxGetCurrent", ctypes.byref(current))
    if current.value and driver().cuCtxGetDevice(ctypes.byref(on)) == 0 and on.value == device_index:
        return
    device, primary = ctypes.c_int(), ctypes.c_void_p()
    call("cuDeviceGet", ctypes.byref(device), device_index)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(primary), device)
    call("cuCtxSetCurrent", primary)


def copy_rows_on_stream(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: int,
                        device_index: int) -> None:
    """``rows`` rows of ``width`` bytes from address ``src`` (rows ``src_pitch`` bytes apart) to ``dst`` (rows
    ``dst_pitch`` apart) on ``stream`` of the device, in the device's own context: its copy engines run it, also
    from another GPU's memory that this context has opened (:mod:`.ipc_memory`)."""
    copy = Memcpy2D(srcMemoryType=CU_MEMORYTYPE_DEVICE, srcDevice=src, srcPitch=src_pitch,
                    dstMemoryType=CU_MEMORYTYPE_DEVICE, dstDevice=dst, dstPitch=dst_pitch, WidthInBytes=width,
                    Height=rows)
    bind_context(device_index)
    call("cuMemcpy2DAsync_v2", ctypes.byref(copy), ctypes.c_void_p(stream))


def write_value_on_stream(address: int, value: int, stream: int, device_index: int) -> None:
    """Write the 32-bit ``value`` at device ``address`` on ``stream``, once what is queued on it before is done and
    visible, with no kernel: a stream memory operation (``cuStreamWriteValue32``), which takes no SM, so a kernel
    may wait for it while holding every SM. Raises :class:`CudaDriverError` where the driver has no such call."""
    lib = driver()
    write = getattr(lib, "cuStreamWriteValue32_v2", None) if lib is not None else None
    if write is None:
        raise CudaDriverError("this CUDA driver has no cuStreamWriteValue32_v2")
    write.argtypes, write.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint], ctypes.c_int
    bind_context(device_index)
    call("cuStreamWriteValue32_v2", ctypes.c_void_p(stream), ctypes.c_uint64(address), ctypes.c_uint32(value),
         ctypes.c_uint(0))  # flags 0: ordered after the stream's earlier writes
