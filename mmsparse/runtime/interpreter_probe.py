"""Triton's CPU interpreter: the lock its launches take, and whether it can run mmsparse's kernels here (asked once
a process, at the first interpreted launch)."""

from __future__ import annotations

import threading

import torch
import triton

from ..kernels.tl.loop_probe import loop_probe_kernel

# One interpreted launch at a time, from any thread: the interpreter keeps one global grid index, and patches
# triton.language for the length of a launch.
INTERPRETER_LOCK = threading.Lock()
_PROBE_STEPS = 3
_UNASKED = object()
_answer: object = _UNASKED


def interpreter_problem() -> str | None:
    """None if the interpreter runs a loop bounded by a kernel argument, else what failed and how to fix it.

    Triton 3.6's interpreter (not 3.7's) passes a kernel's integer arguments as one-element NumPy arrays and calls
    ``int()`` on one where it bounds a loop; NumPy has refused that since 2.4 (deprecated from 1.25). Every
    list and attention kernel has such a loop, so without this check a CPU call failed deep inside the
    interpreter with "only 0-dimensional arrays can be converted to Python scalars". Call it with
    :data:`INTERPRETER_LOCK` held."""
    global _answer
    if _answer is _UNASKED:
        _answer = _probe()
    return _answer


def forget_answer() -> None:
    """Ask again at the next interpreted launch (tests)."""
    global _answer
    _answer = _UNASKED


def _probe() -> str | None:
    out = torch.zeros(1, dtype=torch.int32)
    try:
        loop_probe_kernel[(1,)](out, _PROBE_STEPS)
    except Exception as err:  # the interpreter wraps what failed in its own error type
        return _problem_text(err)
    steps = int(out.item())
    return None if steps == _PROBE_STEPS else _problem_text(f"the loop ran {steps} steps of {_PROBE_STEPS}")


def _problem_text(failure: object) -> str:
    import numpy

    return (f"Triton {triton.__version__}'s CPU interpreter cannot run mmsparse's kernels with NumPy "
            f"{numpy.__version__}: a loop bounded by a kernel argument failed ({failure}). Triton before 3.7 "
            "converts such arguments with int() of a one-element array, which NumPy 2.4 and later refuse. Fix: "
            "pip install -U 'triton>=3.7', or pip install 'numpy<2.4'")
