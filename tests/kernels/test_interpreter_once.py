"""tests/interpreter.py: on a CPU, Triton's interpreter maps triton.language once per launch, not once per nested
``@triton.jit`` call, and a kernel with nested calls still computes what torch does; the overflow checks it skips
are ones the interpreter would discard; its numpy dtypes, looked up in a table built once, are the ones its own
function gives; bfloat16 widened to float32 by a shift gives its conversion's bits."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

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


@triton.jit
def _square_int32(src, dst):
    x = tl.load(src)
    tl.store(dst, x * x)  # int32 * int32: Triton adds an overflow check here where sanitize_overflow is on


def _square_of_2_pow_20(monkeypatch, options, **changes) -> int:
    """2^20 squared in int32, through the interpreter's builder given ``options`` with ``changes``."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.interpreter_builder, "options", dataclasses.replace(options, **changes))
    src = torch.tensor([2**20], dtype=torch.int32)
    dst = torch.full_like(src, -1)
    _square_int32[(1,)](src, dst)
    return int(dst)


def test_the_overflow_checks_skipped_are_the_ones_the_interpreter_discards(monkeypatch):
    """The premise of skip_discarded_overflow_checks: with the interpreter's own options (debug off), an int32
    overflow passes unreported even with ``sanitize_overflow`` on, so turning it off loses no check. With debug on
    the same check fires: were a Triton's interpreter to turn debug on, this test fails, and the skip goes."""
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.sanitize_overflow, "tests/conftest.py did not skip the discarded overflow checks"
    assert not options.debug
    assert _square_of_2_pow_20(monkeypatch, options, sanitize_overflow=True) == 0  # 2^40 wraps to 0, unreported
    with pytest.raises(InterpreterError, match="int32 overflow"):
        _square_of_2_pow_20(monkeypatch, options, sanitize_overflow=True, debug=True)
    assert _square_of_2_pow_20(monkeypatch, options) == 0


def test_the_dtype_table_answers_as_the_interpreter_does():
    """table_np_dtypes: every dtype triton.language names, alone, as a block's element and pointed to, gets the numpy
    dtype the interpreter's own function gives (the table holds each of the 18 scalar ones); one it has no numpy
    type for raises as before."""
    from triton.runtime import interpreter

    fast = interpreter._get_np_dtype
    assert getattr(fast, "_table", None), "tests/conftest.py did not install the dtype table"
    original = fast.original
    scalars = [v for v in vars(tl).values() if isinstance(v, tl.dtype) and not isinstance(v, tl.pointer_type)]
    known = [t for t in scalars if t.name != "void"]
    assert len(known) >= 18 and set(fast._table) == set(known)
    for t in known:
        for ty in (t, tl.block_type(t, [4, 8]), tl.pointer_type(t), tl.block_type(tl.pointer_type(t), [4])):
            assert fast(ty) == original(ty) and fast(ty) is original(ty), ty
    assert fast(tl.float32) is not fast(tl.bfloat16) and fast(tl.bfloat16) == original(tl.uint16)
    with pytest.raises(KeyError):
        original(tl.void)
    with pytest.raises(KeyError):
        fast(tl.void)


def test_bfloat16_casts_by_shifts_give_the_interpreters_bits():
    """shift_bf16_casts: every one of the 65,536 bfloat16 values widened to float32, and float32 values of every
    exponent (and random ones) cut to bfloat16, have the bits the interpreter's own conversion gives (values with a
    subnormal, an infinity or a NaN among them go to it, which converts those otherwise than a shift, and the tests
    must see what it gives), in a C-ordered array of the input's shape, strided or 0-d; other conversions, and a
    cut with a rounding mode, are the interpreter's."""
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    fast = interpreter._convert_float
    original = getattr(fast, "original", None)
    assert original is not None, "tests/conftest.py did not install the bfloat16 shifts"

    def same(values, src, dst, rounding=None):
        got, want = fast(values, src, dst, rounding), original(values, src, dst, rounding)
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        assert got.flags.c_contiguous and np.array_equal(got, want), (src, dst, rounding)

    half = np.arange(1 << 16, dtype=np.uint16)
    normal = half[~(((half & 0x7F80) == 0) & ((half & 0x7F) != 0))]
    for rounding in (None, ir.ROUNDING_MODE.RTNE, ir.ROUNDING_MODE.RTZ):
        for values in (half, normal):
            same(values, tl.bfloat16, tl.float32, rounding)
    rng = np.random.default_rng(0)
    mantissas = rng.integers(0, 1 << 23, size=256, dtype=np.uint32)
    every_exponent = (np.arange(512, dtype=np.uint32)[:, None] << 23 | mantissas[None, :]).reshape(-1)
    random = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    for words in (every_exponent, random):
        exponent = (words >> 23) & 0xFF
        plain = words[(exponent != 255) & ((exponent != 0) | ((words & 0x7FFFFF) == 0))]
        for values in (words, plain):
            same(values.view(np.float32), tl.float32, tl.bfloat16)
            same(values.view(np.float32), tl.float32, tl.bfloat16, ir.ROUNDING_MODE.RTNE)
    for values in (normal[:4096].reshape(64, 64).T[::2], np.array(np.uint16(0x3F80))):
        same(values, tl.bfloat16, tl.float32)
    for values in (plain[:4096].view(np.float32).reshape(64, 64).T[::2], np.array(np.float32(-2.5))):
        same(values, tl.float32, tl.bfloat16)
    same(np.array([1.0, -2.5], dtype=np.float32), tl.float32, tl.float16)


_CHILD = """
import triton
from triton.runtime import interpreter
print(getattr(interpreter._patch_lang, "_once", False), interpreter.interpreter_builder.options.sanitize_overflow,
      getattr(interpreter._get_np_dtype, "_table", None) is not None,
      getattr(interpreter._convert_float, "original", None) is not None)
"""


@pytest.mark.parametrize("interpret", ["1", None], ids=["interpreter", "compiled"])
def test_processes_the_tests_start_get_the_same_patches(interpret):
    """tests/child_site: a Python process started from a test with the interpreter on has the patches once triton
    is imported; one started without it is left as it is."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    result = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    patched = result.stdout.split()
    assert patched == (["True", "False", "True", "True"] if interpret else ["False", "True", "False", "False"]), (
        result.stdout)
