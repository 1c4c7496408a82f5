"""NaN-poisoned ``torch.empty``, one definition for the test session (``tests/conftest.py``) and the stress tools
(``tests/stress/fuzz.py``, ``cold_runs.py``): an element a kernel forgets to write shows up in the comparison
instead of passing as leftover memory."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Callable

import torch

# Devices the kernels write: CUDA, and the CPU under Triton's interpreter.
KERNEL_DEVICES = ("cuda", "cpu")


def poisoned(empty: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``empty`` whose floating result starts as NaN and integer result as -1 (all bits set). Tensor subclasses
    (fake, functional tensors), other devices, empty results and tracing under torch.compile are left alone."""

    @functools.wraps(empty)
    def wrapper(*args, **kwargs):
        out = empty(*args, **kwargs)
        if torch.compiler.is_compiling():  # first: nothing below gets traced
            return out
        if type(out) is not torch.Tensor or not out.numel() or out.device.type not in KERNEL_DEVICES:
            return out
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        elif out.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            out.fill_(-1)
        return out

    return wrapper


_EMPTY_FACTORIES = ("empty", "empty_strided", "empty_like")  # the launchers allocate their outputs with these


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Within it every ``torch.empty``, ``torch.empty_strided`` and ``torch.empty_like`` is :func:`poisoned`."""
    originals = {name: getattr(torch, name) for name in _EMPTY_FACTORIES}
    for name, original in originals.items():
        setattr(torch, name, poisoned(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)
