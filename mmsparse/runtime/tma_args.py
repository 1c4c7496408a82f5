"""Host-side TMA descriptors as a compiled kernel's launcher takes them, encoded once per value.

Triton's launcher turns every host ``TensorDescriptor`` argument of every launch into its kernel arguments (a
``CUtensorMap`` that the driver encodes, then the shape and strides), in Python under Triton 3.6 and 3.7 and through
a Python call per descriptor under 3.9: the Gluon dK/dV pass takes six descriptors, the forward four. The encoded map
is a function of the base address, shape, strides, padding and the kernel's box, swizzle and element type alone, so
:class:`DescriptorLaunch` keeps the arguments Triton's own ``make_tensordesc_arg`` made for a descriptor, keyed on
exactly those values (the box, swizzle and type are the kernel's: one cache per compiled kernel and argument
position), and calls the launcher beneath Triton's wrapper with them. A training step allocates its gradients at the
addresses of the step before, so a repeated call encodes nothing.

A caller may also pass, at a descriptor position, the tensor itself with a :class:`Box` that says how it is described
(``boxes``): the key is then the tensor's address, shape and strides and the box, and no descriptor object is made
unless the value is new (each object costs ~1.3 us of host time, six per Gluon dK/dV launch).

Where the launcher is not built as expected (another Triton, descriptors inside tuples, no descriptor metadata),
:meth:`DescriptorLaunch.of` returns None and launches keep going through Triton's wrapper.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any, Protocol


class Box(Protocol):
    """How a tensor is described at one descriptor position (hashable: it is part of the encoding's key)."""

    def describe(self, t: Any) -> Any:
        """The host TMA descriptor of ``t``."""
        ...


# The descriptor positions of a launch whose arguments hold tensors there, in order, each with its box.
Boxes = tuple[tuple[int, Box], ...]
# Encoded descriptors kept per kernel and argument position; past this many the position starts again (a new
# tensor each call, e.g. outputs no allocator reuses, would otherwise grow it without bound).
MAX_ENCODED_PER_ARGUMENT = 64

encodings = 0  # counted for the tests: descriptors encoded through Triton's make_tensordesc_arg


class DescriptorLaunch:
    """Launches one compiled kernel whose runtime arguments include host TMA descriptors, with each descriptor's
    launcher arguments made by Triton once per value (see the module docstring)."""

    __slots__ = ("_run", "_positions", "_metas", "_make", "_make_arity", "_encoded")

    def __init__(self, run: Any, positions: list[int], metas: list[Any], make: Any, make_arity: int) -> None:
        self._run, self._positions, self._metas = run, positions, metas
        self._make, self._make_arity = make, make_arity
        self._encoded: list[dict[tuple, tuple]] = [{} for _ in positions]

    @classmethod
    def of(cls, compiled: Any) -> DescriptorLaunch | None:
        """The launch of ``compiled`` (a Triton ``CompiledKernel`` that has launched once) with its descriptors
        encoded once per value; None where its launcher takes no descriptor or is not built as expected."""
        run = getattr(compiled, "run", None)
        inner = getattr(run, "launch", None)
        code = getattr(inner, "__code__", None)
        if code is None or "launcher" not in code.co_freevars or inner.__closure__ is None:
            return None  # no descriptor argument (the launcher is Triton's C function itself) or another Triton
        signature = list(getattr(getattr(compiled, "src", None), "signature", {}).values())
        positions = [i for i, kind in enumerate(signature) if _is_descriptor(kind)]
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        nested = any(isinstance(kind, tuple) and _holds_descriptor(kind) for kind in signature)
        make = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
        if not positions or nested or not metas or len(metas) != len(positions) or make is None:
            return None
        if any(not isinstance(meta, dict) or meta.get("is_im2col", False) for meta in metas):
            return None  # im2col descriptors are encoded from more fields than the key holds
        arity = len(inspect.signature(make).parameters)
        if arity not in (2, 3):
            return None
        unwrapped = copy.copy(run)  # the launcher object with Triton's C launch in place of its descriptor wrapper
        unwrapped.launch = inner.__closure__[code.co_freevars.index("launcher")].cell_contents
        return cls(unwrapped, positions, list(metas), make, arity)

    def __call__(self, compiled: Any, grid3: tuple[int, ...], stream: int, args: tuple, tail: tuple,
                 boxes: Boxes = ()) -> None:
        """Launch ``compiled`` (the kernel this was made of) on ``grid3`` and ``stream`` with runtime ``args``
        and its constexpr ``tail``. At the kernel's descriptor positions ``args`` holds descriptors, or, with
        ``boxes`` (every descriptor position, in order), the tensors those boxes describe."""
        if boxes and len(boxes) != len(self._positions):
            _misplaced(boxes, self._positions)
        final: list[Any] = []
        start = 0
        for slot, position in enumerate(self._positions):
            box = None
            if boxes:
                at, box = boxes[slot]
                if at != position:
                    _misplaced(boxes, self._positions)
            final += args[start:position]
            final += self._arguments(slot, args[position], box)
            start = position + 1
        final += args[start:]
        final += tail
        self._run(grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata, None, None,
                  None, *final)

    def _arguments(self, slot: int, arg: Any, box: Box | None) -> tuple:
        """The launcher arguments at descriptor position ``slot`` of descriptor ``arg``, or of tensor ``arg``
        described by ``box``, made by Triton on the first launch of these values."""
        if box is None:
            key: tuple = (arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding,
                          getattr(arg, "round_f32_to_tf32", False))
        else:
            key = (arg.data_ptr(), arg.shape, arg.stride(), box)
        cache = self._encoded[slot]
        found = cache.get(key)
        if found is None:
            global encodings
            desc = arg if box is None else box.describe(arg)
            meta = self._metas[slot]
            made = self._make(desc, meta) if self._make_arity == 2 else self._make(desc, meta, None)
            found = tuple(made)
            if len(cache) >= MAX_ENCODED_PER_ARGUMENT:
                cache.clear()
            cache[key] = found
            encodings += 1
        return found


def _misplaced(boxes: Boxes, positions: list[int]) -> None:
    raise ValueError(f"the boxes are at argument positions {[at for at, _ in boxes]}; the kernel takes descriptors "
                     f"at {positions}")


def _is_descriptor(kind: Any) -> bool:
    return isinstance(kind, str) and kind.startswith("tensordesc")


def _holds_descriptor(kinds: tuple) -> bool:
    return any(_holds_descriptor(k) if isinstance(k, tuple) else _is_descriptor(k) for k in kinds)
