"""tests/interpreter.py: on a CPU, Triton's interpreter maps triton.language once per launch, not once per nested
``@triton.jit`` call, and a kernel with nested calls still computes what torch does."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus_one(x):
    return _twice(x) + 1


@triton.jit
def _kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n)
    for _ in range(3):
        x = _plus_one(x)
    tl.store(dst + offs, x, mask=offs < n)


def test_a_launch_maps_the_language_once_and_computes_the_same(monkeypatch):
    from triton.runtime import interpreter

    wrapper = interpreter._patch_lang
    assert getattr(wrapper, "_once", False), "tests/conftest.py did not install the once-per-launch mapping"
    calls = []
    real = wrapper.original
    monkeypatch.setattr(wrapper, "original", lambda fn: (calls.append(fn.__name__), real(fn))[1])
    src = torch.arange(40, dtype=torch.float32)
    dst = torch.full_like(src, float("nan"))
    _kernel[(3,)](src, dst, 40, BLOCK=16)
    want = src
    for _ in range(3):
        want = want * 2 + 1
    assert torch.equal(dst, want)
    assert calls == ["_kernel"], calls  # 3 programs x 6 nested calls, mapped once for the launch
    _kernel[(3,)](src, dst, 40, BLOCK=16)  # the next launch maps again (the first one's mapping was undone)
    assert calls == ["_kernel", "_kernel"]
