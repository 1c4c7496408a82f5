"""Scratch memory for device-side tensor descriptors (the tl kernels' TMA path), from torch's allocator."""

from __future__ import annotations

import importlib

import torch
import triton

from .launch import current_device
from .own_thread import on_own_thread

try:  # once: this runs before every launch (an import statement in the function costs ~1 us a call)
    from triton.runtime import _allocation
except ImportError:  # a Triton without it: the call below raises where it is needed
    _allocation = None


def ensure_tma_allocator(device: torch.device) -> None:
    """Device-side tensor descriptors need scratch memory from Triton's allocator. Install a torch-backed one
    unless the user has set their own. Triton keeps the allocator in a context variable, so each thread (the
    autograd engine's, a user's worker) needs its own: call this before every launch, not once."""
    if device.type != "cuda":
        return
    allocation = _allocation or importlib.import_module("triton.runtime._allocation")
    if allocation._allocator.get() is allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)


# One scratch buffer per (device, stream), grown when a launch needs more: kernels on one stream run in order,
# so the next launch may overwrite what the previous one read, and a launch skips an allocation (~10 us host).
# A CUDA graph gets private scratch: its replays may run beside eager work on any stream. Kept as (buffer, its
# address): the launcher takes the address as it is, where a tensor costs it a data_ptr call and a driver query.
_SCRATCH: dict[tuple[int, int | None], tuple[torch.Tensor, int]] = {}


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor | int:
    """Triton's allocator: a buffer of ``size`` bytes for a launch on ``stream``, the kept one's address, or a new
    tensor in a CUDA-graph capture (Triton holds it for the launch; the graph's pool keeps its memory)."""
    key = (current_device(), stream)
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", key[0]))
    kept = _SCRATCH.get(key)
    if kept is None or kept[0].numel() < size:
        buf = _kept_buffer(size, key)
        kept = _SCRATCH[key] = (buf, buf.data_ptr())
    return kept[1]


def _kept_buffer(size: int, key: tuple[int, int | None]) -> torch.Tensor:
    """A buffer of ``size`` bytes from the device's own pool, tied to the launch's stream (``key``: device, raw
    stream handle), allocated on mmsparse's own thread (:mod:`.own_thread`: not in a CUDA graph's pool while
    ``reduce-overhead`` warms up, where a kept buffer fails the graph's check and its memory would be handed out
    again)."""
    device, handle = key

    def allocate() -> torch.Tensor:
        stream = (torch.cuda.ExternalStream(handle, device=device) if handle
                  else torch.cuda.default_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", device))

    return on_own_thread(allocate)


def clear_scratch() -> None:
    """Drop the kept scratch buffers (a launch after this allocates anew)."""
    _SCRATCH.clear()
