"""Launching Triton kernels with little host work, CUDA stream keys, scratch memory for device-side descriptors."""
