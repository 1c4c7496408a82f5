"""Pair types of token runs from a mask expression: the exact mask as an mmsparse topology, or an error.

A run is a stretch of tokens on which every label the expression reads (block ids, sample ids, padding) is
constant, so that whether a query of run i sees a key of run j depends only on where the two sit: key <= query
(``c``) and key > query - W (``w``, with a sliding window). mmsparse's pair types give one of three functions of
those (NONE: never; FULL: always; CAUSAL: ``c``) and its window is AND-ed over every pair. So the expression on a
run pair must equal ``w AND type``. It is evaluated at the three points that can occur, (c, w) = (1, 1), (1, 0),
(0, 1) (a key after the query is always inside the window), and only where the runs' positions make the point
occur. An expression that differs (a block OR-ed after the window, longer than the window) is an error.
"""

from __future__ import annotations

import itertools

import torch

from ...mask.topology import CAUSAL, FULL, NONE
from .expression import Expr, PairValues, evaluate


class InexpressibleMask(NotImplementedError):
    """A mask that no topology of pair types with a global window gives exactly."""


def run_pair_types(
    expr: Expr,
    first: torch.Tensor,
    last: torch.Tensor,
    q_first: int,
    window: int | None,
    blocks: dict[int, torch.Tensor],
    same_sample: torch.Tensor | None,
    valid: torch.Tensor | None,
) -> torch.Tensor:
    """The int8 ``[K, K]`` pair types of K runs.

    Args:
        expr: the parsed mask function.
        first, last: int64 ``[K]``, each run's first and last key position.
        q_first: the first query's position (queries run to the last key).
        window: the sliding window W of the layer, or None.
        blocks: per block leaf (``id`` of the leaf), bool ``[K, K]``: same block, block id >= 0.
        same_sample: bool ``[K, K]`` with packed samples, else None.
        valid: bool ``[K]``, the key runs that are not padding; None: no padding.

    Raises:
        InexpressibleMask: where no pair type matches the expression on the positions that occur.
    """
    k = first.shape[0]
    qf = torch.maximum(first, torch.tensor(q_first))[:, None]  # a run's first query (runs before: no queries)
    ql = last[:, None]
    has_q = (last >= q_first)[:, None]
    kf, kl = first[None, :], last[None, :]
    w = window
    # Which of the three points occurs on each run pair.
    occurs_c1w1 = has_q & (kf <= ql) & ((kl >= qf - w + 1) if w is not None else True)
    occurs_c1w0 = has_q & (kf <= ql - w) if w is not None else torch.zeros(k, k, dtype=torch.bool)
    occurs_c0 = has_q & (kl > qf)

    def at(c: bool, wv: bool) -> torch.Tensor:
        """The expression at one point, the same for every value the cross-sample positional leaves may take."""
        values = []
        for free_c, free_w in itertools.product((False, True), repeat=2):
            v = PairValues(c, wv, same_sample, blocks, free_c, free_w)
            out = evaluate(expr, v)
            out = torch.full((k, k), out) if isinstance(out, bool) else out.expand(k, k)
            if valid is not None:
                out = out & valid[None, :]
            values.append(out)
        agree = torch.stack(values).all(0) | ~torch.stack(values).any(0)
        return values[0], agree

    e11, agree11 = at(True, True)
    e10, agree10 = at(True, False)
    e01, agree01 = at(False, True)
    unsure = (~agree11 & occurs_c1w1) | (~agree10 & occurs_c1w0) | (~agree01 & occurs_c0)
    if bool(unsure.any()):
        raise InexpressibleMask(
            "attn_implementation='mmsparse': the mask compares per-sample positions of different packed samples; "
            "mmsparse cannot express that"
        )
    cut = e10 & occurs_c1w0
    if bool(cut.any()):
        raise InexpressibleMask(
            f"attn_implementation='mmsparse': on this sliding-window layer (window {window}) the mask keeps pairs "
            f"further apart than the window (a bidirectional block longer than the window, added after the window: "
            f"e.g. an image of more than {window} tokens), while mmsparse's window applies to every pair. Use "
            "images of at most the window's length or another attn_implementation"
        )
    full = e01 & occurs_c0
    causal = e11 & occurs_c1w1 & ~full
    if bool((full & occurs_c1w1 & ~e11).any()):
        raise InexpressibleMask(
            "attn_implementation='mmsparse': the mask lets queries see later keys but not earlier ones of the same "
            "runs, which no pair type expresses"
        )
    types = torch.full((k, k), NONE, dtype=torch.int8)
    types[causal] = CAUSAL
    types[full] = FULL
    return types
