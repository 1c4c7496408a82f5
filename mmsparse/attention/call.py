"""One call's launches, planned once: when its forward first runs with a mask, shapes, strides, dtype, scale,
dropout, determinism and tiles, the config's plan (which kernel and tile each pass runs), the block lists the
forward reads and the forward's launch; at its first backward, the backward's lists and launch. The mask keeps the
launches of its last calls (``kernel_args(info).calls``), so a repeated call plans and builds nothing, and a
backward reads what its forward planned instead of working it out again.
"""

from __future__ import annotations

import torch

from ..mask.info import MaskInfo
from .backward import BackwardLaunch
from .config import KernelConfig, kernel_config
from .forward import ForwardLaunch
from .kernel_args import kernel_args
from .plan import AttentionPlan, plan_attention


class CallLaunch:
    """The plan and launches of one kind of call over one mask. It does not hold the mask (the mask holds it):
    the backward is given the mask again."""

    __slots__ = ("cfg", "plan", "forward", "_backward", "_softmax_scale", "_dropout_p")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, cfg: KernelConfig,
                 softmax_scale: float, dropout_p: float, deterministic: bool) -> None:
        batch, num_heads, seq_q, head_dim = q.shape
        self.cfg = cfg
        self.plan: AttentionPlan = plan_attention(cfg, batch, num_heads, k.shape[1], seq_q, info.seq_k, q.device,
                                                  info.sample_len, dropout_p > 0.0, deterministic=deterministic)
        self.plan.check_head_dim(head_dim, q.element_size())
        info.prepare(self.plan.list_tiles(backward=False), cfg.compact_bytes)  # on the current stream, first
        self.forward = ForwardLaunch(q, k, v, info, cfg, self.plan.forward, softmax_scale, dropout_p)
        self._backward: BackwardLaunch | None = None
        self._softmax_scale, self._dropout_p = softmax_scale, dropout_p

    def backward(self, info: MaskInfo, q: torch.Tensor, k: torch.Tensor) -> BackwardLaunch:
        """The backward's launch, made (its lists built, on the current stream) at the call's first backward:
        a call that never runs one builds none of it."""
        launch = self._backward
        if launch is None:
            launch = self._backward = BackwardLaunch(q, k, info, self.cfg, self.plan, self._softmax_scale,
                                                     self._dropout_p)
        return launch


def call_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float,
                dropout_p: float, seed: torch.Tensor | None, deterministic: bool, config: KernelConfig) -> CallLaunch:
    """The :class:`CallLaunch` of these arguments (q, k, v laid out by ``forward.kernel_layout``), made on first
    use and kept on the mask."""
    # id(config): the launch holds the config, so the id stays its own while the launch is kept. The seed's
    # alignment: a launch specialises on it (pieces of a context-parallel call take rows of one seed tensor).
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, softmax_scale, dropout_p,
           None if seed is None else seed.data_ptr() & 15, deterministic, id(config))
    calls = kernel_args(info).calls
    launch = calls.get(key)
    if launch is None:
        launch = calls.store(key, CallLaunch(q, k, v, info, config, softmax_scale, dropout_p, deterministic))
    return launch


def mbs_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float = 0.0,
    seed: torch.Tensor | None = None, config: KernelConfig | None = None, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward alone, for tools and tests: ``(out [B, Hq, Sq, D], lse [B, Hq, Sq] float32, log2 units)``.

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]``; last dim contiguous (``forward.kernel_layout``).
        info: the mask; softmax_scale: multiplies q.k.
        dropout_p, seed: dropout probability and the int64 ``[3]`` seed (key, query and key position offsets).
        config: the call's tiles and thresholds (None: :func:`kernel_config` of this thread's settings now).
        deterministic: the backward the call plans (a later :func:`mbs_attn_bwd` with the same arguments reads it).
    """
    cfg = kernel_config(q.shape[-1], q.dtype, q.device) if config is None else config
    launch = call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, cfg)
    return launch.forward(q, k, v, seed)


def mbs_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    info: MaskInfo, softmax_scale: float, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
    deterministic: bool = True, config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward alone, for tools and tests: ``(dq, dk, dv)`` of a forward with the same arguments (``do``:
    ``[B, Hq, Sq, D]`` contiguous); ``deterministic`` False allows the one-pass backward (dQ by atomic adds)."""
    cfg = kernel_config(q.shape[-1], q.dtype, q.device) if config is None else config
    launch = call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, cfg)
    return launch.backward(info, q, k)(do, q, k, v, out, lse, seed)
