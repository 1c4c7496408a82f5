"""Device chores of the harness: synchronise, count and free memory, tell whether the CUDA context survived."""

from __future__ import annotations

import gc

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_memory(device: torch.device) -> None:
    # CPU tensors go by reference count; a full collection of a large heap (a test session's) costs ~0.5 s a call
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def device_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False
