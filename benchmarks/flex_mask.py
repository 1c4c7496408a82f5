"""The one FlexAttention ``mask_mod`` for a topology over segments: what Flex is given in every comparison."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

MaskMod = Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor]


def segment_ids(seg_lens: Sequence[int] | torch.Tensor, seq_len: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each position's segment, and which positions are real tokens.

    Args:
        seg_lens: k lengths summing to ``seq_len``, or per-sample ``[B, k]`` lengths (a tensor) whose rows may
            sum to less (the rest of a row is padding).
        seq_len: S.

    Returns:
        ``(seg, real)``: ``seg`` int ``[S]`` for shared lengths (``real`` None), or ``[B, S]`` clamped to the last
        segment, with ``real`` bool ``[B, S]`` False on padding.
    """
    if not isinstance(seg_lens, torch.Tensor):
        ids = torch.arange(len(seg_lens), dtype=torch.int32)
        return torch.repeat_interleave(ids, torch.tensor(seg_lens)).to(device), None
    lens = seg_lens.to(device=device, dtype=torch.int64)
    ends = lens.cumsum(-1).contiguous()
    pos = torch.arange(seq_len, device=device).expand(lens.shape[0], -1).contiguous()
    seg = torch.searchsorted(ends, pos, right=True)
    real = seg < lens.shape[1]
    return seg.clamp(max=lens.shape[1] - 1), real


def flex_mask_mod(topology: Sequence[Sequence[int]], seg: torch.Tensor, causal: bool, past: int = 0,
                  real: torch.Tensor | None = None) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx)``: key ``kv_idx`` is visible to query ``q_idx`` when the topology links
    their segments, both are real tokens and, if causal, the key is not after the query.

    Args:
        topology: k x k 0/1; ``topology[r][c]`` lets segment r attend segment c.
        seg: segment ids ``[S]`` (shared by the batch) or ``[B, S]`` (per sample), from :func:`segment_ids`.
        causal: add ``kv_idx <= q_pos``.
        past: the queries are the last positions: query ``i`` sits at position ``past + i`` (decoding).
        real: optional bool ``[B, S]``, False on padding.
    """
    table = torch.tensor(topology, dtype=torch.bool, device=seg.device)
    per_sample = seg.dim() == 2

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_pos = q_idx + past
        if per_sample:
            allowed = table[seg[b, q_pos], seg[b, kv_idx]]
            if real is not None:
                allowed = allowed & real[b, q_pos] & real[b, kv_idx]
        else:
            allowed = table[seg[q_pos], seg[kv_idx]]
        if causal:
            allowed = allowed & (kv_idx <= q_pos)
        return allowed

    return mask_mod
