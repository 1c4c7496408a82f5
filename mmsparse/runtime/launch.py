"""Kernel launches with less host work than ``kernel[grid](...)``.

Triton binds and specialises every argument of every launch (about 0.5 us per argument in triton 3.6, ~20 us for
the 47 arguments of the attention kernels) before it finds the compiled kernel in its cache. At the seed's size a
whole forward takes ~90 us of GPU time, so that host work decides the wall time.

:class:`FastKernel` keys its own cache on what Triton's specialisation depends on (the tensors' dtypes and 16-byte
alignment, each integer's width, whether it is 1 and whether it is a multiple of 16, the constexprs and launch
options, the current device) and, on a hit, calls the compiled kernel's launcher directly. A miss goes through
Triton, which compiles or finds the kernel, and the result is remembered. The key separates at least what
Triton's separates (every integer is keyed as if specialised, so it may split where Triton does not, which only
costs one extra trip through Triton), so a hit always launches the kernel Triton would have chosen. Through the
interpreter, under a launch hook (profilers), or with a Triton whose compiled kernels do not have the expected
launcher, every launch goes through Triton.

Thread safety: a hit reads the cache without a lock; two threads missing on one key both go through Triton and
store equal entries. Triton's interpreter is not thread-safe (one global grid index, and ``triton.language``
patched for the length of a launch and restored at its end), so interpreted launches take a lock; the first
of them asks whether this interpreter can run the kernels at all (``interpreter_probe``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import triton

from ..kernels.tl.token_bits import token_bits_kernel
from .interpreter_probe import INTERPRETER_LOCK, interpreter_problem
from .tma_args import Boxes, DescriptorLaunch

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_MISS = object()
_knobs = getattr(triton, "knobs", None)
fast_launches = 0  # counted for the tests: launches that skipped Triton's binding
# The current CUDA device without torch.cuda.current_device()'s lazy-init check, for code that runs inside or after a
# launch (CUDA is initialised); torch.cuda.current_device where the binding is absent (a CPU build)
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# Compile options every launch passes: FP fusion (a * b + c as one FMA), Triton's default so far, which the kernels'
# numerics (the tl and Gluon passes computing P alike) and speed assume. Triton 3.9 warns that 3.10 turns the default
# off; asked for, it stays on in every version (the interpreter drops the option).
PINNED_OPTIONS: dict[str, Any] = {"enable_fp_fusion": True}


def _arg_key(arg: Any) -> Any:
    """What Triton's specialisation of one runtime argument depends on (or _MISS for a kind not handled)."""
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg & 15 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg >= 2**63)
    if kind is float:
        return 0.0
    if kind is bool or arg is None:
        return arg
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    if kind.__name__ == "TensorDescriptor":  # host-side TMA (tl's or Gluon's): Triton keys on these, not the sizes
        return (kind, arg.base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None), arg.padding)
    return _MISS


def _hooked(hook: Any) -> bool:
    """A launch hook is set (a profiler). Triton >= 3.5 always has a HookChain there, empty by default."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    """A launch hook is set (a profiler): launches must go through Triton, which calls it."""
    return _hooked(_knobs.runtime.launch_enter_hook) or _hooked(_knobs.runtime.launch_exit_hook)


def _launch_device(first_arg: Any) -> int:
    """The CUDA device index of a launch's first argument, a tensor or a TMA descriptor (its base tensor); -1 on
    the CPU."""
    return getattr(first_arg, "base", first_arg).get_device()


def _current_stream(device: int) -> int:
    return triton.runtime.driver.active.get_current_stream(device)


def stream_key(device: torch.device) -> tuple[int, int, int] | None:
    """The current CUDA stream of ``device`` as torch names it, ``(stream id, device index, device type)``, without
    making a Stream object (cheap enough for a cache hit); None off the GPU. ``stream_of`` turns it back into one."""
    if device.type != "cuda":
        return None
    return torch._C._cuda_getCurrentStream(device.index if device.index is not None else torch.cuda.current_device())


def stream_of(key: tuple[int, int, int]) -> torch.cuda.Stream:
    """The stream of a :func:`stream_key`."""
    return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])


class FastKernel:
    """Wraps a ``@triton.jit`` kernel; call as ``kernel[grid](*runtime_args, **constexprs_and_options)`` with every
    runtime argument positional, the first one a tensor or a TMA descriptor (it picks the device to launch on), and
    every constexpr by keyword."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._cache: dict[tuple, tuple[Any, tuple, DescriptorLaunch | None]] = {}
        self._signature = inspect.signature(fn.fn)  # fn.fn: the kernel's Python function
        self._params = list(self._signature.parameters)
        # A compiling JITFunction (not the interpreter) in a Triton with launch hooks in knobs (>= 3.4).
        self._enabled = hasattr(fn, "device_caches") and _knobs is not None
        self._interpreted = type(fn).__name__ == "InterpretedFunction"

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """Launch; return the cache entry ``(compiled kernel, constexpr tail, descriptor launch)`` that launched or
        was stored, None when the launch went through Triton without one. The descriptor launch
        (:class:`mmsparse.runtime.tma_args.DescriptorLaunch`) is None where the kernel takes no host TMA descriptor.
        :data:`PINNED_OPTIONS` go with ``kwargs``."""
        kwargs = {**PINNED_OPTIONS, **kwargs}
        if not self._enabled:
            if self._interpreted:
                with INTERPRETER_LOCK:
                    problem = interpreter_problem()
                    if problem is not None:
                        raise RuntimeError(problem)
                    self.fn[grid](*args, **kwargs)
            else:
                self.fn[grid](*args, **kwargs)
            return None
        device, target = torch.cuda.current_device(), _launch_device(args[0])
        if 0 <= target != device:  # Triton launches on the current device: make it the tensors' one
            with torch.cuda.device(target):
                return self.launch(grid, args, kwargs)
        if _hooks_set():
            self.fn[grid](*args, **kwargs)
            return None
        key = (device, tuple(kwargs.items()), *map(_arg_key, args))
        hit = self._cache.get(key)
        if hit is None:
            compiled = self.fn[grid](*args, **kwargs)
            if _MISS not in key and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                hit = self._cache[key] = (compiled, self._constexpr_tail(args, kwargs), DescriptorLaunch.of(compiled))
            return hit
        _run_direct(hit, (*grid, 1, 1), device, args)
        return hit

    def bind(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any],
             boxes: Boxes = ()) -> Callable[..., None] | None:
        """Launch, then return ``relaunch(*new_args)``: the same compiled kernel on the same grid, device and
        constexprs, called straight through its launcher. The caller promises that ``new_args`` specialise as
        ``args`` did (same dtypes, tensors 16-byte aligned, integers alike), e.g. by keying what it binds on the
        shapes and strides the integers come from. ``boxes``: the positions where ``args`` (and every
        ``new_args``) hold a tensor that the kernel takes as a host TMA descriptor, each with the box that
        describes it (:func:`described`); a relaunch makes no descriptor object (:class:`DescriptorLaunch` encodes
        from the tensor). None where launches go through Triton (the interpreter, a launch hook, an argument kind
        not keyed); a relaunch under a launch hook or from another current device goes through :meth:`launch`."""
        hit = self.launch(grid, described(args, boxes), kwargs)
        if hit is None:
            return None
        target, grid3 = _launch_device(args[0]), (*grid, 1, 1)

        def relaunch(*new_args: Any) -> None:
            if current_device() == target and not _hooks_set():
                _run_direct(hit, grid3, target, new_args, boxes)
            else:
                self.launch(grid, described(new_args, boxes), kwargs)

        return relaunch

    def _constexpr_tail(self, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """The values of the parameters after the positional ones, in the kernel's order (all constexprs here),
        with the kernel's defaults for those not given."""
        bound = self._signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in self._params})
        bound.apply_defaults()
        return tuple(bound.arguments[name] for name in self._params[len(args):])


def launch_bound(kernel: FastKernel, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any],
                 bound: dict[str, Callable[..., None]] | None, name: str, boxes: Boxes = ()) -> None:
    """Launch ``kernel``; with ``bound``, through the relaunch kept there under ``name`` (made by the first launch:
    :meth:`FastKernel.bind`). The caller keeps one ``bound`` per set of launches that specialise alike (same
    dtypes, alignment, integers and constexprs), e.g. per key of shapes and strides, and passes the same
    ``boxes`` (tensors taken as host TMA descriptors: :meth:`FastKernel.bind`) with every launch of a name."""
    if bound is None:
        kernel[grid](*described(args, boxes), **kwargs)
        return
    relaunch = bound.get(name)
    if relaunch is not None:
        relaunch(*args)
        return
    relaunch = kernel.bind(grid, args, kwargs, boxes)
    if relaunch is not None:
        bound[name] = relaunch


def described(args: tuple, boxes: Boxes) -> tuple:
    """``args`` with the tensor at each position of ``boxes`` replaced by its host TMA descriptor
    (``box.describe(tensor)``), as Triton takes them."""
    if not boxes:
        return args
    found = list(args)
    for position, box in boxes:
        found[position] = box.describe(found[position])
    return tuple(found)


def _run_direct(entry: tuple, grid3: tuple[int, ...], device: int, args: tuple, boxes: Boxes = ()) -> None:
    """Call a compiled kernel's launcher with runtime ``args`` and its constexpr tail on the current stream (host TMA
    descriptors, or the tensors at ``boxes``, through the entry's :class:`DescriptorLaunch`, encoded once per
    value)."""
    global fast_launches
    compiled, tail, descriptors = entry
    if descriptors is not None:
        descriptors(compiled, grid3, _current_stream(device), args, tail, boxes)
    else:
        compiled.run(grid3[0], grid3[1], grid3[2], _current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *(described(args, boxes) if boxes else args), *tail)
    fast_launches += 1


def interpreter_active() -> bool:
    """True when Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 before triton was imported)."""
    return type(token_bits_kernel).__name__ == "InterpretedFunction"


def compiled_variants(kernel: triton.runtime.JITFunction) -> int:
    """How many specialisations of a Triton kernel are compiled, over all devices (0 through the interpreter,
    which compiles nothing). Tests and examples count them to show that new lengths compile nothing."""
    caches = getattr(kernel, "device_caches", None)  # triton >= 3.3
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(cache) for cache in getattr(kernel, "cache", {}).values())
