"""The one dense reference: plain masked softmax attention in float64, for tests and benchmarks.

It is deliberately independent of the kernels' code path: it takes a dense bool mask (build it with
:func:`reference_mask`) and uses ordinary torch ops, with autograd for the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

from .mask.lengths import SegLensArg
from .mask.topology import NONE, Topology, allowed_by_type, lookup_pairs, segment_ids


def reference_mask(
    topology: Any, seg_lens: SegLensArg, seq_k: int,
    seq_q: int | None = None, causal: bool = False, q_start: Sequence[int] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Dense bool mask ``[B, Sq, Sk]`` (B = 1 for one set of lengths) by direct token-by-token lookup.

    seg_lens: k lengths or ``[B, k]`` per-sample lengths; tokens past a sample's total are padding.
    q_start: per-sample position of the first query (default Sk - Sq).
    window: keep only keys whose position is greater than the query's minus ``window`` (None: all).
    """
    topo = Topology(topology)
    lens = _lengths(seg_lens, topo.num_segments, seq_k)
    seq_q = seq_k if seq_q is None else seq_q
    seg = segment_ids(lens, seq_k)  # [B, Sk], k = padding
    k = topo.num_segments
    table = torch.full((k + 1, k + 1), NONE, dtype=torch.int8)
    table[:k, :k] = topo.types
    starts = torch.full((seg.shape[0],), seq_k - seq_q) if q_start is None else torch.as_tensor(q_start).cpu()
    if starts.shape[0] != seg.shape[0]:
        seg = seg.expand(starts.shape[0], -1)
    q_pos = starts[:, None].to(torch.int64) + torch.arange(seq_q)  # [B, Sq]
    q_seg = torch.where((q_pos >= 0) & (q_pos < seq_k), seg.gather(1, q_pos.clamp(0, seq_k - 1)), k)
    k_pos = torch.arange(seq_k)[None, None, :]
    mask = allowed_by_type(lookup_pairs(table, q_seg, seg), q_pos[:, :, None], k_pos)
    if causal:
        mask = mask & (k_pos <= q_pos[:, :, None])
    if window is not None:
        mask = mask & (k_pos > q_pos[:, :, None] - window)
    return mask


def _lengths(seg_lens: SegLensArg, num_segments: int, seq_k: int | None = None) -> torch.Tensor:
    """int64 ``[B, k]`` on the CPU from k lengths or ``[B, k]`` rows, checked here (the reference takes nothing
    from the kernels' own checks): integers, one a segment, none negative, each row within the ``seq_k`` keys (None:
    packed samples, each as long as its row)."""
    lens = torch.as_tensor(seg_lens).cpu()
    if lens.dtype == torch.bool or lens.is_floating_point() or lens.is_complex():
        raise TypeError(f"seg_lens must hold integers; got {lens.dtype}")
    lens = lens[None] if lens.dim() == 1 else lens
    if lens.dim() != 2 or lens.shape[1] != num_segments:
        raise ValueError(f"seg_lens must be {num_segments} lengths or [B, {num_segments}] rows, one a segment of the "
                         f"topology; got shape {tuple(lens.shape)}")
    if bool((lens < 0).any()):
        raise ValueError(f"segment lengths must be >= 0; got {lens.tolist()}")
    if seq_k is not None and bool((lens.sum(-1) > seq_k).any()):
        raise ValueError(f"a row of seg_lens sums to more than the {seq_k} key positions: {lens.tolist()}")
    return lens.to(torch.int64)


def reference_packed_mask(topology: Any, seg_lens: Any, causal: bool = False,
                          window: int | None = None) -> torch.Tensor:
    """Dense bool mask ``[1, S, S]`` of N samples packed end to end (``seg_lens`` ``[N, k]``, S the total): each
    sample's tokens see the tokens of the same sample per the topology (and the window), nothing else."""
    lens = torch.as_tensor(seg_lens)
    if lens.dim() != 2:
        raise ValueError(f"packed seg_lens are [N, k], a row of lengths per sample; got shape {tuple(lens.shape)}")
    lens = _lengths(lens, Topology(topology).num_segments)
    totals = lens.sum(-1).tolist()
    seq = sum(totals)
    mask = torch.zeros(1, seq, seq, dtype=torch.bool)
    start = 0
    for row, total in zip(lens.tolist(), totals):
        end = start + total
        mask[0, start:end, start:end] = reference_mask(topology, row, total, causal=causal, window=window)[0]
        start = end
    return mask


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float | None = None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Masked attention computed densely in ``dtype`` (float64 by default).

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]`` (Hq a multiple of Hkv).
        mask: bool ``[Sq, Sk]`` or ``[B, Sq, Sk]``; True where the query may attend the key.
        softmax_scale: default 1/sqrt(D).
        dropout_keep: optional bool ``[B, Hq, Sq, Sk]`` keep mask, applied as ``p * keep / (1 - dropout_p)``.

    Returns:
        ``[B, Hq, Sq, D]`` in ``dtype``. Rows that attend nothing are 0.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
    mask = mask.to(q.device)
    mask = mask[None, None] if mask.dim() == 2 else mask[:, None]
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    e = torch.exp(s - row_max) * mask
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    if dropout_keep is not None:
        p = p * dropout_keep.to(p.device) / (1.0 - dropout_p)
    return p @ vd



MaskRows = Callable[[torch.Tensor], torch.Tensor]  # query rows [R] -> bool [R, Sk]: which keys they see
KeepRows = Callable[[int, torch.Tensor], torch.Tensor]  # (head g, query rows [R]) -> bool [R, Sk] dropout keep


def reference_group_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, allowed: MaskRows,
    rows: torch.Tensor, cols: torch.Tensor, softmax_scale: float | None = None, dtype: torch.dtype = torch.float32,
    chunk: int = 2048, keep: KeepRows | None = None, dropout_p: float = 0.0,
    delta_from: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same attention as :func:`reference_attention`, for problems too large for an S x S tensor: one sample
    and one GQA group, on sampled rows, a chunk of queries at a time (memory O(chunk * Sk)). Output and dq need
    only their own rows; dk and dv need every query, so with ``cols`` the whole sequence is walked.

    Args:
        q, grad_out: ``[G, Sq, D]``, the group's query heads and the output gradient; k, v: ``[Sk, D]``.
        allowed: which keys the given query rows see.
        rows: query rows (int64 ``[R]``, ascending, distinct) whose output and dq are wanted; cols: key rows
            (``[C]``, may be empty) whose dk and dv are wanted.
        keep, dropout_p: optional dropout keep mask, per head and query rows.
        delta_from: the dtype the output is stored in before the backward reads it: delta = rowsum(dO * O) from O
            rounded to it, as a FlashAttention-style backward computes delta from the stored output (None: from O
            as computed).

    Returns:
        ``(out [G, R, D], dq [G, R, D], dk [C, D], dv [C, D])`` in ``dtype``; dk, dv summed over the group.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    rows, cols = rows.to(q.device), cols.to(q.device)
    kd, vd = k.to(dtype), v.to(dtype)
    out = q.new_zeros((q.shape[0], rows.numel(), q.shape[-1]), dtype=dtype)
    dq = torch.zeros_like(out)
    dk = q.new_zeros((cols.numel(), q.shape[-1]), dtype=dtype)
    dv = torch.zeros_like(dk)
    walk = torch.arange(q.shape[1], device=q.device) if cols.numel() else rows
    for g in range(q.shape[0]):
        for idx in walk.split(chunk):
            qc, doc = q[g, idx].to(dtype), grad_out[g, idx].to(dtype)
            mask = allowed(idx).to(q.device)
            s = (qc @ kd.T) * scale
            s = s.masked_fill(~mask, float("-inf"))
            row_max = s.amax(-1, keepdim=True)
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            e = torch.exp(s - row_max) * mask
            del s
            denom = e.sum(-1, keepdim=True)
            p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
            del e
            dp = doc @ vd.T
            if keep is not None:
                kept = keep(g, idx).to(device=q.device, dtype=dtype) / (1.0 - dropout_p)
                p_out, dp = p * kept, dp * kept
            else:
                p_out = p
            o = p_out @ vd
            stored = o if delta_from is None else o.to(delta_from).to(dtype)
            ds = p * (dp - (doc * stored).sum(-1, keepdim=True))  # delta = rowsum(dO * O)
            if cols.numel():
                dv += p_out[:, cols].T @ doc
                dk += (ds[:, cols].T @ qc) * scale
            hit = torch.isin(rows, idx).nonzero().flatten()  # wanted rows in this chunk
            if hit.numel():
                local = torch.searchsorted(idx, rows[hit])
                out[g, hit] = o[local]
                dq[g, hit] = (ds[local] @ kd) * scale
    return out, dq, dk, dv
