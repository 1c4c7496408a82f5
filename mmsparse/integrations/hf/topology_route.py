"""The ``mm_topology`` route: a user-given topology and segment lengths for models whose mask transformers does not
know (Llama/Qwen2-style decoders fed multimodal sequences).

The topology and segment lengths come from the forward kwargs ``mm_topology`` / ``mm_seg_lens`` or, when absent, the
attributes of the same names on the attention module's config. Decoder layers (``module.is_causal``) combine the
topology with the causal mask; with pair types pass ``mm_causal=False`` (kwarg or config) so that the topology alone
decides. ``mm_seg_lens``: k lengths summing to the key length, or per-sample ``[B, k]`` rows. Right padding (from
the model's 2-D mask) cuts the segments; packed batches (``position_ids`` restarting, or ``cu_seq_lens_k``) take one
row of lengths per sample; with a KV cache, ``mm_extend_last_segment=True`` puts keys past the given segments in
the last one.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from ...functional import mbs_attention, mbs_attention_varlen
from ...mask.lengths import (
    clip_seg_lens,
    is_per_sample,
    seg_lens_argument,
    valid_lens_from_padding,
    validate_seg_lens,
)
from .model_mask import MaskSpec


def user_topology(module: nn.Module, kwargs: dict) -> bool:
    """Whether this call takes the ``mm_topology`` route (kwarg or config)."""
    return _setting(module, kwargs, "mm_topology") is not None or _setting(module, kwargs, "mm_seg_lens") is not None


def _setting(module: nn.Module, kwargs: dict, name: str, default: Any = None) -> Any:
    if kwargs.get(name) is not None:
        return kwargs[name]
    config = getattr(module, "config", None)
    value = getattr(config, name, None)
    return default if value is None else value


def _segments(module: nn.Module, kwargs: dict, kv_len: int) -> tuple[Any, Any]:
    topology = _setting(module, kwargs, "mm_topology")
    seg_lens = _setting(module, kwargs, "mm_seg_lens")
    if topology is None or seg_lens is None:
        raise ValueError(
            "attn_implementation='mmsparse' needs a topology and segment lengths: pass mm_topology=... and "
            "mm_seg_lens=... to the model's forward, or set config.mm_topology and config.mm_seg_lens"
        )
    seg_lens = seg_lens_argument(seg_lens, "mm_seg_lens")
    if is_per_sample(seg_lens):
        return topology, seg_lens
    lens = list(validate_seg_lens(seg_lens, len(seg_lens), "mm_seg_lens"))  # ints: a float is not truncated
    total = sum(lens)
    if total < kv_len and _setting(module, kwargs, "mm_extend_last_segment", False):
        lens[-1] += kv_len - total
    elif total != kv_len:
        raise ValueError(
            f"mm_seg_lens {tuple(lens)} sum to {total} but the keys have {kv_len} positions (with a KV cache: "
            "prompt + cached tokens). Pass lengths covering all key positions, or mm_extend_last_segment=True to "
            "put the positions past the given segments (e.g. generated tokens) in the last segment"
        )
    return topology, tuple(lens)


def _packed_samples(kwargs: dict, batch: int, q_len: int, kv_len: int) -> list[int] | None:
    """The sample lengths of a packed batch (one row, samples end to end) from ``cu_seq_lens_k`` or restarting
    ``position_ids``; None when the batch is not packed (one host read of the boundaries when it may be)."""
    if batch != 1 or q_len != kv_len:
        return None
    cu = kwargs.get("cu_seq_lens_k")
    if cu is not None:
        lens = torch.diff(cu.reshape(-1)).tolist()
    else:
        pos = kwargs.get("position_ids")
        if pos is None or pos.shape[-1] != kv_len:
            return None
        pos = pos.reshape(-1, kv_len)[0]
        starts = [0, *((pos[1:] - pos[:-1]) != 1).nonzero().reshape(-1).add(1).tolist()]
        lens = [b - a for a, b in zip(starts, starts[1:] + [kv_len])]
    return lens if len(lens) > 1 else None


def _packed_rows(seg_lens: Any, samples: list[int]) -> list[list[int]]:
    """``mm_seg_lens`` of a packed batch, checked against the sample lengths transformers passes."""
    seg_lens = seg_lens_argument(seg_lens, "mm_seg_lens")
    rows = seg_lens.tolist() if isinstance(seg_lens, torch.Tensor) else seg_lens
    if not is_per_sample(rows) or len(rows) != len(samples):
        raise ValueError(
            f"this batch packs {len(samples)} samples (lengths {samples[:8]}{'...' if len(samples) > 8 else ''}, from "
            "position_ids or cu_seq_lens): mm_seg_lens must give one row of segment lengths per sample, "
            f"[{len(samples)}, k]"
        )
    rows = [list(validate_seg_lens(r, len(r), f"mm_seg_lens[{i}]")) for i, r in enumerate(rows)]
    for i, (row, n) in enumerate(zip(rows, samples)):
        if sum(row) != n:
            raise ValueError(
                f"packed sample {i} has {n} tokens (from position_ids or cu_seq_lens) but mm_seg_lens[{i}] = {row} "
                f"sums to {sum(row)}"
            )
    return rows


def topology_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spec: MaskSpec | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict,
) -> torch.Tensor:
    """Attention under the user's topology: ``[B, Sq, H, D]``. ``spec``: the model's own mask (its padding; it must
    have no blocks, which the topology would silently replace; its sliding window applies)."""
    if spec is not None and spec.has_blocks:
        raise ValueError(
            "attn_implementation='mmsparse': this model builds its own mask with bidirectional blocks (a vision "
            "model's images, from token_type_ids); mm_topology would replace it. Drop mm_topology/mm_seg_lens: the "
            "model's mask is used as transformers builds it"
        )
    # A sliding layer's window applies over the topology, as transformers applies it over the causal mask.
    window = None if spec is None else spec.window
    if kwargs.get("sliding_window") is not None and spec is None:
        raise ValueError("attn_implementation='mmsparse': a sliding-window layer without its mask")
    kv_len = key.shape[2]
    causal = _setting(module, kwargs, "mm_causal", kwargs.get("is_causal"))
    if causal is None:
        config = getattr(module, "config", None)
        causal = getattr(module, "is_causal", True) and getattr(config, "is_causal", True)
    samples = _packed_samples(kwargs, query.shape[0], query.shape[2], kv_len)
    if samples is not None:
        topology, seg_lens = _setting(module, kwargs, "mm_topology"), _setting(module, kwargs, "mm_seg_lens")
        if topology is None or seg_lens is None:
            _segments(module, kwargs, kv_len)  # raises the missing-argument error
        rows = _packed_rows(seg_lens, samples)
        out = mbs_attention_varlen(query, key, value, topology, rows, causal=bool(causal), dropout_p=dropout,
                                   softmax_scale=scaling, window=window)
        return rearrange(out, "b h s d -> b s h d")
    topology, seg_lens = _segments(module, kwargs, kv_len)
    padding = None if spec is None else spec.padding
    if padding is not None:
        seg_lens = clip_seg_lens(seg_lens, valid_lens_from_padding(padding))
    out = mbs_attention(query, key, value, topology, seg_lens, causal=bool(causal), dropout_p=dropout,
                        softmax_scale=scaling, window=window)
    return rearrange(out, "b h s d -> b s h d")
