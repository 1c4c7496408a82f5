"""Frozen dataclasses that key caches, hashed once per object.

Plans, tiles and configs key the launch caches, and a frozen dataclass's generated ``__hash__`` hashes every field
again at each use: a call plan's nested passes and tiles cost about 1 µs a hash on a CPU, twice a lookup of a
most-recently-used map (the lookup, then the move to its end). Their fields never change, so :func:`hash_once` keeps
the hash on the object at its first use. Equality still compares every field. The kept hash is left out when the
object is pickled or copied: a string's hash differs from one process to the next.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")
_KEPT = "_kept_hash"


def hash_once(cls: type[T]) -> type[T]:
    """Class decorator for a frozen dataclass (applied above ``@dataclass(frozen=True)``): the hash of its fields'
    values, as the generated one, computed at the first hash and kept."""
    names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def __hash__(self: Any) -> int:
        kept = self.__dict__.get(_KEPT)
        if kept is None:
            kept = hash(tuple(getattr(self, name) for name in names))
            object.__setattr__(self, _KEPT, kept)
        return kept

    def __getstate__(self: Any) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop(_KEPT, None)
        return state

    cls.__hash__ = __hash__  # type: ignore[method-assign]
    cls.__getstate__ = __getstate__  # type: ignore[attr-defined]
    return cls
