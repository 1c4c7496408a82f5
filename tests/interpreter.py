"""Triton's interpreter, patched once per launch for the tests.

The interpreter maps ``triton.language`` onto its own implementations when a launch starts
(``GridExecutor.__call__``) and again on every call of a nested ``@triton.jit`` function, which scans the language
modules each time (``inspect.getmembers``): about a fifth of a kernel test's time on a CPU. Inside one launch the
second and later scans find the same modules already mapped, so :func:`patch_once_per_launch` skips a nested call's
mapping when the modules its function sees were mapped by this launch already; a function that sees others is
mapped as before.

:func:`skip_discarded_overflow_checks` stops the interpreter from building integer-overflow checks it throws away.
With ``sanitize_overflow`` on (its default), every int32 add, sub and mul also computes its result in int64 and
compares it with int32's bounds, about a third of an interpreted kernel's time; but the check ends in
``device_assert``, which returns without checking anything unless the options say ``debug``, and the interpreter's
options never do. So the check is off only where it could not fail (a test holds this premise against the
installed Triton).

:func:`table_np_dtypes` looks the numpy dtype of a Triton dtype up in a table built once, where the interpreter
builds its table of 18 dtypes (hashing each) on every call: every splat, cast and masked load asks, about a
twentieth of an interpreted kernel's time. The table is the interpreter's own answers, and a dtype it does not hold
goes to the interpreter's function.

:func:`shift_bf16_casts` converts between bfloat16 and float32 by shifting bits, which is what the conversion is
(a bfloat16 is the top half of a float32: the interpreter's float32 -> bfloat16 cast truncates), where the
interpreter takes every value apart and puts it back together (``_convert_float``): the conversions of a bfloat16
kernel's loads and stores were about a tenth of its test's time. The interpreter's own function does not carry
subnormals, infinities or NaNs over as a shift does, so values with one among them still go to it; a test compares
the two on all 65,536 bfloat16 values and on float32 values of every exponent. Nothing else changes: the same
kernels run through the same interpreter.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np


def _language_modules(fn: Any, tl: Any) -> frozenset[int]:
    """The language modules the interpreter maps for ``fn`` (those of its globals that are ``triton.language`` or
    ``triton.language.core``), by identity (a module equals only itself, so ``inspect.ismodule(v) and v in (tl,
    tl.core)``, the interpreter's test, is this one)."""
    lang, core = tl, tl.core
    return frozenset(id(v) for v in fn.__globals__.values() if v is lang or v is core)


def patch_once_per_launch() -> bool:
    """Install the skip; False (and nothing changed) where this Triton's interpreter is not laid out as expected."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None or getattr(patch_lang, "_once", False):
        return False
    launch_call = executor.__call__
    state = threading.local()

    def patch_for_launch(fn: Any) -> Any:
        mapped = getattr(state, "mapped", None)
        if mapped is not None:
            modules = _language_modules(fn, tl)
            if modules <= mapped:
                return scope_type()  # nothing to map: this launch mapped these modules
            mapped |= modules
        return patch_for_launch.original(fn)

    def call_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(state, "mapped", None)
        state.mapped = set()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state.mapped = outer

    patch_for_launch._once = True  # type: ignore[attr-defined]
    patch_for_launch.original = patch_lang  # type: ignore[attr-defined]  (read at each call: a test counts them)
    interpreter._patch_lang = patch_for_launch
    executor.__call__ = call_launch
    return True


def skip_discarded_overflow_checks() -> bool:
    """Give the interpreter's builder ``sanitize_overflow=False`` where its options have ``debug`` off (so each
    overflow check's ``device_assert`` discards it); False (and nothing changed) where the builder is not laid out as
    expected or its options ask for ``debug``."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return False
    if not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def _uninstalled(name: str) -> tuple[Any, Any, Any] | None:
    """``(triton.language, the interpreter module, its function name)`` where this Triton's interpreter has that
    function and no replacement of ours stands in its place (ours keep the function they replace as ``original``);
    else None."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return None
    original = getattr(interpreter, name, None)
    if original is None or getattr(original, "original", None) is not None:
        return None
    return tl, interpreter, original


def table_np_dtypes() -> bool:
    """Install the table lookup of :func:`_get_np_dtype <triton.runtime.interpreter._get_np_dtype>`; False (and
    nothing changed) where this Triton's interpreter has no such function, or it was installed already."""
    found = _uninstalled("_get_np_dtype")
    if found is None:
        return False
    tl, interpreter, original = found
    table = {}
    for value in vars(tl).values():  # the scalar dtypes triton.language names, each as the interpreter maps it
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type)):
            try:
                table[value] = original(value)
            except (KeyError, TypeError):  # one it has no numpy type for (void): asked, it raises again
                pass
    pointer, block = tl.pointer_type, tl.block_type
    uint64 = original(tl.pointer_type(tl.int8))

    def np_dtype(tt_dtype: Any) -> Any:
        """What ``original(tt_dtype)`` returns, by the same branches: a pointer, a block's element, a scalar."""
        if isinstance(tt_dtype, pointer):
            return uint64
        scalar = tt_dtype
        if isinstance(tt_dtype, block):
            if isinstance(tt_dtype.element_ty, pointer):
                return uint64
            scalar = tt_dtype.element_ty
        found = table.get(scalar)
        return original(tt_dtype) if found is None else found

    np_dtype._table = table  # type: ignore[attr-defined]
    np_dtype.original = original  # type: ignore[attr-defined]
    interpreter._get_np_dtype = np_dtype
    return True


def shift_bf16_casts() -> bool:
    """Install the shifts for bfloat16 -> float32 and float32 -> bfloat16 in the interpreter's float conversion (any
    other conversion goes to its own function); False (and nothing changed) where this Triton's interpreter has no
    such function, or it was installed already."""
    found = _uninstalled("_convert_float")
    if found is None:
        return False
    tl, interpreter, original = found
    bf16, fp32, sixteen = tl.bfloat16, tl.float32, np.uint32(16)
    bf16_exponent, bf16_mantissa = np.uint16(0x7F80), np.uint16(0x007F)
    fp32_exponent, fp32_mantissa = np.uint32(0x7F800000), np.uint32(0x007FFFFF)

    def convert_float(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        """``original(...)``, as a C-ordered array of the input's shape: bfloat16 bits (uint16) to float32 shifted
        up, float32 to bfloat16 without a rounding mode (truncated) shifted down, where no value is a subnormal (nor,
        going down, an infinity or a NaN); anything else by the original."""
        dtype = getattr(input, "dtype", None)
        if input_dtype == bf16 and output_dtype == fp32 and dtype == np.uint16:
            if not ((input & bf16_exponent == 0) & (input & bf16_mantissa != 0)).any():
                out = input.astype(np.uint32, order="C")
                return np.left_shift(out, sixteen, out=out)
        elif input_dtype == fp32 and output_dtype == bf16 and dtype == np.float32 and rounding_mode is None:
            bits = np.asarray(input).view(np.uint32)
            exponent = bits & fp32_exponent
            if not ((exponent == fp32_exponent) | ((exponent == 0) & (bits & fp32_mantissa != 0))).any():
                out = np.right_shift(bits, sixteen, out=np.empty(bits.shape, np.uint32))
                return out.astype(np.uint16, order="C")
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float.original = original  # type: ignore[attr-defined]
    interpreter._convert_float = convert_float
    return True
