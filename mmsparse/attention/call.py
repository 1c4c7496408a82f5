"""One call's plan and launches, made once.

In eager, when a call's forward first runs with a mask, shapes, strides, dtype, scale, dropout, determinism and
tiles: the config's plan (which kernel and tile each pass runs, :mod:`.plan`), the block lists the forward reads
and the forward's launch; at its first backward, the backward's lists and launch. The mask keeps the launches of
its last calls (``kernel_args(info).calls``), so a repeated call plans and builds nothing, and a backward reads
what its forward planned instead of working it out again. The launches themselves (grids, constexprs, bound
launchers) are kept for the process by frozen plan, shapes, strides and the mask's integers
(:func:`forward_launch_of`, :func:`backward_launch_of`): a call with new lengths every step builds its mask's lists
and finds its launches made.

Traced (``torch.compile``, ``torch.export``), the call's frozen plan (:class:`.plan.CallPlan`) is made when the
graph is traced and crosses the custom ops by value; the ops find their launches by that plan and the shapes
(:func:`forward_launch_of`, :func:`backward_launch_of`), kept for the process, and read the mask's tensors and
lists from their arguments.
"""

from __future__ import annotations

import torch

from ..mask.add_order import mask_adds_longest_first
from ..mask.info import MaskInfo
from ..runtime.recent import RecentlyUsed
from .backward import BackwardLaunch, ExchangeHooks
from .config import KernelConfig, kernel_config
from .forward import ForwardLaunch
from .kernel_args import LaunchArgs, kernel_args
from .plan import AttentionPlan, CallPlan, attention_plan_of, call_plan_from_text, check_passes, plan_attention


def frozen_plan(plan: AttentionPlan, info: MaskInfo, cfg: KernelConfig, dropout: bool) -> CallPlan:
    """The :class:`CallPlan` of an eager call's plan."""
    return CallPlan(forward=plan.forward.tile, dq=plan.dq, dkdv=plan.dkdv, side_stream=plan.side_stream,
                    mode=info.mode, causal=info.causal, window=info.window,
                    num_segments=info.num_segments, dropout=dropout, use_tma=cfg.use_tma,
                    compact_bytes=cfg.compact_bytes,
                    decode_max_q=cfg.decode_max_q)


class CallLaunch:
    """The plan of one kind of call over one mask, its list arguments, and its launches (shared with every mask
    alike: :func:`forward_launch_of`, :func:`backward_launch_of`). It does not hold the mask (the mask holds it):
    the backward is given the mask again."""

    __slots__ = ("cfg", "plan", "call_plan", "forward", "_forward_mask", "_backward", "_scalars")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, cfg: KernelConfig,
                 softmax_scale: float, dropout_p: float, seed: torch.Tensor | None, deterministic: bool) -> None:
        batch, num_heads, seq_q, head_dim = q.shape
        self.cfg = cfg
        self.plan: AttentionPlan = plan_attention(cfg, batch, num_heads, k.shape[1], seq_q, info.seq_k, q.device,
                                                  info.sample_len, dropout_p > 0.0, deterministic=deterministic,
                                                  longest_first=mask_adds_longest_first(info))
        self.plan.check_head_dim(head_dim, q.element_size())
        self.call_plan = frozen_plan(self.plan, info, cfg, dropout_p > 0.0)
        self._scalars = (softmax_scale, dropout_p)
        info.prepare(self.plan.list_tiles(backward=False), cfg.compact_bytes)  # on the current stream, first
        self._forward_mask = kernel_args(info).tile(*self.plan.forward.lists)
        self.forward = forward_launch_of(self.call_plan, q, k, v, softmax_scale, dropout_p, seed, self._forward_mask,
                                         self.plan)
        self._backward: BackwardLaunch | None = None

    def run_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of the call's q, k, v (laid out by ``layouts.kernel_layout``) and seed."""
        return self.forward(q, k, v, seed, self._forward_mask)

    def run_backward(self, info: MaskInfo, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, seed: torch.Tensor | None,
                     hooks: ExchangeHooks | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)``: the backward's launch is made (its lists built, on the current stream) at the call's
        first backward: a call that never runs one builds none of it. ``hooks``: as
        :meth:`BackwardLaunch.__call__`'s."""
        plan, args, first = self.plan, kernel_args(info), self._backward is None
        if first:
            info.prepare(plan.list_tiles(forward=False), self.cfg.compact_bytes)  # before any fork
        masks = (args.tile(*plan.dkdv.lists), args.tile(*plan.dq.lists) if plan.dq is not None else None)
        if first:
            self._backward = backward_launch_of(self.call_plan, q, k, v, *self._scalars, seed, masks)
        return self._backward(do, q, k, v, out, lse, seed, *masks, hooks)


def call_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float,
                dropout_p: float, seed: torch.Tensor | None, deterministic: bool, config: KernelConfig) -> CallLaunch:
    """The :class:`CallLaunch` of these arguments (q, k, v laid out by ``layouts.kernel_layout``), made on first
    use and kept on the mask."""
    # id(config): the launch holds the config, so the id stays its own while the launch is kept. The seed's
    # alignment: a launch specialises on it (pieces of a context-parallel call take rows of one seed tensor).
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, softmax_scale, dropout_p,
           None if seed is None else seed.data_ptr() & 15, deterministic, id(config))
    calls = kernel_args(info).calls
    launch = calls.get(key)
    if launch is None:
        launch = calls.store(key, CallLaunch(q, k, v, info, config, softmax_scale, dropout_p, seed, deterministic))
    return launch


# The launches, by frozen plan, shapes, strides, the mask's integers and every tensor's alignment: what a launch
# specialises on. Shared by every mask alike (eager calls with new lengths) and by the custom ops. Host objects only
# (no tensor of any call).
MAX_OP_LAUNCHES = 256
_FORWARD: RecentlyUsed[ForwardLaunch] = RecentlyUsed(MAX_OP_LAUNCHES)
_BACKWARD: RecentlyUsed[BackwardLaunch] = RecentlyUsed(MAX_OP_LAUNCHES)


def clear_op_launches() -> None:
    """Forget the kept launches and the per-shape plans they were made from (``clear_caches``)."""
    _FORWARD.clear()
    _BACKWARD.clear()
    attention_plan_of.cache_clear()


def _mask_key(mask: LaunchArgs) -> tuple:
    """What a launch specialises on in a call's mask arguments: their integers, and each tensor's dtype and
    16-byte alignment (a mask's query codes may be a view at any offset)."""
    tensors, scalars = mask
    return (*[(t.dtype, t.data_ptr() & 15) for t in tensors],
            *[s if isinstance(s, int) else (s.dtype, s.data_ptr() & 15) for s in scalars])


def _op_plan(plan: CallPlan, q: torch.Tensor, k: torch.Tensor) -> AttentionPlan:
    batch, num_heads, seq_q, head_dim = q.shape
    aplan = attention_plan_of(plan, batch, num_heads, k.shape[1], seq_q, k.shape[2], q.device)
    aplan.check_head_dim(head_dim, q.element_size())
    return aplan


def forward_launch_of(plan: str | CallPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                      dropout_p: float, seed: torch.Tensor | None, mask: LaunchArgs,
                      shaped: AttentionPlan | None = None) -> ForwardLaunch:
    """The forward launch of a frozen plan (its text, as the custom ops carry it, or the plan) at these arguments
    (q, k, v laid out by ``layouts.kernel_layout``; ``mask``: the forward tile's mask arguments), made on first use
    and kept. ``shaped``: the plan at these shapes, where the caller has it (else worked out on a miss)."""
    key = (plan, q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, softmax_scale, dropout_p,
           None if seed is None else seed.data_ptr() & 15, _mask_key(mask))
    launch = _FORWARD.get(key)
    if launch is None:
        frozen = call_plan_from_text(plan) if isinstance(plan, str) else plan
        forward = (_op_plan(frozen, q, k) if shaped is None else shaped).forward
        launch = _FORWARD.store(key, ForwardLaunch(q, k, v, frozen, forward, softmax_scale, dropout_p))
    return launch


def backward_launch_of(plan: str | CallPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       softmax_scale: float, dropout_p: float, seed: torch.Tensor | None,
                       masks: tuple[LaunchArgs, LaunchArgs | None]) -> BackwardLaunch:
    """The backward launch of a frozen plan (its text or the plan) at these arguments (``masks``: the dK/dV and dQ
    tiles' mask arguments), made on first use and kept. Its relaunches are kept per layout of q, k and v inside
    it."""
    key = (plan, q.shape, k.shape, q.dtype, q.device, softmax_scale, dropout_p,
           None if seed is None else seed.data_ptr() & 15, *(None if m is None else _mask_key(m) for m in masks))
    launch = _BACKWARD.get(key)
    if launch is None:
        frozen = call_plan_from_text(plan) if isinstance(plan, str) else plan
        check_passes((("dq", frozen.dq), ("dkdv", frozen.dkdv)), q.shape[-1], q.element_size())
        # the frozen plan holds every backward pass: the forward's grid is not needed
        launch = _BACKWARD.store(key, BackwardLaunch(q, k, frozen, frozen, softmax_scale, dropout_p))
    return launch


def mbs_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float = 0.0,
    seed: torch.Tensor | None = None, config: KernelConfig | None = None, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward alone, for tools and tests: ``(out [B, Hq, Sq, D], lse [B, Hq, Sq] float32, log2 units)``.

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]``; last dim contiguous (``layouts.kernel_layout``).
        info: the mask; softmax_scale: multiplies q.k.
        dropout_p, seed: dropout probability and the int64 ``[3]`` seed (key, query and key position offsets).
        config: the call's tiles and thresholds (None: :func:`kernel_config` of this thread's settings now).
        deterministic: the backward the call plans (a later :func:`mbs_attn_bwd` with the same arguments reads it).
    """
    cfg = kernel_config(q.shape[-1], q.dtype, q.device) if config is None else config
    launch = call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, cfg)
    return launch.run_forward(q, k, v, seed)


def mbs_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    info: MaskInfo, softmax_scale: float, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
    deterministic: bool = True, config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward alone, for tools and tests: ``(dq, dk, dv)`` of a forward with the same arguments (``do``:
    ``[B, Hq, Sq, D]`` contiguous); ``deterministic`` False allows the one-pass backward (dQ by atomic adds)."""
    cfg = kernel_config(q.shape[-1], q.dtype, q.device) if config is None else config
    launch = call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, cfg)
    return launch.run_backward(info, do, q, k, v, out, lse, seed)
