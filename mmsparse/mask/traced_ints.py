"""Small integer tensors of host values in a traced graph, made of pure ops rather than constants.

A traced call's lengths and bit tables are ints (or a graph's int symbols). ``torch.tensor`` of them becomes a
constant of the graph, one per call site: two layers over the same lengths then build the same mask from two
constants, and the compiler cannot tell that their work is the same. Built from ``full`` ops of the values
instead, equal values make equal graph nodes, which AOTAutograd's common-subexpression pass merges: every layer of a
step over the same lengths reads one mask, built once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Past this many values a row is a constant as before: each value is a node of the graph, which costs trace time.
MAX_POINTWISE_VALUES = 64


def traced_int_row(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, built in a traced graph from one ``full`` op per value
    (values may be the graph's int symbols) where there are at most :data:`MAX_POINTWISE_VALUES` of them."""
    if len(values) > MAX_POINTWISE_VALUES:
        return torch.tensor(list(values), dtype=dtype, device=device)
    return torch.stack([torch.full((), value, dtype=dtype, device=device) for value in values])
