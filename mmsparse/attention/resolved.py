"""A traced op call resolved once per kind of call: the custom ops' one lookup on a repeated step.

Each call of a compiled graph's forward or backward op would otherwise parse its plan's text, find its kept mask
(:mod:`mmsparse.mask.kept`: a lock, the mask's key and the reading stream) and key its launch on the plan, shapes
and the mask arguments' integers, where eager reads all of that from the call's mask. A :class:`ResolvedOp` keeps
what those steps found, under a key of everything each of them was keyed on (:func:`op_call_key`): the plan's text,
the mask's host values, the reading stream, the scalars, the seed's alignment, and each tensor's shape, strides,
dtype and alignment. What a launch reads from a call (pointers, descriptors) is still taken from the live tensors
every call, and the mask arguments from the kept mask's own (as an eager call's), or made from the op's mask and
list tensors. The kept mask is held by weak reference: an entry never keeps a mask alive that the kept masks let go.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..mask.info import MaskInfo, TileKey
from ..runtime.launch import stream_key
from ..runtime.recent import RecentlyUsed
from .kernel_args import LaunchArgs, kernel_args, traced_mask_args

MAX_RESOLVED = 256


@dataclass(frozen=True)
class ResolvedOp:
    """One kind of op call: its launch (``ForwardLaunch`` or ``BackwardLaunch``), the tiles whose mask arguments it
    reads, in the plan's order, the mask's mode and window, and the kept mask those arguments come from (None
    where the op takes its mask's tensors and lists)."""

    launch: Any
    tiles: tuple[TileKey, ...]
    mode: int
    window: int | None
    kept: weakref.ref[MaskInfo] | None

    def mask_args(self, mask: list[torch.Tensor], lists: list[torch.Tensor]) -> list[LaunchArgs] | None:
        """The mask arguments of each tile: the kept mask's, as an eager call reads its own mask's, or made from the
        op's ``mask`` and ``lists`` tensors; None where a kept mask has been let go since (the caller resolves the
        call again)."""
        if self.kept is None:
            return traced_mask_args(mask, self.mode, lists, self.window, len(self.tiles))
        info = self.kept()
        if info is None:
            return None
        args = kernel_args(info)
        return [args.tile(*tile) for tile in self.tiles]


_RESOLVED: RecentlyUsed[ResolvedOp] = RecentlyUsed(MAX_RESOLVED)


def op_call_key(op: str, plan: str, host_values: list[int], layouts: tuple[torch.Tensor, ...], mask: list[torch.Tensor],
                lists: list[torch.Tensor], seed: torch.Tensor | None, scalars: tuple[float, float]) -> tuple | None:
    """The key of an op call's :class:`ResolvedOp`; None during a CUDA-graph capture, whose reads of kept lists
    go through :func:`mmsparse.mask.kept.kept_mask` (it ties the mask to the graph). ``op``: which op (the forward's
    and the backward's calls of one kind share every other part). ``layouts``: the tensors whose shapes and strides
    the launch reads (q, k, v laid out for the kernels)."""
    device = layouts[0].device
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        reader: Any = stream_key(device)  # kept lists are ready on the streams that waited for them
    else:
        reader = device
    return (op, plan, tuple(host_values), reader, scalars, None if seed is None else seed.data_ptr() & 15,
            *[(t.shape, t.stride(), t.dtype) for t in layouts],
            *[(t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in mask],
            *[(t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in lists])


def resolved_op(key: tuple | None) -> ResolvedOp | None:
    """The call kept under ``key`` (None: not kept, or no key during a capture)."""
    return None if key is None else _RESOLVED.get(key)


def keep_resolved(key: tuple | None, resolved: ResolvedOp) -> None:
    """Keep a resolved call under ``key`` (not during a capture, which has none)."""
    if key is not None:
        _RESOLVED.store(key, resolved)


def clear_resolved_ops() -> None:
    """Forget every resolved op call (``clear_caches``)."""
    _RESOLVED.clear()
