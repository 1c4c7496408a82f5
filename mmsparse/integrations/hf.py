"""Hugging Face transformers backend: ``attn_implementation="mmsparse"`` for Llama/Qwen2-style models.

Usage::

    from mmsparse.integrations import hf
    hf.register()  # once; idempotent
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mmsparse")
    out = model(input_ids, mm_topology=[[1, 1, 0], [0, 1, 1], [1, 0, 1]], mm_seg_lens=(64, 256, 192))

The topology and segment lengths come from the forward kwargs ``mm_topology`` / ``mm_seg_lens`` or, when absent, the
attributes of the same names on the attention module's config (``config.mm_topology = ...``). Decoder layers
(``module.is_causal``) combine the topology with the causal mask; with pair types (``mmsparse.CAUSAL`` where text is
causal, ``FULL`` where an image is bidirectional) pass ``mm_causal=False`` (kwarg or config) so that the topology
alone decides.

- ``mm_seg_lens``: k lengths summing to the key length, or per-sample ``[B, k]`` rows (a row summing to less is
  padded at the end).
- A 2-D ``attention_mask`` with right padding is honoured: segments are cut at each sample's last real token and
  padded queries output 0. Left padding, prepared 4-D masks, sliding windows, other custom mask functions and
  static caches raise an error rather than being ignored.
- Packed batches (``DataCollatorWithFlattening``: one row, ``position_ids`` restarting at each sample, or the
  ``cu_seq_lens_k`` kwarg): ``mm_seg_lens`` gives one row of k lengths per sample, ``[N, k]``; samples never see
  each other. Lengths that disagree with the sample boundaries transformers passes are an error.
- KV cache: the queries are the last positions of the keys, so ``mm_seg_lens`` must cover the whole key length
  (prompt + cached tokens). With ``mm_extend_last_segment=True`` (kwarg or config), keys past the given segments join
  the last segment: ``generate()`` then works with the prompt's lengths.

transformers is an optional dependency: it is imported by :func:`register`, never by ``import mmsparse``.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from ..functional import mbs_attention, mbs_attention_varlen
from ..mask.lengths import clip_seg_lens, is_per_sample, valid_lens_from_padding

NAME = "mmsparse"
_PLAIN_MASK_FUNCTIONS: tuple = ()  # transformers' causal / bidirectional mask functions, set by register()


def register(name: str = NAME) -> None:
    """Register mmsparse with transformers' ``AttentionInterface`` (and its mask interface). Idempotent.

    Args:
        name: the ``attn_implementation`` string to register.
    """
    global _PLAIN_MASK_FUNCTIONS
    try:
        from transformers import AttentionInterface, masking_utils
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "mmsparse.integrations.hf needs transformers >= 4.53 (AttentionInterface and masking_utils): "
            "pip install 'transformers>=4.53'"
        ) from e
    plain = (getattr(masking_utils, n, None) for n in ("causal_mask_function", "bidirectional_mask_function"))
    _PLAIN_MASK_FUNCTIONS = tuple(f for f in plain if f is not None)
    AttentionInterface.register(name, mmsparse_attention_forward)
    AttentionMaskInterface.register(name, mmsparse_mask)


def mmsparse_mask(
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: Any = None,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask hook for transformers' mask creation: the 2-D padding mask ``[B, kv_length]`` (bool, True = real token),
    or None when nothing is padded. The topology, causality and padding are applied inside the kernels.

    transformers calls it with keywords (batch size, lengths, offsets, ...); the others are ignored.
    """
    if q_length is not None and kv_length is not None and q_offset is not None:
        if int(q_offset) + q_length != kv_length:
            raise NotImplementedError(
                f"attn_implementation='mmsparse' needs the queries to be the last key positions; here queries "
                f"{int(q_offset)}..{int(q_offset) + q_length - 1} meet {kv_length} keys (a static or sliding cache?). "
                "Use the default DynamicCache"
            )
    # A packed batch (position ids restarting): the attention forward reads the samples from position_ids.
    if mask_function is not None and mask_function not in _PLAIN_MASK_FUNCTIONS and not _packs(mask_function):
        name = getattr(mask_function, "__name__", type(mask_function).__name__)
        raise NotImplementedError(
            f"attn_implementation='mmsparse' cannot apply the mask function {name!r} (sliding window, packed "
            "sequences, or a model-specific mask): it supports causal or bidirectional attention with right padding"
        )
    if attention_mask is None:
        return None
    mask = (attention_mask if kv_length is None else attention_mask[:, -kv_length:]).bool()
    return None if bool(mask.all()) else mask


def _packs(mask_function: Any, depth: int = 0) -> bool:
    """Whether transformers built ``mask_function`` for a packed batch: a plain mask combined with its packed
    sequence mask (found among the closures it combines)."""
    if "packed_sequence" in getattr(mask_function, "__qualname__", ""):
        return True
    if depth > 4:
        return False
    for cell in getattr(mask_function, "__closure__", None) or ():
        value = cell.cell_contents
        parts = value if isinstance(value, (tuple, list)) else (value,)
        if any(callable(p) and _packs(p, depth + 1) for p in parts):
            return True
    return False


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
    if is_per_sample(seg_lens):
        return topology, seg_lens
    lens = [int(n) for n in seg_lens]
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
    rows = seg_lens.tolist() if isinstance(seg_lens, torch.Tensor) else seg_lens
    if not is_per_sample(rows) or len(rows) != len(samples):
        raise ValueError(
            f"this batch packs {len(samples)} samples (lengths {samples[:8]}{'...' if len(samples) > 8 else ''}, from "
            "position_ids or cu_seq_lens): mm_seg_lens must give one row of segment lengths per sample, "
            f"[{len(samples)}, k]"
        )
    rows = [[int(n) for n in r] for r in rows]
    for i, (row, n) in enumerate(zip(rows, samples)):
        if sum(row) != n:
            raise ValueError(
                f"packed sample {i} has {n} tokens (from position_ids or cu_seq_lens) but mm_seg_lens[{i}] = {row} "
                f"sums to {sum(row)}"
            )
    return rows


def mmsparse_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="mmsparse"``.

    Args:
        module: the model's attention module (``is_causal``, ``config``).
        query: ``[B, H, Sq, D]``; the queries are the last Sq key positions (Sq < S with a KV cache).
        key, value: ``[B, Hkv, S, D]``.
        attention_mask: None or the 2-D padding mask from :func:`mmsparse_mask` (``[B, S]``, True = real token).
        scaling: softmax scale (default ``1/sqrt(D)``).
        dropout: attention dropout probability (transformers passes 0.0 in eval mode).
        kwargs: ``mm_topology``, ``mm_seg_lens``, ``mm_extend_last_segment``, ``mm_causal`` (override the config),
            ``is_causal``, and for packed batches ``position_ids`` or ``cu_seq_lens_k``.

    Returns:
        ``(out [B, Sq, H, D], None)``: no attention weights.
    """
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"attn_implementation='mmsparse' does not support {unsupported}")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attn_implementation='mmsparse' does not support attention sinks")
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
                                   softmax_scale=scaling)
        return rearrange(out, "b h s d -> b s h d"), None
    topology, seg_lens = _segments(module, kwargs, kv_len)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attn_implementation='mmsparse' takes a 2-D padding mask; got a {attention_mask.dim()}-D "
                f"{attention_mask.dtype} mask. Express the mask through mm_topology/mm_seg_lens instead of a "
                "prepared 4-D mask"
            )
        seg_lens = clip_seg_lens(seg_lens, valid_lens_from_padding(attention_mask[:, -kv_len:]))
    out = mbs_attention(
        query, key, value, topology, seg_lens, causal=bool(causal), dropout_p=dropout, softmax_scale=scaling
    )
    return rearrange(out, "b h s d -> b s h d"), None
