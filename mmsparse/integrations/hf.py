"""Hugging Face transformers backend: ``attn_implementation="mmsparse"`` for Llama/Qwen2-style models.

Usage::

    from mmsparse.integrations import hf
    hf.register()  # once; idempotent
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mmsparse")
    out = model(input_ids, mm_topology=[[1, 1, 0], [0, 1, 1], [1, 0, 1]], mm_seg_lens=(64, 256, 192))

The topology and segment lengths come from the forward kwargs ``mm_topology`` / ``mm_seg_lens`` or, when absent, the
attributes of the same names on the attention module's config (``config.mm_topology = ...``). Decoder layers
(``module.is_causal``) combine the topology with the causal mask.

- ``mm_seg_lens``: k lengths summing to the key length, or per-sample ``[B, k]`` rows (a row summing to less is
  padded at the end).
- A 2-D ``attention_mask`` with right padding is honoured: segments are cut at each sample's last real token and
  padded queries output 0. Left padding, prepared 4-D masks, sliding windows, packed sequences, other custom mask
  functions and static caches raise an error rather than being ignored.
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

from ..functional import mbs_attention
from ..lengths import clip_seg_lens, is_per_sample, valid_lens_from_padding

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
    if mask_function is not None and mask_function not in _PLAIN_MASK_FUNCTIONS:
        name = getattr(mask_function, "__name__", type(mask_function).__name__)
        raise NotImplementedError(
            f"attn_implementation='mmsparse' cannot apply the mask function {name!r} (sliding window, packed "
            "sequences, or a model-specific mask): it supports causal or bidirectional attention with right padding"
        )
    if attention_mask is None:
        return None
    mask = (attention_mask if kv_length is None else attention_mask[:, -kv_length:]).bool()
    return None if bool(mask.all()) else mask


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
        kwargs: ``mm_topology``, ``mm_seg_lens``, ``mm_extend_last_segment`` (override the config), ``is_causal``.

    Returns:
        ``(out [B, Sq, H, D], None)``: no attention weights.
    """
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"attn_implementation='mmsparse' does not support {unsupported}")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attn_implementation='mmsparse' does not support attention sinks")
    kv_len = key.shape[2]
    topology, seg_lens = _segments(module, kwargs, kv_len)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attn_implementation='mmsparse' takes a 2-D padding mask; got a {attention_mask.dim()}-D "
                f"{attention_mask.dtype} mask. Express the mask through mm_topology/mm_seg_lens instead of a "
                "prepared 4-D mask"
            )
        seg_lens = clip_seg_lens(seg_lens, valid_lens_from_padding(attention_mask[:, -kv_len:]))
    causal = kwargs.get("is_causal")
    if causal is None:
        config = getattr(module, "config", None)
        causal = getattr(module, "is_causal", True) and getattr(config, "is_causal", True)
    out = mbs_attention(
        query, key, value, topology, seg_lens, causal=bool(causal), dropout_p=dropout, softmax_scale=scaling
    )
    return rearrange(out, "b h s d -> b s h d"), None
