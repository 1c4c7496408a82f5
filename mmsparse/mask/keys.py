"""Cache keys by value: the whole value as nested tuples of Python ints, never a printout.

A printout summarises (numpy and torch elide the middle of anything past 1000 elements), so two values that differ
only there would share a key and one would get the other's mask. A key here holds every element. Two inputs share a
key only when the code that validates and builds from them treats them alike: numpy and other integer scalars
become ints (:func:`mmsparse.mask.lengths.validate_seg_lens` reads them with ``int``), while a bool, an array or a
tensor is tagged with its kind, so that an input the validation would refuse never finds the entry of one it
accepts.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .lengths import is_array

_INT = int  # the exact type; bool, a subclass, is tagged apart
_INTS = frozenset((int,))
_ROWS = frozenset((list, tuple))


def value_key(value: Any) -> Hashable | None:
    """A hashable key holding all of ``value`` (lengths, a topology given as nested rows), or None when it holds
    something without a key by value (it is then not cached, and its own validation decides)."""
    kind = type(value)
    if kind is tuple or kind is list:
        kinds = set(map(type, value))
        if kinds <= _INTS:  # the common case: a row of ints
            return tuple(value)
        if kinds <= _ROWS and set(map(type, (n for row in value for n in row))) <= _INTS:  # rows of ints
            return tuple(map(tuple, value))
    key = _freeze(value)
    if key is None:
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _freeze(value: Any) -> Hashable | None:
    if type(value) is _INT:
        return value
    if isinstance(value, (list, tuple)):
        items = []
        for item in value:
            key = _freeze(item)
            if key is None:
                return None
            items.append(key)
        return tuple(items)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool:
            return int(value)
        return ("tensor", str(value.dtype), str(value.device), tuple(value.shape), _nested(value.tolist()))
    if is_array(value):
        if value.ndim == 0 and value.dtype.kind in "iu":
            return int(value)
        return ("array", value.dtype.str, tuple(value.shape), _nested(value.tolist()))
    if hasattr(value, "__index__") and not isinstance(value, float):  # numpy and other integer scalars
        try:
            return int(value)
        except (TypeError, ValueError):
            return None
    return None


def _nested(values: Any) -> Any:
    """``tolist()``'s nested lists as nested tuples."""
    return tuple(_nested(v) for v in values) if isinstance(values, list) else values
