"""A kernel whose only work is a loop bounded by an integer argument, as the list and attention kernels have."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def loop_probe_kernel(OUT, n):
    """Writes n, counted one step at a time: a loop over ``range(0, n)`` with n a kernel argument."""
    steps = 0
    for _ in range(0, n):
        steps += 1
    tl.store(OUT, steps)
