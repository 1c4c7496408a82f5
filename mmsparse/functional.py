"""The public functional API: :func:`mbs_attention` and :func:`mbs_attention_varlen` check the arguments
(:mod:`mmsparse.checks`), build or fetch the mask (:mod:`mmsparse.mask.build`), then run the autograd Function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .attention.autograd import MBSAttentionFunction
from .attention.call import clear_op_launches
from .attention.config import current_settings
from .attention.dropout import new_dropout_seed
from .attention.plan import plan_attention
from .attention.resolved import clear_resolved_ops
from .checks import (
    check_deterministic,
    check_dropout,
    check_flag,
    check_qkv,
    check_softmax_scale,
    check_window,
)
from .mask.build import build_mask_info, dense_mask_info, topology_mask
from .mask.cache import CACHE
from .mask.info import MaskInfo
from .mask.kept import clear_kept
from .mask.lengths import SegLensArg
from .mask.prepared import PreparedMask
from .runtime.scratch import clear_scratch


def clear_caches() -> None:
    """Forget every mask, topology, first-query position and launch plan the package keeps between calls, and the
    scratch memory of device-side descriptors: their device memory goes back to torch's allocator. Modules keep
    their own masks (``TritonMBSAttnKernel``); those go with the module. Call it after the last use of the masks,
    e.g. between phases with different lengths, or to measure a cold start."""
    CACHE.clear()
    clear_kept()
    plan_attention.cache_clear()
    clear_op_launches()
    clear_resolved_ops()
    clear_scratch()


def attention_with_info(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float | None,
    dropout_p: float, deterministic: bool | None = None,
) -> torch.Tensor:
    """Run the kernels on checked inputs with prepared metadata (used by the module and the functional API).
    ``deterministic``: the backward (None: ``use_config``'s). This thread's ``use_config`` settings are read here,
    once, and the backward runs with them."""
    dropout_p = check_dropout(dropout_p, "dropout_p")
    scale = check_softmax_scale(softmax_scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    deterministic = check_deterministic(deterministic)
    settings = current_settings()
    deterministic = settings.deterministic if deterministic is None else deterministic
    if q.numel() == 0 or k.shape[2] == 0:
        # Nothing to attend (Sq <= Sk, so the output is empty): zeros tied to q, k and v alike, whose gradients
        # are then zeros of their shapes rather than absent (autograd.grad refuses an input not in the graph).
        return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())
    seed = new_dropout_seed(q.device) if dropout_p > 0 else None
    return MBSAttentionFunction.apply(q, k, v, info, scale, dropout_p, seed, deterministic, settings)


def mbs_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topology: Any = None,
    seg_lens: SegLensArg | PreparedMask | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    check_lengths: bool = True,
    q_start: torch.Tensor | Sequence[int] | None = None,
    window: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Block-sparse multimodal attention.

    Args:
        q: ``[B, Hq, Sq, D]``; the queries are the last Sq of the S key positions.
        k, v: ``[B, Hkv, S, D]``, Hq a multiple of Hkv; fp16, bf16 or fp32; D a multiple of 8 in [16, 256].
        topology: k x k pair types: ``topology[r][c]`` says how the queries of segment r see the keys of
            segment c: ``NONE`` (0, not at all), ``FULL`` (1, every key) or ``CAUSAL`` (2, the keys at or before
            the query's position). Any number of segments (up to 4095); nested lists/tuples, a tensor or a
            :class:`~mmsparse.Topology` (build one once for hundreds of segments). Give either a topology with
            seg_lens, or attn_mask.
        seg_lens: k lengths summing to S, or per-sample ``[B, k]`` (list of B tuples or an int tensor, on the CPU
            or q's device), each row summing to at most S; the rest of a row is padding (never attended; its
            queries output 0). A generator is read once; anything else (one int, a string) is a TypeError. Or a
            :class:`~mmsparse.PreparedMask` (:func:`mmsparse.prepare_mask`): a mask built once for the calls
            that pass it, e.g. every layer of a step over the same device lengths.
        causal: also require key position <= query position.
        dropout_p: attention dropout probability (pass 0.0 in eval mode).
        softmax_scale: default ``1/sqrt(D)``; a finite number of at least 1e-30.
        attn_mask: a bool mask (True = may attend) *instead of* a topology: ``[Sq, S]`` (or ``[S, S]``),
            ``[B, Sq, S]`` or SDPA's ``[B, 1, Sq, S]``, B being 1 or the batch; a query dim of 1 broadcasts.
            Per-head masks and additive float masks are not supported.
        check_lengths: validate a device tensor of lengths (reads it back: a host sync). Pass False in a
            training loop that feeds device lengths every step; nothing is checked under torch.compile or
            CUDA-graph capture either.
        q_start: optional int ``[B]``: the position of each sample's first query, e.g. each cache's length
            when decoding over caches of different lengths (default: the last Sq positions, ``S - Sq``).
        window: a sliding window: a key is kept only when its position is past the query's minus ``window``
            (None: no window).
        deterministic: the backward. True: bitwise repeatable: two passes (dK/dV, then dQ), or where the one
            pass below runs, over packs of samples of at most ``ordered_samples`` tokens on average (1,024) and over
            bit masks without the causal flag from ``short_keys`` keys (2,048), that pass with its dQ adds in a
            fixed order (``KernelConfig.ordered_dq_writer``: everywhere). False: allows one
            pass that adds dQ into a float32 ``[B, Hq, Sq, D]`` buffer by atomic adds (5 matmuls per tile pair
            instead of 7; dQ's last bits vary from run to run), run where it was measured faster: at every length
            at head dims 40-128 on Hopper in half precision without dropout (the dQ-writer kernel,
            ``dq_writer_max_keys``), never at head dims 129-256 there (the two passes were faster), elsewhere below
            ``one_pass_max_keys`` keys (2048); longer calls keep the two passes. None (default):
            ``mmsparse.use_config(deterministic=...)``'s setting, True unless changed; an argument given here wins.

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype.
    """
    check_qkv(q, k, v)
    seq_q, seq_k = q.shape[2], k.shape[2]
    if attn_mask is not None:
        if topology is not None or seg_lens is not None:
            raise ValueError(
                "pass either a topology with seg_lens, or attn_mask, not both: attn_mask replaces the topology"
            )
        if q_start is not None:
            raise ValueError("q_start goes with a topology; with attn_mask the mask's rows place the queries")
        info = dense_mask_info(attn_mask, q.shape[0], seq_q, seq_k, check_flag("causal", causal), q.device,
                           check_window(window, seq_k))
    elif topology is None:
        raise ValueError("mbs_attention needs a topology with seg_lens, or attn_mask (a bool [S, S] mask)")
    else:
        info = topology_mask(q, k, topology, seg_lens, causal, check_lengths, q_start, window)
    return attention_with_info(q, k, v, info, softmax_scale, dropout_p, deterministic)


def mbs_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topology: Any,
    seg_lens: SegLensArg | PreparedMask,
    causal: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    check_lengths: bool = True,
    window: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Packed ("varlen") batches: samples laid end to end along one sequence, no padding, any number of them.

    Sample n owns the next ``sum(seg_lens[n])`` positions; its tokens attend per the topology within the
    sample only, so the tiles between samples are skipped like any other empty tile.

    Args:
        q: ``[1, Hq, total, D]``, or flash-attn's ``[total, Hq, D]`` (used as a strided view, no copy);
            k, v: the same layout with Hkv heads.
        topology: k x k pair types (0/1/2) shared by the samples.
        seg_lens: ``[N, k]`` per-sample lengths (list of N rows or an int tensor, e.g. on the GPU), summing to
            ``total``; zero-length segments are fine. Or a :class:`~mmsparse.PreparedMask` prepared with
            ``packed=True``.
        causal: causal within each sample (positions are the packed ones, so this is per-sample causal).
        check_lengths: validate a device tensor of lengths (one host sync). Host lengths (lists) are validated
            once and the mask is cached by value, as in :func:`mbs_attention`; a tensor builds it every call.
        window: a sliding window, as in :func:`mbs_attention` (positions are the packed ones; samples never see
            each other anyway).
        deterministic: the backward, as in :func:`mbs_attention` (False: one pass, dQ by atomic adds).

    Returns:
        q's layout: ``[1, Hq, total, D]`` or ``[total, Hq, D]``.
    """
    flash_layout = q.dim() == 3
    if flash_layout:
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                f"q is [total, H, D] (flash-attn's packed layout) but k/v have shapes {tuple(k.shape)} and "
                f"{tuple(v.shape)}: give all three as [total, H, D], or all as [1, H, total, D]"
            )
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
    check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    if q.shape[0] != 1:
        raise ValueError(f"packed q/k/v have batch size 1 (samples laid end to end); got {q.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError("packed attention needs q and k/v over the same positions")
    total = k.shape[2]
    info = build_mask_info(topology, seg_lens, total, total, causal, q.device, check_lengths, packed=True,
                           window=window)
    out = attention_with_info(q, k, v, info, softmax_scale, dropout_p, deterministic)
    return out[0].permute(1, 0, 2) if flash_layout else out
