"""Test set-up for every test below tests/: Triton's interpreter when there is no GPU (before triton is imported),
NaN-poisoned outputs, the ``device`` fixture, and the skips of the ``gpu``, ``hopper`` and ``large`` markers.

Where the tests are:
  unit/         one piece at a time, mostly without attention kernels: block lists in torch, the context-parallel
                plan, the references, launch keys, input errors and limits, the package's import layers
  kernels/      the Triton and Gluon kernels against the float64 reference: attention, block lists, token bits,
                dropout, decoding, launch plans, the Hopper kernels, GPU-only and past-2^31 sizes
  integration/  the public entry points end to end: arguments, real batches, nn and Hugging Face layers, the CLI,
                context parallelism, examples, the README's blocks, the fuzzer, the A/B tool, packaging
helpers.py holds what several modules share (topologies, cases, the float64 checks); no test module imports
another."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

import pytest  # noqa: E402

# Devices the kernels write: CUDA, and the CPU under Triton's interpreter.
_KERNEL_DEVICES = ("cuda", "cpu")


def _poisoned(empty):
    """``torch.empty`` whose floating result starts as NaN and integer result as -1 (all bits set), so an element
    a kernel forgets to write shows up instead of passing as leftover memory. Tensor subclasses (fake, functional
    tensors), other devices, empty results and tracing under torch.compile are left alone."""

    @functools.wraps(empty)
    def wrapper(*args, **kwargs):
        out = empty(*args, **kwargs)
        if torch.compiler.is_compiling():  # first: nothing below gets traced
            return out
        if type(out) is not torch.Tensor or not out.numel() or out.device.type not in _KERNEL_DEVICES:
            return out
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        elif out.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            out.fill_(-1)
        return out

    return wrapper


@pytest.fixture(scope="session", autouse=True)
def poison_empty():
    """Every ``torch.empty`` of the test session is poisoned (see ``_poisoned``); the launchers allocate their
    outputs with it."""
    original = torch.empty
    torch.empty = _poisoned(original)
    try:
        yield
    finally:
        torch.empty = original


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_hopper() -> bool:
    from mmsparse.attention.dispatch import hopper_gluon_available

    return hopper_gluon_available(torch.cuda.current_device())


def pytest_collection_modifyitems(config, items):
    """``gpu``, ``hopper`` and ``large`` tests skip without CUDA; ``hopper`` ones also off sm_90 or without Gluon;
    ``large`` ones (slow) unless asked for by ``-m large`` or ``MMSPARSE_LARGE=1``."""
    cuda = torch.cuda.is_available()
    large = "large" in (config.option.markexpr or "") or os.environ.get("MMSPARSE_LARGE") == "1"
    hopper = cuda and any(item.get_closest_marker("hopper") for item in items) and _on_hopper()
    for item in items:
        marks = {m for m in ("gpu", "hopper", "large") if item.get_closest_marker(m)}
        if marks and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        elif "hopper" in marks and not hopper:
            item.add_marker(pytest.mark.skip(reason="needs an sm_90 GPU and Triton's Gluon API"))
        elif "large" in marks and not large:
            item.add_marker(pytest.mark.skip(reason="slow: run with -m large or MMSPARSE_LARGE=1"))
