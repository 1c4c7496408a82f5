"""The op boundary: one forward and one backward, and the torch custom ops over them.

``torch.ops.mmsparse.lists_v9``, ``.fwd_v9`` and ``.bwd_v9`` (registered here, with fake implementations) make the
kernels opaque to torch.compile, so ``fullgraph=True`` traces through mmsparse without graph breaks. A traced call
plans once, when it is traced (:func:`mmsparse.attention.plan.plan_call`): its frozen plan crosses every op as its
text, by value (an exported program runs with its own plan in any process). Where the topology and lengths are host
values (``MaskInfo.host_values``), the forward and backward ops take no mask tensor: they read the kept mask of
those values, its tensors and block lists (:mod:`mmsparse.mask.kept`), so a repeated step builds nothing and the
graph makes no mask; otherwise the ops take the mask's tensors, made in the graph, and each tile's lists come from
one ``lists`` op, whose outputs the forward and the backward ops both read. The lists take fixed slots, sized from
the shapes (the packed layout's size is data: a graph cannot know it).

The ops' names carry the version of their signature (:data:`OP_VERSION`): Inductor's on-disk cache of compiled
graphs does not key on a custom op's schema, so a graph cached by an older mmsparse would call a changed op with its
old arguments. Eager calls run the launches directly (a call through the op dispatcher costs 25-35 us, which a small
host-bound call feels), planned once per call kind and kept on the mask (:mod:`.call`).
:class:`mmsparse.attention.autograd.MBSAttentionFunction` is the one autograd definition over both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..kernels.constants import COUNT_WORDS
from ..mask.blocks import cdiv
from ..mask.info import MaskInfo, TileKey, mask_from_kernel_tensors
from ..mask.kept import kept_mask
from .backward import ExchangeHooks
from .call import CallLaunch, backward_launch_of, call_launch, forward_launch_of
from .config import Settings, current_settings, kernel_config
from .kernel_args import LaunchArgs, kernel_args, traced_mask_args
from .layouts import kernel_layout, output_like, read_in_place
from .plan import CallPlan, call_plan_from_text, plan_call
from .resolved import ResolvedOp, keep_resolved, op_call_key, resolved_op

OP_VERSION = 9  # bump with any change to the ops' signatures or outputs' layouts (tests/api/test_compile.py pins them)


@dataclass
class TracedCall:
    """What a traced call's backward reads of its forward: the frozen plan (and its text), the mask's kernel
    tensors, the block lists built so far, by tile, and the mask's host values (``MaskInfo.host_values``: the ops
    then read the kept mask, :func:`_op_mask_args`, and take no mask tensor or list; empty for a length tensor)."""

    plan: CallPlan
    text: str
    mask: list[torch.Tensor]
    lists: dict[TileKey, tuple[torch.Tensor, torch.Tensor]]
    host_values: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, plan: CallPlan, info: MaskInfo) -> TracedCall:
        host_values = info.host_values or []
        # of host values, the ops read the kept mask: the graph's own mask tensors go unused, and the compiler
        # drops the ops that would make them
        return cls(plan, plan.text, [] if host_values else list(info.kernel_tensors()), {}, host_values)

    def tile_lists(self, keys: list[TileKey]) -> list[torch.Tensor]:
        """(counts, indices) of each tile in turn: those built before, and one ``lists`` op for each other tile (a
        traced backward may not change what its forward made: a dict of its own). Empty where the mask is of host
        values: the ops read kept lists."""
        if self.host_values:
            return []
        built = dict(self.lists)
        for key in keys:
            if key not in built:
                built[key] = _lists_op(self.mask, self.text, *key)
        return [t for key in keys for t in built[key]]


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float,
    seed: torch.Tensor | None, settings: Settings, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CallLaunch]:
    """(out, lse, the call's launches) of q, k, v in any layout (:func:`kernel_layout` copies only what the kernels
    cannot read). The config is read here, from ``settings``, once for the forward and its backward."""
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    config = kernel_config(q.shape[-1], q.dtype, q.device, settings)
    launch = call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, config)
    out, lse = launch.run_forward(q, k, v, seed)
    return out, lse, launch


def traced_plan(q: torch.Tensor, k: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float,
                deterministic: bool, settings: Settings) -> CallPlan:
    """The frozen plan of a traced call (its lengths may be symbols: see :func:`plan_call`)."""
    config = kernel_config(q.shape[-1], q.dtype, q.device, settings)
    # A graph may hold dropout_p as a symbol: a branch decides whether dropout is on (and guards on it) here
    dropout = True if dropout_p > 0.0 else False  # noqa: SIM210 (bool() would keep the symbol)
    return plan_call(config, info.seq_q, info.seq_k, q.device, info.sample_len, dropout, deterministic,
                     info.mode, info.causal, info.window, info.num_segments)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float,
    seed: torch.Tensor | None, settings: Settings | None = None, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CallLaunch | TracedCall]:
    """The forward: ``(out [B, Hq, Sq, D], lse [B, Hq, Sq] float32, log2 units, launch)``: ``launch`` is the call's
    plan and launches (traced: its frozen plan, mask tensors and lists), for :func:`attention_backward`.

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]``.
        info: the mask; softmax_scale: multiplies q.k; dropout_p, seed: dropout and its int64 ``[3]`` seed
            (``new_dropout_seed``).
        settings: ``use_config``'s, as read when the call began (None: this thread's now); the backward must
            get the same.
        deterministic: the backward the call plans (False: the one-pass backward, dQ by atomic adds).
    """
    settings = current_settings() if settings is None else settings
    if torch.compiler.is_compiling():  # traced: the kernels must be opaque ops on tensors
        plan = traced_plan(q, k, info, softmax_scale, dropout_p, deterministic, settings)
        call = TracedCall.of(plan, info)
        key = plan.list_tiles(backward=False)[0]
        lists = call.tile_lists([key])
        if lists:
            call.lists[key] = (lists[0], lists[1])
        out, lse = _fwd_op(q, k, v, call.mask, lists, seed, softmax_scale, dropout_p, call.text, call.host_values)
        return out, lse, call
    return _forward(q, k, v, info, softmax_scale, dropout_p, seed, settings, deterministic)


def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    info: MaskInfo, softmax_scale: float, dropout_p: float, seed: torch.Tensor | None, deterministic: bool = True,
    settings: Settings | None = None, launch: CallLaunch | TracedCall | None = None,
    hooks: ExchangeHooks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`attention_forward`: ``(dq, dk, dv)``, dk and dv summed over each GQA group.
    ``deterministic`` False: the one-pass backward (dQ by atomic adds, not bitwise repeatable). ``settings``: the
    forward's (None: this thread's now). ``launch``: the forward's (None: found again from the arguments, in eager;
    traced, planned again from them). ``hooks``: a context-parallel rank's exchange beside the backward
    (:class:`mmsparse.attention.backward.ExchangeHooks`); traced, its keys are waited for before the backward op and
    ``after_dkdv`` called after it."""
    settings = current_settings() if settings is None else settings
    if torch.compiler.is_compiling():  # traced: as in attention_forward
        call = launch if isinstance(launch, TracedCall) else None
        if call is None:
            call = TracedCall.of(traced_plan(q, k, info, softmax_scale, dropout_p, deterministic, settings), info)
        passes = [call.plan.dkdv] + ([call.plan.dq] if call.plan.dq is not None else [])
        lists = call.tile_lists([step.lists for step in passes])
        if hooks is not None and hooks.keys is not None:
            hooks.keys.wait()
        grads = _bwd_op(grad_out, q, k, v, out, lse, call.mask, lists, seed, softmax_scale, dropout_p, call.text,
                        call.host_values)
        if hooks is not None and hooks.after_dkdv is not None:
            hooks.after_dkdv(grads[1], grads[2])
        return grads
    if hooks is not None and hooks.keys is not None and not (read_in_place(k) and read_in_place(v)):
        hooks.keys.wait()  # the copy below reads every key
        hooks = replace(hooks, keys=None)
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    if not isinstance(launch, CallLaunch):
        config = kernel_config(q.shape[-1], q.dtype, q.device, settings)
        launch = call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, config)
    return launch.run_backward(info, kernel_layout(grad_out), q, k, v, out, lse, seed, hooks)


def _list_shape(mask: list[torch.Tensor], block_m: int, block_n: int, by_key: bool) -> tuple[int, int, int]:
    """(mask rows, list rows, slots a row) of a tile's fixed-slot lists (``kernel_tensors``: the first tensor's
    rows are the queries, the second's last dim the keys)."""
    n_q, n_k = cdiv(mask[0].shape[1], block_m), cdiv(mask[1].shape[-1], block_n)
    rows, cols = (n_k, n_q) if by_key else (n_q, n_k)
    return mask[0].shape[0], rows, cols


# Defined through torch.library.Library rather than torch.library.custom_op, whose Python wrappers around the
# dispatcher cost each call ~17 us more (39 against 22 us on a CPU, no-grad): a compiled step calls the forward
# and backward ops once a layer. The tag is custom_op's (PT2-compliant). Every device runs the same Python body
# (the launchers pick the kernels).
_LIBRARY = torch.library.Library("mmsparse", "FRAGMENT")
_TAGS = (torch.Tag.pt2_compliant_tag,)


def _define(schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Callable[..., Any]:
    """The op ``mmsparse::<schema>`` (its name carries :data:`OP_VERSION`), run by ``impl`` on every device and
    by ``fake`` when traced; returns its overload, to call."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema, tags=_TAGS)
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"mmsparse::{name}", fake)
    return getattr(torch.ops.mmsparse, name).default


def _lists_impl(mask: list[torch.Tensor], plan: str, block_m: int, block_n: int,
                by_key: bool) -> tuple[torch.Tensor, torch.Tensor]:
    values = call_plan_from_text(plan)
    info = mask_from_kernel_tensors(mask, values.mode, values.causal, values.num_segments, values.window)
    lists = info.lists(block_m, block_n, by_key, values.compact_bytes, compact=False)
    return lists.counts, lists.indices


def _lists_fake(mask, plan, block_m, block_n, by_key):
    batch, rows, cols = _list_shape(mask, block_m, block_n, by_key)
    counts = mask[0].new_empty((batch, rows, COUNT_WORDS), dtype=torch.int32)
    return counts, mask[0].new_empty((batch, rows * cols), dtype=torch.int32)


_lists_op = _define(f"lists_v{OP_VERSION}(Tensor[] mask, str plan, SymInt block_m, SymInt block_n, bool by_key) "
                    "-> (Tensor, Tensor)", _lists_impl, _lists_fake)


def _op_mask_args(mask: list[torch.Tensor], values: CallPlan, tiles: list[TileKey], lists: list[torch.Tensor],
                  host_values: list[int], device: torch.device) -> tuple[list[LaunchArgs], MaskInfo | None]:
    """The mask arguments of each tile an op reads, and the kept mask they come from (None where they do not):
    where the mask is made of ``host_values``, the kept mask of those values (:mod:`mmsparse.mask.kept`: built
    once, so a repeated step builds nothing), as an eager call reads its own mask; else the op's ``mask`` tensors
    over its ``lists`` argument (the graph's ``lists`` ops), in the tiles' order."""
    if not host_values:
        return traced_mask_args(mask, values.mode, lists, values.window, len(tiles)), None
    info = kept_mask(tuple(host_values), device, tiles)
    if info is None:
        raise RuntimeError(
            "mmsparse: this CUDA graph capture runs a compiled attention step whose mask was never built outside "
            "a capture. Run the step once before capturing it (a warm-up, as torch.compile(mode='reduce-overhead') "
            "does): the capture then reads the mask built there")
    args = kernel_args(info)
    return [args.tile(*tile) for tile in tiles], info


def _resolve(op: str, plan: str, host_values: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: list[torch.Tensor], lists: list[torch.Tensor], seed: torch.Tensor | None, softmax_scale: float,
             dropout_p: float) -> tuple[Any, list[LaunchArgs]]:
    """An op call's launch and the mask arguments of each tile it reads (``op``: "fwd", one tile, or "bwd", the
    dK/dV pass's and the dQ pass's): found by one lookup where this kind of call was resolved before
    (:mod:`mmsparse.attention.resolved`), else worked out and kept."""
    key = op_call_key(op, plan, host_values, (q, k, v), mask, lists, seed, (softmax_scale, dropout_p))
    found = resolved_op(key)
    args = found.mask_args(mask, lists) if found is not None else None
    if args is not None:
        return found.launch, args
    values = call_plan_from_text(plan)
    forward = op == "fwd"
    tiles = (values.list_tiles(backward=False) if forward
             else [step.lists for step in (values.dkdv, values.dq) if step is not None])
    args, kept = _op_mask_args(mask, values, tiles, lists, host_values, q.device)
    launch = (forward_launch_of(plan, q, k, v, softmax_scale, dropout_p, seed, args[0]) if forward
              else backward_launch_of(plan, q, k, v, softmax_scale, dropout_p, seed, _pass_args(args)))
    keep_resolved(key, ResolvedOp(launch, tuple(tiles), values.mode, values.window,
                                  None if kept is None else weakref.ref(kept)))
    return launch, args


def _fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: list[torch.Tensor], lists: list[torch.Tensor],
    seed: torch.Tensor | None, softmax_scale: float, dropout_p: float, plan: str, host_values: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    launch, args = _resolve("fwd", plan, host_values, q, k, v, mask, lists, seed, softmax_scale, dropout_p)
    return launch(q, k, v, seed, args[0])


def _fwd_fake(q, k, v, mask, lists, seed, softmax_scale, dropout_p, plan, host_values):
    batch, heads, seq_q, _ = q.shape
    return output_like(q), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


_fwd_op = _define(f"fwd_v{OP_VERSION}(Tensor q, Tensor k, Tensor v, Tensor[] mask, Tensor[] lists, Tensor? seed, "
                  "float softmax_scale, float dropout_p, str plan, SymInt[] host_values) -> (Tensor, Tensor)",
                  _fwd_impl, _fwd_fake)


def _bwd_impl(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    mask: list[torch.Tensor], lists: list[torch.Tensor], seed: torch.Tensor | None, softmax_scale: float,
    dropout_p: float, plan: str, host_values: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    launch, args = _resolve("bwd", plan, host_values, q, k, v, mask, lists, seed, softmax_scale, dropout_p)
    return launch(kernel_layout(grad_out), q, k, v, out, lse, seed, *_pass_args(args))


def _pass_args(args: list[LaunchArgs]) -> tuple[LaunchArgs, LaunchArgs | None]:
    """The mask arguments of the dK/dV pass and of the dQ pass (None in the one pass), in the plan's order."""
    return args[0], args[1] if len(args) > 1 else None


def _bwd_fake(grad_out, q, k, v, out, lse, mask, lists, seed, softmax_scale, dropout_p, plan, host_values):
    return output_like(q), output_like(k), output_like(v)


_bwd_op = _define(f"bwd_v{OP_VERSION}(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                  "Tensor[] mask, Tensor[] lists, Tensor? seed, float softmax_scale, float dropout_p, str plan, "
                  "SymInt[] host_values) -> (Tensor, Tensor, Tensor)", _bwd_impl, _bwd_fake)
