"""Layers with weights: a multimodal block-sparse (MBS) self-attention layer and :func:`replace_attention` for
existing models. (:class:`mmsparse.TritonMBSAttnKernel` is the weight-free module over q, k, v.)

``MultimodalSelfAttention`` is a full attention layer (q/k/v and output projections, GQA) for ``[B, S, E]`` inputs.
``replace_attention`` swaps the ``nn.MultiheadAttention`` self-attention of existing layers (for example the
``self_attn`` of ``nn.TransformerEncoderLayer``) for :class:`MultiheadMBSAttention`, which uses the same parameter
objects, so the weights, the optimizer state and the ``state_dict`` keys stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .checks import (
    FLOAT64_HINT,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    check_deterministic,
    check_dropout,
    check_flag,
    check_window,
    head_dim_supported,
)
from .functional import mbs_attention
from .mask.lengths import SegLensArg, clip_seg_lens, valid_lens_from_padding, validate_seg_lens
from .mask.prepared import PreparedMask
from .mask.topology import Topology

__all__ = [  # clip_seg_lens and valid_lens_from_padding live in mmsparse.mask.lengths; importing them from here works
    "MultiheadMBSAttention", "MultimodalSelfAttention", "clip_seg_lens", "replace_attention",
    "valid_lens_from_padding",
]


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value



def _check_head_dim(embed_dim: int, num_heads: int) -> int:
    if embed_dim % num_heads != 0:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    head_dim = embed_dim // num_heads
    if not head_dim_supported(head_dim):
        raise ValueError(
            f"head dim embed_dim / num_heads = {head_dim} is not supported by the kernels: use {SUPPORTED_HEAD_DIMS}"
        )
    return head_dim


class _MBSAttentionCore(nn.Module):
    """Shared state and the head-split / attention / head-merge step of the layers below."""

    deterministic: bool | None = None  # also the value of modules pickled before the argument existed

    def _init_core(
        self, num_heads: int, num_kv_heads: int, head_dim: int, topology: Any, seg_lens: SegLensArg, causal: bool,
        dropout: float, window: int | None = None, deterministic: bool | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.topology = Topology(topology)
        self.seg_lens = validate_seg_lens(seg_lens, self.topology.num_segments)
        self.causal = check_flag("causal", causal)
        self.dropout = check_dropout(dropout)
        self.window = check_window(window)
        self.deterministic = check_deterministic(deterministic)

    @property
    def seq_len(self) -> int:
        return sum(self.seg_lens)

    def _check_input_dtype(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """The input must have the weights' dtype, one the kernels take (autocast casts both itself)."""
        if torch.is_autocast_enabled(x.device.type):
            return
        if weight.dtype not in SUPPORTED_DTYPES and x.dtype == weight.dtype:
            raise TypeError(f"the module's weights and the input are {x.dtype}; the kernels take float16, bfloat16 "
                            "or float32: cast both (module.float(), x.float())"
                            + (FLOAT64_HINT if x.dtype == torch.float64 else ""))
        if x.dtype != weight.dtype:
            fixes = ([f"the module (module.to({x.dtype}))"] if x.dtype in SUPPORTED_DTYPES else []) + (
                [f"the input (x.to({weight.dtype}))"] if weight.dtype in SUPPORTED_DTYPES else [])
            fix = " or ".join(fixes) if fixes else "both to float16, bfloat16 or float32"
            raise TypeError(f"the input has dtype {x.dtype} but the module's weights are {weight.dtype}: cast {fix}")

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: SegLensArg | PreparedMask | None,
        causal: bool,
    ) -> torch.Tensor:
        """q: ``[B, S, Hq*D]``, k, v: ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``."""
        s = q.shape[1]
        if seg_lens is None:
            if s != self.seq_len:
                raise ValueError(
                    f"the input has {s} positions but seg_lens {self.seg_lens} sum to {self.seq_len}; "
                    "pass seg_lens for this call (per-sample [B, k] rows may sum to less, the rest is padding)"
                )
            seg_lens = self.seg_lens
        q = rearrange(q, "b s (h d) -> b h s d", d=self.head_dim)
        k = rearrange(k, "b s (h d) -> b h s d", d=self.head_dim)
        v = rearrange(v, "b s (h d) -> b h s d", d=self.head_dim)
        out = self.attention(q, k, v, seg_lens, causal)
        return rearrange(out, "b h s d -> b s (h d)")

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: SegLensArg | PreparedMask, causal: bool
    ) -> torch.Tensor:
        """The attention step alone: q ``[B, Hq, S, D]``, k, v ``[B, Hkv, S, D]`` -> ``[B, Hq, S, D]``.

        A subclass may override it (the training example swaps in dense masked SDPA, keeping the weights).
        """
        dropout_p = self.dropout if self.training else 0.0
        return mbs_attention(q, k, v, self.topology, seg_lens, causal=causal, dropout_p=dropout_p,
                             window=self.window, deterministic=self.deterministic)

    def _window_repr(self) -> str:
        """The optional settings, as extra_repr shows them (only those set)."""
        return ("" if self.window is None else f", window={self.window}") + (
            "" if self.deterministic is None else f", deterministic={self.deterministic}")


class MultimodalSelfAttention(_MBSAttentionCore):
    """Multi-head self-attention over a multimodal sequence with a segment topology (block-sparse kernels).

    Args:
        embed_dim: E, the model width; ``E / num_heads`` is the head dim (a multiple of 8 in [16, 256]).
        num_heads: query heads.
        topology: k x k pair types: ``topology[r][c]`` says how the queries of segment r see the keys of
            segment c: ``NONE`` (0, not at all), ``FULL`` (1, every key) or ``CAUSAL`` (2, the keys at or before
            the query's position). Any number of segments (up to 4095); nested lists/tuples, a tensor or a
            :class:`~mmsparse.Topology`.
        seg_lens: k segment lengths, the default layout of the sequence (S = sum(seg_lens)).
        num_kv_heads: key/value heads for GQA/MQA (divides num_heads); default num_heads.
        causal: also require key position <= query position.
        dropout: attention dropout probability, applied in training mode.
        bias: bias in the q/k/v and output projections.
        window: a sliding window: keys at positions greater than the query's minus ``window`` only (as in
            :func:`mmsparse.mbs_attention`); None (default) for none.
        deterministic: the backward, as in :func:`mmsparse.mbs_attention`: True (bitwise
            repeatable), False (one pass, dQ by atomic adds) or None (default: ``use_config``'s, True unless set).

    ``forward(x, seg_lens=None)``: x ``[B, S, E]`` -> ``[B, S, E]``. ``seg_lens`` overrides the default for one call:
    k lengths summing to S, or per-sample ``[B, k]`` rows summing to at most S (the tail of a row is padding; its
    outputs are the output projection's bias), or a :class:`~mmsparse.PreparedMask` of the layer's topology,
    ``causal`` and ``window`` (:func:`mmsparse.prepare_mask`: one mask for every layer of a step).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        topology: Any,
        seg_lens: SegLensArg,
        num_kv_heads: int | None = None,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window: int | None = None,
        deterministic: bool | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = _check_positive_int("embed_dim", embed_dim)
        num_heads = _check_positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else _check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = _check_head_dim(embed_dim, num_heads)
        self._init_core(num_heads, num_kv_heads, head_dim, topology, seg_lens, causal, dropout, window, deterministic)
        kv_dim = num_kv_heads * head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor, seg_lens: SegLensArg | PreparedMask | None = None) -> torch.Tensor:
        """x: ``[B, S, E]`` -> ``[B, S, E]``; seg_lens: optional lengths for this call (see the class docstring)."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"expected input [batch, seq, {self.embed_dim}]; got shape {tuple(x.shape)}")
        self._check_input_dtype(x, self.q_proj.weight)
        out = self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), seg_lens, self.causal)
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, topology={self.topology.types.tolist()}, seg_lens={self.seg_lens}, "
            f"causal={self.causal}, dropout={self.dropout}{self._window_repr()}"
        )


class MultiheadMBSAttention(_MBSAttentionCore):
    """mmsparse self-attention that takes over an ``nn.MultiheadAttention``'s parameters (shared, not copied).

    It keeps the MHA's call signature and parameter names (``in_proj_weight``, ``in_proj_bias``, ``out_proj``), so
    ``state_dict`` keys are unchanged. It does self-attention only (``query``, ``key`` and ``value`` must be the same
    tensor); the mask comes from the topology. ``key_padding_mask`` (``[batch, seq]``: bool, True = padding, or
    float of 0 and -inf, as torch's encoder layers pass it) may mark right padding; padded queries then output the
    output projection's bias. ``attn_mask`` is accepted only together with
    ``is_causal=True`` (it is then taken to be the causal mask). Attention weights are not computed: the second
    output is None.

    Args:
        mha: the module to take over; self-attention shaped (``kdim == vdim == embed_dim``), head dim a multiple of 8
            in [16, 256].
        topology: k x k pair types ``NONE``/``FULL``/``CAUSAL`` (0/1/2), any number of segments, or a
            :class:`~mmsparse.Topology` (see :class:`MultimodalSelfAttention`).
        seg_lens: k segment lengths summing to the sequence length.
        causal: also require key position <= query position (``is_causal=True`` at call time does the same).
        dropout: attention dropout in training mode; default the MHA's own ``dropout``.
        window: a sliding window, as in :func:`mmsparse.mbs_attention`; None (default) for none.
        deterministic: the backward, as in :func:`mmsparse.mbs_attention` (False: one pass, dQ by atomic adds;
            None: ``use_config``'s default).
    """

    # nn.TransformerEncoderLayer (and nn.TransformerEncoder) run a fused C++ fast path in eval mode that reads the
    # MHA's weights directly and would bypass this forward. They skip it when this attribute is False.
    _qkv_same_embed_dim = False

    def __init__(
        self, mha: nn.MultiheadAttention, topology: Any, seg_lens: SegLensArg, causal: bool = False,
        dropout: float | None = None, window: int | None = None, deterministic: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"expected an nn.MultiheadAttention; got {type(mha).__name__}")
        if not mha._qkv_same_embed_dim:
            raise ValueError("only self-attention MHA (kdim == vdim == embed_dim) can be replaced")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("MHA with add_bias_kv or add_zero_attn is not supported")
        head_dim = _check_head_dim(mha.embed_dim, mha.num_heads)
        self._init_core(mha.num_heads, mha.num_heads, head_dim, topology, seg_lens, causal,
                        mha.dropout if dropout is None else dropout, window, deterministic)
        self.embed_dim = mha.embed_dim
        self.batch_first = mha.batch_first
        self.in_proj_weight = mha.in_proj_weight
        self.in_proj_bias = mha.in_proj_bias
        self.out_proj = mha.out_proj
        self.train(mha.training)  # a model already in eval mode stays there (no attention dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """query = key = value: ``[B, S, E]`` if batch_first else ``[S, B, E]``. Returns ``(output, None)``."""
        if key is not query or value is not query:
            raise ValueError("MultiheadMBSAttention does self-attention only: pass one tensor as query, key and value")
        if attn_mask is not None and not is_causal:
            raise ValueError(
                "an attn_mask cannot be combined with the topology; describe the mask with topology/seg_lens "
                "(and causal=True), or pass attn_mask with is_causal=True if it is the causal mask"
            )
        x = query if self.batch_first else query.transpose(0, 1)
        if x.dim() != 3:
            raise ValueError(f"expected a batched 3-D input; got shape {tuple(query.shape)}")
        seg_lens = None
        if key_padding_mask is not None:
            if x.shape[1] != self.seq_len:
                raise ValueError(
                    f"the input has {x.shape[1]} positions but seg_lens {self.seg_lens} sum to {self.seq_len}"
                )
            seg_lens = clip_seg_lens(self.seg_lens, valid_lens_from_padding(_kept_keys(key_padding_mask, x)))
        self._check_input_dtype(x, self.in_proj_weight)
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        out = self.out_proj(self._attend(q, k, v, seg_lens, self.causal or is_causal))
        return (out if self.batch_first else out.transpose(0, 1)), None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, "
            f"topology={self.topology.types.tolist()}, seg_lens={self.seg_lens}, causal={self.causal}, "
            f"dropout={self.dropout}{self._window_repr()}"
        )


def _kept_keys(key_padding_mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """bool ``[B, S]``, True for a real token, from an MHA ``key_padding_mask`` for the batch-first input ``x``: bool
    (True = padding), or float as torch adds it to the scores, of 0 (attend) and -inf (padding) only."""
    expected = (x.shape[0], x.shape[1])
    if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != expected:
        shape = tuple(key_padding_mask.shape) if isinstance(key_padding_mask, torch.Tensor) else key_padding_mask
        raise ValueError(f"key_padding_mask must be [batch, seq] = {list(expected)} (True = padding); got {shape}")
    if key_padding_mask.dtype == torch.bool:
        return ~key_padding_mask
    if not key_padding_mask.is_floating_point():
        raise TypeError(f"key_padding_mask must be bool (True = padding) or float (0 or -inf, added to the scores); "
                        f"got {key_padding_mask.dtype}")
    keep = key_padding_mask == 0
    if not bool((keep | (key_padding_mask == float("-inf"))).all()):
        raise ValueError("a float key_padding_mask is added to the scores: mmsparse takes one of 0 (attend) and -inf "
                         "(padding) only; pass a bool mask (True = padding)")
    return keep


def _is_cross_attention(parent: nn.Module, attr: str) -> bool:
    return isinstance(parent, nn.TransformerDecoderLayer) and attr == "multihead_attn"


def replace_attention(
    model: nn.Module,
    topology: Any,
    seg_lens: SegLensArg,
    causal: bool = False,
    dropout: float | None = None,
    include: Callable[[str, nn.MultiheadAttention], bool] | None = None,
    window: int | None = None,
    deterministic: bool | None = None,
) -> list[str]:
    """Swap the ``nn.MultiheadAttention`` self-attention modules of a model for mmsparse, in place, keeping weights.

    Every ``nn.MultiheadAttention`` in the model (``model`` itself excluded) is replaced by a
    :class:`MultiheadMBSAttention` that shares its parameters, except the cross-attention of
    ``nn.TransformerDecoderLayer`` (``multihead_attn``). Covers ``nn.TransformerEncoderLayer``/``nn.TransformerEncoder``
    (``batch_first`` True or False) and custom blocks that call an MHA as ``mha(x, x, x)``.

    Args:
        model: the model to change.
        topology: k x k pair types ``NONE``/``FULL``/``CAUSAL`` (0/1/2), any number of segments, or a
            :class:`~mmsparse.Topology` (see :class:`MultimodalSelfAttention`).
        seg_lens: k segment lengths summing to the sequence length.
        causal: also require key position <= query position.
        dropout: attention dropout in training mode; default each MHA's own.
        include: optional ``include(name, mha) -> bool`` choosing which modules to replace (name as in
            ``model.named_modules()``).
        window: a sliding window, as in :func:`mmsparse.mbs_attention`; None (default) for none.
        deterministic: the backward of the new modules, as in :func:`mmsparse.mbs_attention`.

    Returns:
        The names of the replaced modules. Raises ValueError when there is none.
    """
    Topology(topology)  # validate once, up front, before changing anything
    check_window(window)
    check_deterministic(deterministic)
    targets = []
    for name, parent in model.named_modules():
        for attr, child in parent.named_children():
            full = f"{name}.{attr}" if name else attr
            if isinstance(child, nn.MultiheadAttention) and not _is_cross_attention(parent, attr):
                if include is None or include(full, child):
                    targets.append((parent, attr, full, child))
    if not targets:
        raise ValueError(
            f"no nn.MultiheadAttention self-attention found in {type(model).__name__}; for a custom block that calls "
            "F.scaled_dot_product_attention, call mmsparse.mbs_attention there instead (same q/k/v layout)"
        )
    new = [MultiheadMBSAttention(child, topology, seg_lens, causal, dropout, window, deterministic)
           for _, _, _, child in targets]
    for (parent, attr, _, _), module in zip(targets, new):
        setattr(parent, attr, module)
    return [full for _, _, full, _ in targets]
