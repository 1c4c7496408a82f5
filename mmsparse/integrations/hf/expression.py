"""The mask function transformers composes, read back as an expression over a few known pieces.

transformers (``masking_utils``) builds a layer type's mask as one function ``f(batch, head, q_idx, kv_idx)``
composed of closures: ``and_masks``/``or_masks`` over the causal mask, a sliding window, a vision model's blocks
(``blockwise_overlay(block_sequence_ids)``: tokens of one block >= 0 see each other in both directions), a packed
batch's samples, and position remapping for packed rows. :func:`parse` walks those closures (their qualified names
and captured variables) into a small tree; any piece it does not know is an error, never a guess. The tree is then
evaluated per pair of token runs (:func:`evaluate`), not per token pair: no S x S tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch

_MODULE = "transformers.masking_utils"


@dataclass(frozen=True)
class Causal:
    """key index <= query index; ``remapped``: on packed per-sample positions."""

    remapped: bool = False


@dataclass(frozen=True)
class Everything:
    """Every pair (``bidirectional_mask_function``)."""


@dataclass(frozen=True)
class Window:
    """key index > query index - size (``sliding_window_overlay``)."""

    size: int
    remapped: bool = False


@dataclass(frozen=True, eq=False)
class SameBlock:
    """Query and key in the same block, the block id >= 0 (``blockwise_overlay``). ``positions``: the
    ``position_ids`` the ids are read at (a packed row's remapping), else the token indices themselves."""

    ids: torch.Tensor
    positions: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class SameSample:
    """Query and key in the same sample of a packed row (``packed_sequence_mask_function``)."""

    sample_ids: torch.Tensor


@dataclass(frozen=True)
class And:
    parts: tuple


@dataclass(frozen=True)
class Or:
    parts: tuple


Expr = Union[Causal, Everything, Window, SameBlock, SameSample, And, Or]


def parse(mask_function: Callable, positions: torch.Tensor | None = None) -> Expr:
    """The expression of a transformers mask function.

    Args:
        mask_function: what transformers passes a registered mask interface as ``mask_function``.
        positions: set inside a packed row's remapping (the row's ``position_ids``).

    Raises:
        NotImplementedError: a piece this backend does not know (a model-specific mask, chunked attention, a
            bidirectional sliding window, ...), named.
    """
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if getattr(mask_function, "__module__", None) != _MODULE:
        raise NotImplementedError(_unknown(mask_function, name))
    captured = _captured(mask_function)
    remapped = positions is not None
    if name == "causal_mask_function":
        return Causal(remapped)
    if name == "bidirectional_mask_function":
        return Everything()
    if name == "and_masks.<locals>.and_mask":
        return And(tuple(parse(f, positions) for f in captured["mask_functions"]))
    if name == "or_masks.<locals>.or_mask":
        return Or(tuple(parse(f, positions) for f in captured["mask_functions"]))
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return Window(int(captured["sliding_window"]), remapped)
    if name == "blockwise_overlay.<locals>.inner_mask":
        return SameBlock(captured["block_sequence_ids"], positions)
    if name == "packed_sequence_mask_function.<locals>.inner_mask" and not remapped:
        return SameSample(captured["packed_sequence_mask"])
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask" and not remapped:
        return parse(captured["mask_function"], captured["position_ids"])
    raise NotImplementedError(_unknown(mask_function, name))


def _captured(fn: Callable) -> dict[str, Any]:
    names = fn.__code__.co_freevars
    return {n: c.cell_contents for n, c in zip(names, fn.__closure__ or ())}


def _unknown(fn: Callable, name: str) -> str:
    where = getattr(fn, "__module__", None) or "?"
    return (
        f"attn_implementation='mmsparse' cannot express the mask piece {name!r} (from {where}): it expresses "
        "transformers' causal and bidirectional masks, sliding windows, packed samples and vision models' "
        "bidirectional blocks (Gemma 3, PaliGemma), with right padding. Use another attn_implementation for this "
        "model or mask"
    )


def leaves(expr: Expr) -> list[Expr]:
    """The leaves of ``expr``, left to right."""
    if isinstance(expr, (And, Or)):
        return [leaf for part in expr.parts for leaf in leaves(part)]
    return [expr]


@dataclass
class PairValues:
    """The leaves' values on every (query run, key run) pair at one point of the positional conditions.

    ``causal``/``window``: the value of key <= query and key > query - W at this point (Python bools, the same for
    every run pair). ``same_sample``: bool ``[K, K]`` or None without packing. ``blocks``: per :class:`SameBlock`
    leaf (by ``id``), bool ``[K, K]``. ``free_causal``/``free_window``: the values taken by remapped positional
    leaves on pairs of different samples, whose per-sample positions are unrelated (tried both ways by the caller).
    """

    causal: bool
    window: bool
    same_sample: torch.Tensor | None
    blocks: dict[int, torch.Tensor]
    free_causal: bool = False
    free_window: bool = False


def evaluate(expr: Expr, v: PairValues) -> torch.Tensor | bool:
    """``expr`` on every run pair: bool ``[K, K]``, or a Python bool when no leaf depends on the pair."""
    if isinstance(expr, And):
        out: torch.Tensor | bool = True
        for part in expr.parts:
            out = _and(out, evaluate(part, v))
        return out
    if isinstance(expr, Or):
        out = False
        for part in expr.parts:
            out = _or(out, evaluate(part, v))
        return out
    if isinstance(expr, Everything):
        return True
    if isinstance(expr, Causal):
        return _remapped(v.causal, v.free_causal, v) if expr.remapped else v.causal
    if isinstance(expr, Window):
        return _remapped(v.window, v.free_window, v) if expr.remapped else v.window
    if isinstance(expr, SameBlock):
        return v.blocks[id(expr)]
    if isinstance(expr, SameSample):
        assert v.same_sample is not None
        return v.same_sample
    raise TypeError(f"not a mask expression: {expr!r}")


def _remapped(value: bool, free: bool, v: PairValues) -> torch.Tensor | bool:
    """A positional leaf on per-sample positions: ``value`` within a sample (positions there rise one by one, so
    differences are the token indices'), ``free`` across samples."""
    if v.same_sample is None or value == free:
        return value
    return v.same_sample if value else ~v.same_sample


def _and(a: torch.Tensor | bool, b: torch.Tensor | bool) -> torch.Tensor | bool:
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    return a & b


def _or(a: torch.Tensor | bool, b: torch.Tensor | bool) -> torch.Tensor | bool:
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False:
        return a
    return a | b
