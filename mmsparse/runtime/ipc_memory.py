"""Device memory shared with other processes of the host by CUDA IPC, through the driver, in each device's own
context: a rank allocates a block, hands its handle to the others, and each opens it on its own GPU (peer access
enabled by the open) and copies out of it with its own copy engines. torch's IPC opens a handle in the context of
the device that holds the memory, so a copy out of it from another GPU's context is staged through the host
(about 28 GB/s measured on 2 H200s, against about 300 GB/s over NVLink)."""

from __future__ import annotations

import ctypes

import torch

from .cuda_driver import CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, IpcMemHandle, bind_context, call


class _DeviceBytes:
    """``nbytes`` at a device address, for ``torch.as_tensor`` (the CUDA array interface), without a copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


class SharedBlock:
    """``nbytes`` of the device's memory, allocated outside torch's caching allocator so that one IPC handle names
    exactly it. ``tensor``: a uint8 view to write it through; ``handle``: the bytes another process opens it by.
    :meth:`free` releases it once no process still reads it."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        bind_context(device.index)
        address = ctypes.c_uint64()
        call("cuMemAlloc_v2", ctypes.byref(address), max(nbytes, 1))
        self.address = address.value
        handle = IpcMemHandle()
        call("cuIpcGetMemHandle", ctypes.byref(handle), self.address)
        self.handle = bytes(handle.reserved)
        self.tensor = torch.as_tensor(_DeviceBytes(self.address, nbytes), device=device)

    def free(self) -> None:
        self.tensor = None
        bind_context(self.device.index)
        call("cuMemFree_v2", self.address)


def open_block(handle: bytes, device: torch.device) -> int:
    """The address, in ``device``'s context, of another process's block named by ``handle``."""
    bind_context(device.index)
    address = ctypes.c_uint64()
    named = IpcMemHandle((ctypes.c_ubyte * 64).from_buffer_copy(handle))
    call("cuIpcOpenMemHandle_v2", ctypes.byref(address), named, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    return address.value


def close_block(address: int, device: torch.device) -> None:
    bind_context(device.index)
    call("cuIpcCloseMemHandle", address)
