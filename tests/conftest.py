"""Test set-up: Triton's interpreter when there is no GPU (before triton is imported), NaN-poisoned outputs, and
the skips of the ``gpu``, ``hopper`` and ``large`` markers."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import mmsparse.ops.alloc  # noqa: E402

mmsparse.ops.alloc.POISON = True


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_hopper() -> bool:
    from mmsparse.ops.config import hopper_gluon_available

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
