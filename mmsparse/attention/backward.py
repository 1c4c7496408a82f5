"""The backward passes' launcher: delta = rowsum(dO * O), then dQ and dK/dV, each as its Gluon kernel on Hopper
where the tile has one and as its tl kernel elsewhere, with the same numerics; or, with ``deterministic=False``,
the one-pass backward: the dK/dV kernel (Gluon or tl) also adds dQ into a float32 accumulator by atomics (the
ordered one-pass, for deterministic calls where the config asks for it: in the order of the key blocks on each dQ
tile, counted by an int32 semaphore per tile)."""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from types import ModuleType

import torch

from ..kernels.tl.backward import attention_delta_tl, attention_dkdv_tl, attention_dq_tl
from ..mask.blocks import cdiv
from ..mask.info import MaskInfo
from ..runtime.launch import FastKernel
from ..runtime.scratch import ensure_tma_allocator
from .config import KernelConfig, cuda_index, head_dim_pad, kernel_config
from .forward import _LOG2E, dot_mode
from .kernel_args import kernel_args
from .plan import plan_attention

_DELTA, _DKDV, _DQ = FastKernel(attention_delta_tl), FastKernel(attention_dkdv_tl), FastKernel(attention_dq_tl)


def mbs_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    info: MaskInfo,
    softmax_scale: float,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    deterministic: bool = True,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the three backward passes. On a GPU the dQ pass (over SHORT_KEYS keys or more) runs on a side
    stream, concurrently with dK/dV: both need only delta, and their programs fill each other's idle SM slots.
    Every block list either pass reads is built first, on the current stream, before the side stream waits for
    it: the two passes' lists share summaries (and, for self-attention, code runs), so a list built lazily on
    the side stream would be read by the dK/dV builder before it was written, and its memory would come from the
    side stream's pool while the mask that keeps it is used on the current one. The current stream waits for the
    side stream before returning, so callers, CUDA graphs and the caching allocator (whose blocks stay with the
    current stream) see one ordered stream.

    With ``deterministic`` False there is no dQ pass (nor side stream): the dK/dV kernel (the Gluon one where the
    plan has it, else the tl one) also adds dQ into a zeroed float32 ``[B, Hq, Sq, D]`` accumulator by atomics,
    cast to q's dtype at the end. The ordered one-pass backward (``deterministic`` with
    ``KernelConfig.deterministic_backward == "ordered_one_pass"``) runs the same kernel with the adds into each dQ
    tile ordered by key block (:mod:`mmsparse.mask.add_order`): the semaphores sit in the accumulator's allocation.

    Args:
        do: ``[B, Hq, Sq, D]`` contiguous; q, k, v as in the forward; out, lse: the forward's outputs.
        config: the forward's tiles and thresholds (None: :func:`kernel_config` of this thread's settings now).

    Returns:
        ``(dq, dk, dv)``, contiguous, in the inputs' dtypes; dk, dv are summed over each GQA group.
    """
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    cfg = kernel_config(head_dim, q.dtype, q.device) if config is None else config
    qk_scale = softmax_scale * _LOG2E
    seed = seed if seed is not None else lse
    has_window = info.window is not None
    flags = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, MASK_MODE=info.mode, IS_CAUSAL=info.causal,
                 HAS_WINDOW=has_window, HAS_DROPOUT=dropout_p > 0.0, DOT_MODE=dot_mode(q), USE_TMA=cfg.use_tma)
    if cfg.use_tma:
        ensure_tma_allocator(q.device)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])

    delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    n_rows = batch * num_heads * seq_q
    _DELTA[(cdiv(n_rows, 64),)](out, do, delta, n_rows, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BR=64)

    plan = plan_attention(cfg, batch, num_heads, num_kv_heads, seq_q, seq_k, q.device, info.sample_len,
                          dropout_p > 0.0, deterministic=deterministic)
    info.prepare(plan.list_tiles(forward=False), cfg.compact_bytes)  # on the current stream, before the fork
    args = kernel_args(info)
    dkdv_mask = args.tile(*plan.dkdv.lists)
    main, side = _streams(q.device) if plan.side_stream else (None, None)
    one_pass = plan.dq is None
    ordered = one_pass and plan.dkdv.ordered
    if one_pass:
        tile = plan.dkdv.tile
        # Per (batch, q head, query block) one semaphore; two in the Gluon kernel, one per warpgroup's columns.
        semaphores = batch * num_heads * cdiv(seq_q, tile.block_m) * (2 if plan.dkdv.gluon else 1) if ordered else 0
        dq_sum, dq_sem = _dq_accumulator(out.shape, q.device, semaphores)
        if ordered:
            dq_ranks = info.dq_add_ranks(tile.block_m, tile.block_n)  # on the current stream, before the launch
        else:
            _alert_not_deterministic()
    else:
        dq = torch.empty(out.shape, dtype=q.dtype, device=q.device)
        dq_mask = args.tile(*plan.dq.lists)
        if side is not None:
            side.wait_stream(main)  # delta, the block lists and the inputs are ready
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            tile = plan.dq.tile
            if plan.dq.gluon:
                _gluon().run_dq(q, k, v, do, lse, delta, dq, dq_mask, info.mode, info.causal, qk_scale,
                                softmax_scale, tile, has_window)
            else:
                mask_tensors, mask_scalars = dq_mask
                _DQ[(cdiv(seq_q, tile.block_m), batch * num_heads)](
                    q, k, v, do, lse, delta, dq, *mask_tensors, seed, *strides, *mask_scalars, qk_scale,
                    softmax_scale, dropout_p, NUM_HEADS=num_heads, GROUP=group, BM=tile.block_m, BN=tile.block_n,
                    **flags, num_warps=tile.num_warps, num_stages=tile.num_stages,
                )

    dk = torch.empty((batch, num_kv_heads, seq_k, head_dim), dtype=k.dtype, device=k.device)
    dv = torch.empty((batch, num_kv_heads, seq_k, head_dim), dtype=v.dtype, device=v.device)
    tile = plan.dkdv.tile
    if plan.dkdv.gluon:
        _gluon().run_dkdv(q, k, v, do, lse, delta, (dk, dv), dkdv_mask, info.mode, info.causal, qk_scale,
                          softmax_scale, tile, has_window, dq_sum if one_pass else None,
                          (dq_ranks, dq_sem) if ordered else None)
    else:
        mask_tensors, mask_scalars = dkdv_mask
        _DKDV[(cdiv(seq_k, tile.block_n), batch * num_kv_heads)](
            # DQ, DQ_RANKS, DQ_SEM: dk stands in, unread without ONE_PASS (and ORDERED)
            q, k, v, do, lse, delta, dk, dv, dq_sum if one_pass else dk, dq_ranks if ordered else dk,
            dq_sem if ordered else dk, *mask_tensors, seed, *strides, *mask_scalars, qk_scale, softmax_scale,
            dropout_p, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BM=tile.block_m,
            BN=tile.block_n, **flags, ONE_PASS=one_pass, ORDERED=ordered, num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
    if side is not None:
        main.wait_stream(side)
    if one_pass:
        dq = dq_sum if q.dtype == torch.float32 else dq_sum.to(q.dtype)
    return dq, dk, dv


def _dq_accumulator(shape: torch.Size, device: torch.device, semaphores: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-pass backward's zeroed float32 dQ accumulator (rows no tile reaches stay 0) and ``semaphores``
    zeroed int32 words after it: one allocation and one fill, which count in the backward's peak memory."""
    numel = math.prod(shape)
    buffer = torch.zeros(numel + semaphores, dtype=torch.float32, device=device)
    return buffer[:numel].view(shape), buffer[numel:].view(torch.int32)


def _alert_not_deterministic() -> None:
    """As torch's own ops without a deterministic kernel: under ``torch.use_deterministic_algorithms(True)`` the
    one-pass backward raises a RuntimeError (a warning with ``warn_only=True``)."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = ("mmsparse's one-pass backward (deterministic=False, or use_config(deterministic=False)) adds dQ with "
               "atomics and is not deterministic, but torch.use_deterministic_algorithms(True) is set: pass "
               "deterministic=True to the attention call or module for the bitwise repeatable two-pass backward")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        raise RuntimeError(message)


def _gluon() -> ModuleType:
    """The Gluon launchers (the plan chose a Gluon pass)."""
    from . import gluon_launch  # imports Gluon: reached only where dispatch.hopper_gluon_available said yes

    return gluon_launch


_side_streams = threading.local()  # .by_device: {device index: this thread's side stream}


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(current stream, this thread's side stream of the device for the dQ pass). One per thread: a stream shared
    by threads would let one thread's dQ pass join another's CUDA-graph capture, or wait on its unrelated work.
    The plan forks only on the GPU and over SHORT_KEYS keys or more: below, a call is bound by host work, and
    switching streams adds ~75 us to it (H100 host, the seed: 0.48 ms with the side stream, 0.41 without;
    docs/performance.md)."""
    index = cuda_index(device)
    streams = getattr(_side_streams, "by_device", None)
    if streams is None:
        streams = _side_streams.by_device = {}
    side = streams.get(index)
    if side is None:
        side = streams[index] = torch.cuda.Stream(device=index)
    return torch.cuda.current_stream(index), side
