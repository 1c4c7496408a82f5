"""Tuning: the kernels' tiles and the thresholds that switch a path, for experiments and for GPUs the tables do
not cover. Nothing here is needed to use mmsparse: the defaults are tables measured per head dim, dtype and GPU
(docs/tuning.md says how), and a tile outside them is exact but not promised to be fast.

    import dataclasses, torch
    from mmsparse.tuning import Tile, default_config, use_tuning

    with use_tuning(short_keys=0):  # the long-sequence tiles at every length
        ...
    table = default_config(128, torch.bfloat16, torch.device("cuda"))
    with use_tuning(dataclasses.replace(table, fwd=Tile(64, 64), fwd_short=None)):
        ...

The settings are the thread's and are read when a call's forward runs, as :func:`mmsparse.use_config`'s
``deterministic`` is. ``MMSPARSE_GLUON=0`` in the environment switches the Gluon Hopper kernels off.
"""

from __future__ import annotations

import torch

from .attention.config import DEFAULT_SETTINGS, THRESHOLDS, KernelConfig, Tile, kernel_config, use_tuning
from .checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, check_device, head_dim_supported

__all__ = ["THRESHOLDS", "KernelConfig", "Tile", "default_config", "use_tuning"]


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> KernelConfig:
    """The table's config for calls of this head dim and dtype on ``device`` (no thread's tuning applied): the
    starting point for a :func:`use_tuning` block."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int; got {type(head_dim).__name__} {head_dim!r}")
    if not head_dim_supported(head_dim):
        raise ValueError(f"head_dim must be {SUPPORTED_HEAD_DIMS}; got {head_dim}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(map(str, SUPPORTED_DTYPES))}; got {dtype!r}")
    return kernel_config(head_dim, dtype, check_device(device), DEFAULT_SETTINGS)
