"""Whether the Gluon Hopper kernels run on a device. Decided once per process, before any kernel runs: after
that a failing Gluon kernel raises like any other (a fallback would turn a bug into a slowdown)."""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch
import triton

GLUON_MIN_TRITON = (3, 6)  # the Gluon API these kernels are written for (it is experimental and still moves)


def hopper_gluon_available(device_index: int) -> bool:
    """The Gluon kernels run on this device: ``MMSPARSE_GLUON`` is not "0", the GPU is a Hopper (sm_90), Triton
    is at least GLUON_MIN_TRITON, and the Gluon kernels and their launchers import."""
    if os.environ.get("MMSPARSE_GLUON", "1") == "0":
        return False
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    return gluon_importable()


@functools.cache
def gluon_importable() -> bool:
    """Triton is recent enough, and the Gluon kernels and the host descriptors of their launchers import."""
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < GLUON_MIN_TRITON or importlib.util.find_spec("triton.experimental.gluon") is None:
        return False
    try:
        from ..kernels.gluon import dkdv, dq, forward  # noqa: F401
        from . import host_tma  # noqa: F401
    except ImportError as err:  # an API this Triton lacks: the tl kernels run, and the user is told once
        warnings.warn(f"mmsparse: the Gluon Hopper kernels do not import with triton {triton.__version__} "
                      f"({err}); the tl kernels run instead", RuntimeWarning, stacklevel=2)
        return False
    return True
