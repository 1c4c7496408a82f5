"""Where a rank's chunks sit in its tensors, and the copies of token runs between them.

A rank holds tokens as chunks laid end to end (its own tokens, the keys it gathered, a message to a peer), in
``[B, H, S, D]`` tensors. The exchanges move chunks between such tensors; a rank's chunks usually sit next to each
other, so a copy moves a run of many chunks at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .plan import ContextParallelPlan


def chunk_ranges(plan: ContextParallelPlan, chunks: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Chunk -> (start, end) of its tokens when ``chunks`` are laid end to end (a rank's local tokens, or the
    keys it gathered)."""
    ranges, start = {}, 0
    for c in chunks:
        ranges[c] = (start, start + plan.chunk_tokens(c))
        start += plan.chunk_tokens(c)
    return ranges


def served_chunks(plan: ContextParallelPlan, owner: int, peer: int) -> list[int]:
    """``owner``'s chunks that ``peer``'s queries see, in the plan's order: what the owner serves the peer, and the
    order of the peer's dK/dV contributions to them."""
    return [c for c in plan.needed_kv[peer] if plan.owner[c] == owner]


def merged_runs(spans: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) copies with each run of spans that are adjacent on both sides
    merged into one; empty spans dropped."""
    runs: list[tuple[int, int, int]] = []
    for src, dst, n in spans:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        elif n:
            runs.append((src, dst, n))
    return runs


def message_spans(plan: ContextParallelPlan, chunks: Sequence[int], where: dict[int, tuple[int, int]],
                  source_first: bool = True) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) of ``chunks`` between ``where`` (their places in a rank's
    tokens or gathered keys) and a message that holds them end to end: from ``where`` into the message, or
    (``source_first`` False) from the message into ``where``."""
    spans, offset = [], 0
    for c in chunks:
        n = plan.chunk_tokens(c)
        spans.append((where[c][0], offset, n) if source_first else (offset, where[c][0], n))
        offset += n
    return spans


def copy_tokens(dst: torch.Tensor, srcs: Sequence[torch.Tensor], spans: Sequence[tuple[int, int, int]]) -> None:
    """``dst[:, heads, d:d + n] = src[:, :, s:s + n]`` for each (s, d, n) of the merged ``spans``, the ``srcs``
    stacked along the head dim of ``dst`` (K's heads, then V's)."""
    for s, d, n in merged_runs(spans):
        h = 0
        for src in srcs:
            dst[:, h : h + src.shape[1], d : d + n] = src[:, :, s : s + n]
            h += src.shape[1]

