"""The attention function and mask interface transformers calls for ``attn_implementation="mmsparse"``."""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from ...functional import mbs_attention, mbs_attention_varlen
from ...mask.topology import FULL
from .model_mask import MaskSpec, ModelMask, build_model_mask
from .topology_route import topology_attention, user_topology


def mmsparse_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> ModelMask:
    """Mask interface: the mask transformers composed (``mask_function``, the 2-D padding ``attention_mask``) as a
    :class:`~.model_mask.ModelMask` for :func:`mmsparse_attention_forward`; no ``[S, S]`` tensor. transformers
    passes more keywords (dtype, config, ...); they are not needed.

    Raises:
        NotImplementedError: a mask mmsparse cannot express exactly (named), or queries that are not the last keys.
        ValueError: packed samples the mask would let see each other.
    """
    if mask_function is None:
        raise ValueError("attn_implementation='mmsparse': transformers passed no mask function")
    return build_model_mask(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
                            torch.device(device))


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
        attention_mask: the :class:`~.model_mask.ModelMask` from :func:`mmsparse_mask`: the model's own mask.
        scaling: softmax scale, as the model sets it (Gemma 3: ``query_pre_attn_scalar ** -0.5``; default
            ``1/sqrt(D)``).
        dropout: attention dropout probability (transformers passes 0.0 in eval mode).
        kwargs: ``sliding_window`` (checked against the mask's), ``softcap`` (unsupported), and for the
            ``mm_topology`` route ``mm_topology``, ``mm_seg_lens``, ``mm_extend_last_segment``, ``mm_causal``,
            ``is_causal``, ``position_ids``, ``cu_seq_lens_k``.

    The backward is the one ``mmsparse.use_config(deterministic=...)`` sets around the forward (the
    deterministic two-pass backward by default).

    Returns:
        ``(out [B, Sq, H, D], None)``: no attention weights.
    """
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            f"attn_implementation='mmsparse' does not support attention logit soft-capping (softcap="
            f"{kwargs['softcap']}; Gemma 2 and PaliGemma 2 set it): use attn_implementation='eager'"
        )
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attn_implementation='mmsparse' does not support attention sinks")
    spec = attention_mask.spec if isinstance(attention_mask, ModelMask) else None
    if spec is None and attention_mask is not None:
        raise ValueError(
            f"attn_implementation='mmsparse' takes the model's own mask or a 2-D padding mask; got a prepared "
            f"{attention_mask.dim()}-D {attention_mask.dtype} mask. Pass a 2-D attention_mask (or none); for a "
            "mask transformers does not know, mm_topology/mm_seg_lens"
        )
    if user_topology(module, kwargs):
        return topology_attention(module, query, key, value, spec, scaling, dropout, kwargs), None
    if spec is None:  # no mask built: as SDPA reads it, full attention, causal for a decoder's module
        return _unmasked(module, query, key, value, scaling, dropout, kwargs), None
    window = _layer_window(spec, kwargs.get("sliding_window"))
    if (query.shape[2], key.shape[2]) != (spec.q_length, spec.kv_length):
        raise ValueError(
            f"attn_implementation='mmsparse': the mask was built for {spec.q_length} queries and {spec.kv_length} "
            f"keys but the layer has {query.shape[2]} and {key.shape[2]}"
        )
    run = mbs_attention_varlen if spec.packed else mbs_attention
    out = run(query, key, value, spec.topology, spec.seg_lens, causal=False, dropout_p=dropout, softmax_scale=scaling,
              window=window)
    return rearrange(out, "b h s d -> b s h d"), None


def _unmasked(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
    dropout: float, kwargs: dict,
) -> torch.Tensor:
    """Attention of a call without a mask (a vision encoder's): every key, or the causal mask when the module (or
    the ``is_causal`` kwarg) says so, as transformers' SDPA function reads it."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    causal = bool(causal) and query.shape[2] > 1
    if causal and query.shape[2] != key.shape[2]:
        raise ValueError(
            "attn_implementation='mmsparse' got no mask for a causal call whose queries are not its keys: transformers "
            "builds one for a KV cache"
        )
    out = mbs_attention(query, key, value, _ONE_SEGMENT, (key.shape[2],), causal=causal, dropout_p=dropout,
                        softmax_scale=scaling)
    return rearrange(out, "b h s d -> b s h d")


_ONE_SEGMENT = ((FULL,),)


def _layer_window(spec: MaskSpec, layer_window: int | None) -> int | None:
    """The window to pass mmsparse: the mask's (key kept when its position > query position - window, AND-ed over
    every pair), which must be the layer's."""
    if layer_window is not None and spec.layer_window != layer_window:
        raise ValueError(
            f"attn_implementation='mmsparse': the layer's sliding window is {layer_window} but its mask has "
            f"{spec.layer_window}"
        )
    return spec.window
