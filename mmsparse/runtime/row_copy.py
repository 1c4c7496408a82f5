"""A run of tokens copied between two ``[rows, tokens, width]`` tensors, every row at once.

On a GPU that is one pitched 2-D copy of the driver (``cuMemcpy2DAsync``), which copy engines run: no SMs, and
the source may be another GPU's memory opened in this process (CUDA IPC). Elsewhere, or where the driver cannot
take the pitch, it is one strided torch copy."""

from __future__ import annotations

import ctypes

import torch

from .cuda_driver import CU_MEMORYTYPE_DEVICE, Memcpy2D, bind_context, call, driver

# The largest pitch a 2-D copy takes (the devices' CU_DEVICE_ATTRIBUTE_MAX_PITCH is 2^31 - 1 bytes).
MAX_PITCH = 2**31 - 1


def copy_token_run(dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int, count: int,
                   stream: torch.cuda.Stream | None = None) -> None:
    """``dst[:, dst_start:dst_start + count] = src[:, src_start:src_start + count]``.

    Args:
        dst, src: contiguous ``[rows, tokens, width]`` of one dtype, the same rows and width (the tokens may
            differ); on the GPU ``dst`` is on ``stream``'s device and ``src`` on any GPU this process can read.
        stream: the CUDA stream of the copy (the current one when None); unused off the GPU.
    """
    if dst.dtype != src.dtype or dst.shape[0] != src.shape[0] or dst.shape[2:] != src.shape[2:]:
        raise ValueError(f"a token run copies between [rows, tokens, width] tensors of one dtype, rows and width; "
                         f"got {dst.dtype} {tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("a token run copies between contiguous tensors")
    if dst_start < 0 or src_start < 0 or dst_start + count > dst.shape[1] or src_start + count > src.shape[1]:
        raise ValueError(f"tokens [{src_start}, {src_start + count}) into [{dst_start}, {dst_start + count}) do not "
                         f"fit {src.shape[1]} and {dst.shape[1]} tokens")
    if count == 0 or dst.numel() == 0:
        return
    token_bytes = dst[0, 0].numel() * dst.element_size()
    dst_pitch, src_pitch = dst.shape[1] * token_bytes, src.shape[1] * token_bytes
    if dst.is_cuda and driver() is not None and max(dst_pitch, src_pitch) <= MAX_PITCH:
        stream = stream if stream is not None else torch.cuda.current_stream(dst.device)
        copy = Memcpy2D(srcMemoryType=CU_MEMORYTYPE_DEVICE, srcDevice=src.data_ptr() + src_start * token_bytes,
                        srcPitch=src_pitch, dstMemoryType=CU_MEMORYTYPE_DEVICE,
                        dstDevice=dst.data_ptr() + dst_start * token_bytes, dstPitch=dst_pitch,
                        WidthInBytes=count * token_bytes, Height=dst.shape[0])
        bind_context(dst.device.index)
        call("cuMemcpy2DAsync_v2", ctypes.byref(copy), ctypes.c_void_p(stream.cuda_stream))
        return
    target = dst[:, dst_start : dst_start + count]
    if dst.is_cuda:
        with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(dst.device)):
            target.copy_(src[:, src_start : src_start + count], non_blocking=True)
    else:
        target.copy_(src[:, src_start : src_start + count])
