"""The one FlexAttention ``mask_mod`` for a topology over segments: what Flex is given in every comparison.

Every rule of mmsparse's masks is in it: segment ids and the topology's pair types (0/1/2: none, full, causal
within the pair), per-sample padding, decode offsets, the document ids of a pack (a token sees only its own
sample) and a sliding window. Ids are int64: ``create_block_mask`` evaluates the ``mask_mod`` over every (query,
key) pair, and int32 ids make it convert each S x S index to int64 first (two S x S int64 temporaries: 64 GB at
S = 64k).

FlexAttention's FLASH backend (FlashAttention-4, CuTe DSL) needs the other choice, ``index_dtype=torch.int32``: it
does not lower int64 captured index tensors. The ``mask_mod`` uses no ``clamp`` or ``maximum`` either way, since
FLASH does not lower those.

The window is a Python int closed over, as the decode offset is: the traced ``mask_mod`` holds it as a constant of
the index dtype, so int32 indices stay int32 for FLASH.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

from .configs import CAUSAL, FULL, NONE, validate_window

MaskMod = Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor]


def segment_ids(seg_lens: Sequence[int] | torch.Tensor, seq_len: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each position's segment, and which positions are real tokens.

    Args:
        seg_lens: k lengths summing to ``seq_len``, or per-sample ``[B, k]`` lengths (a tensor) whose rows may
            sum to less (the rest of a row is padding).
        seq_len: S.

    Returns:
        ``(seg, real)``: ``seg`` int64 ``[S]`` for shared lengths (``real`` None), or ``[B, S]`` clamped to the
        last segment, with ``real`` bool ``[B, S]`` False on padding.
    """
    if not isinstance(seg_lens, torch.Tensor):
        ids = torch.arange(len(seg_lens), dtype=torch.int64)
        return torch.repeat_interleave(ids, torch.tensor(seg_lens, dtype=torch.int64)).to(device), None
    lens = seg_lens.to(device=device, dtype=torch.int64)
    ends = lens.cumsum(-1).contiguous()
    pos = torch.arange(seq_len, device=device).expand(lens.shape[0], -1).contiguous()
    seg = torch.searchsorted(ends, pos, right=True)
    real = seg < lens.shape[1]
    return seg.clamp(max=lens.shape[1] - 1), real


def packed_ids(rows: Sequence[Sequence[int]] | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's sample (document) and segment in a pack of N samples laid end to end.

    Args:
        rows: ``[N, k]`` lengths; sample n owns the next ``sum(rows[n])`` positions.

    Returns:
        ``(doc, seg)``, int64 ``[S]`` each, S the total.
    """
    lens = torch.as_tensor(rows, dtype=torch.int64).cpu()
    n, k = lens.shape
    seg = torch.repeat_interleave(torch.arange(k, dtype=torch.int64).repeat(n), lens.reshape(-1))
    doc = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), lens.sum(-1))
    return doc.to(device), seg.to(device)


def flex_mask_mod(topology: Sequence[Sequence[int]], seg: torch.Tensor, causal: bool, past: int = 0,
                  real: torch.Tensor | None = None, doc: torch.Tensor | None = None,
                  index_dtype: torch.dtype = torch.int64, window: int | None = None) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx)``: key ``kv_idx`` is visible to query ``q_idx`` when both are in the same
    document (a pack's sample), the topology's pair type of their segments is FULL, or CAUSAL with the key not
    after the query, both are real tokens, if causal the key is not after the query, and with a window the key is
    less than ``window`` positions before the query.

    Args:
        topology: k x k pair types 0/1/2 (NONE/FULL/CAUSAL); ``topology[r][c]`` says what segment r sees of
            segment c. A 0/1 topology is looked up as a bool table (int32 for FLASH).
        seg: segment ids ``[S]`` (shared by the batch) or ``[B, S]`` (per sample), from :func:`segment_ids` or
            :func:`packed_ids`.
        causal: add ``kv_idx <= q_pos``.
        past: the queries are the last positions: query ``i`` sits at position ``past + i`` (decoding).
        real: optional bool ``[B, S]``, False on padding.
        doc: optional document ids ``[S]`` of a pack (:func:`packed_ids`): only pairs within one document.
        index_dtype: the dtype of every tensor the ``mask_mod`` captures. ``torch.int64`` (default) for the Triton
            backend and ``create_block_mask``; ``torch.int32`` for the FLASH backend, which lowers only int32
            captures: then the pair-type table, the ids and ``real`` are all int32 (``real`` compared with 0).
        window: keep only ``kv_idx > q_pos - window`` (``mmsparse``'s ``window=``); None: no window. In a pack the
            positions are the packed ones, as in ``mbs_attention_varlen``: the same differences as the sample's.
    """
    if index_dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index_dtype must be torch.int64 or torch.int32, not {index_dtype}")
    validate_window(window)
    types = torch.tensor(topology, dtype=torch.int8)
    if bool(((types != NONE) & (types != FULL) & (types != CAUSAL)).any()):
        raise ValueError("topology entries are pair types 0, 1 and 2")
    flash = index_dtype == torch.int32
    typed = bool((types == CAUSAL).any())
    # FLASH: the pair types themselves as int32 even for 0/1, so that no bool or int8 buffer is captured.
    table = types.to(seg.device) if typed or flash else (types != NONE).to(seg.device)
    seg = seg.to(index_dtype)
    doc = None if doc is None else doc.to(index_dtype)
    if flash:
        table = table.to(torch.int32)
        real = None if real is None else real.to(torch.int32)
    per_sample = seg.dim() == 2
    if doc is not None and per_sample:
        raise ValueError("document ids go with one packed sequence ([S] segment ids), not per-sample [B, S] ones")

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_pos = q_idx + past
        if per_sample:
            pair = table[seg[b, q_pos], seg[b, kv_idx]]
        else:
            pair = table[seg[q_pos], seg[kv_idx]]
        if typed:
            allowed = (pair == FULL) | ((pair == CAUSAL) & (kv_idx <= q_pos))
        else:
            allowed = (pair != NONE) if flash else pair
        if real is not None and flash:
            allowed = allowed & (real[b, q_pos] != 0) & (real[b, kv_idx] != 0)
        elif real is not None:
            allowed = allowed & real[b, q_pos] & real[b, kv_idx]
        if doc is not None:
            allowed = allowed & (doc[q_pos] == doc[kv_idx])
        if causal:
            allowed = allowed & (kv_idx <= q_pos)
        if window is not None:  # the subtraction on the query side: no S x S int64 temporary of its own in create_mask
            allowed = allowed & (kv_idx > q_pos - window)
        return allowed

    return mask_mod
