"""The backward passes' launcher, one per call, made at its first backward: delta = rowsum(dO * O) (computed by the
tl dQ pass itself where it runs first on one stream), then dQ and dK/dV, each as its Gluon kernel on Hopper where
the tile has one and as its tl kernel elsewhere, with the same numerics; or, with ``deterministic=False``, the
one-pass backward: the dK/dV kernel (Gluon or tl) also adds dQ into a float32 accumulator by atomics (or, where
the config has ``gluon_dq_writer``, the warp-specialised Gluon one-pass kernel with a dQ writer warp does)."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from ..kernels.rules import lse_in_scores
from ..kernels.tl.backward import attention_delta_tl, attention_dkdv_tl, attention_dq_tl
from ..mask.add_order import adds_shortest_first, lists_add_ranks
from ..mask.blocks import cdiv
from ..runtime.arrival import KeysArrival
from ..runtime.launch import FastKernel, launch_bound
from ..runtime.multiprocessors import usable_multiprocessors
from ..runtime.scratch import ensure_tma_allocator
from ..runtime.streams import kept_own_stream
from .config import GLUON_DKDV_MAX_HEAD_DIM, cuda_index, head_dim_pad
from .forward import _LOG2E, dot_mode
from .kernel_args import LaunchArgs
from .layouts import in_eights, kernel_layout, output_strides
from .plan import AttentionPlan, CallPlan

_DELTA, _DKDV, _DQ = FastKernel(attention_delta_tl), FastKernel(attention_dkdv_tl), FastKernel(attention_dq_tl)


def dq_pass_lse_first(dkdv_gluon: bool, mask_mode: int, causal: bool, head_dim_pad: int) -> bool:
    """Whether the tl dQ pass computes P with -lse / scale in S's initial value (``rules.lse_in_scores``): where the
    dK/dV pass beside it is the Gluon kernel, which does. Both passes then round dS to the input dtype from the same
    P, and the one pass (the Gluon dQ writer) agrees with them up to the order of float32 adds."""
    return dkdv_gluon and lse_in_scores(mask_mode, causal, head_dim_pad)


class BackwardLaunch:
    """Everything about one planned backward except the tensors, worked out once per call kind, at its first
    backward (kept by plan, shapes, strides and the mask's integers for every mask alike, in eager and in the custom
    ops: :func:`mmsparse.attention.call.backward_launch_of`): grids and constexprs. The mask arguments come with each
    call, over block lists built before it on the current stream. After their first launch the kernels
    are called straight through their launchers, kept per layout of the saved q, k and v (``_bound``): a backward's
    strides are read from the tensors it is given, not from the forward's key, since saved-tensor hooks
    (activation offloading) can hand them back in another layout than the forward saw. Every other integer
    argument comes from the call's key, so each launch of one layout specialises alike.

    On a GPU the dQ pass (over SHORT_KEYS keys or more) runs on a side stream, concurrently with dK/dV: both need
    only delta, and their programs fill each other's idle SM slots. Every block list either pass reads is built
    first, on the current stream, before the side stream waits for it: the two passes' lists share summaries (and,
    for self-attention, code runs), so a list built lazily on the side stream would be read by the dK/dV builder
    before it was written, and its memory would come from the side stream's pool while the mask that keeps it is
    used on the current one. The current stream waits for the side stream before returning, so callers, CUDA
    graphs and the caching allocator (whose blocks stay with the current stream) see one ordered stream.

    Where the plan has no dQ pass (``deterministic=False``, or the ordered dQ writer; nor a side stream then): the
    Gluon dQ-writer kernel where the plan has it (by TMA bulk reduce-adds), else the tl dK/dV kernel (by atomics)
    also adds dQ into a zeroed float32 ``[B, Hq, Sq, D]`` accumulator, cast to q's dtype at the end."""

    def __init__(self, q, k, call_plan: CallPlan, plan: AttentionPlan | CallPlan, softmax_scale: float,
                 dropout_p: float) -> None:
        batch, num_heads, seq_q, head_dim = q.shape
        num_kv_heads, seq_k = k.shape[1], k.shape[2]
        d_pad = head_dim_pad(head_dim)
        self.mode, self.causal, self.has_window = call_plan.mode, call_plan.causal, call_plan.window is not None
        self.device, self.dtype = q.device, q.dtype
        self.use_tma, self.softmax_scale, self.dropout_p = call_plan.use_tma, softmax_scale, dropout_p
        self.qk_scale = softmax_scale * _LOG2E
        self.q_shape, self.kv_shape = q.shape, (batch, num_kv_heads, seq_k, head_dim)
        # delta's shape and contiguous strides (lse's): empty_strided costs less host than empty
        self.delta_shape, self.delta_strides = (batch, num_heads, seq_q), (num_heads * seq_q, seq_q, 1)
        self.seq_q = seq_q
        self.delta_grid = (cdiv(seq_q, 64), batch * num_heads)
        self.plan = plan
        self.one_pass = plan.dq is None
        # the ordered dQ writer (deterministic): a counter of adds per (batch * head, query block)
        self.ordered = plan.dkdv.ordered
        self.query_blocks = cdiv(seq_q, plan.dkdv.tile.block_m)
        self.shortest_first = adds_shortest_first(self.mode, self.causal)  # its launch direction
        group = num_heads // num_kv_heads
        # its programs taking each key block for this many (batch, KV head)s in turn (those of the plan's query heads
        # a section), where launched longest first: shortest first, a list starts at its own queries and the key
        # block that reaches a query block first must also start first, which sections would undo
        # (tools.ordered_waits models them 0.52-0.86x on causal masks)
        self.head_section = 1 if self.shortest_first else max(1, plan.dkdv.head_section // group)
        self.delta_constexprs = dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BR=64,
                                     ZERO_DQ=self.one_pass)
        # Past D=128 the Gluon dK/dV pass is its own kernel (no one pass: plan.check_head_dim refuses that tile)
        self.dkdv_d256 = d_pad > GLUON_DKDV_MAX_HEAD_DIM
        tile = plan.dkdv.tile
        flags = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, MASK_MODE=self.mode, IS_CAUSAL=self.causal,
                     HAS_WINDOW=self.has_window, HAS_DROPOUT=dropout_p > 0.0, DOT_MODE=dot_mode(q),
                     USE_TMA=self.use_tma)
        # The tl dQ pass computes delta itself where it runs before the dK/dV pass on one stream: no side stream,
        # no context-parallel exchange (whose dK/dV pass goes first: see __call__)
        self.dq_owns_delta = plan.dq is not None and not plan.dq.gluon and not plan.side_stream
        if plan.dq is not None and not plan.dq.gluon:
            dq_tile = plan.dq.tile
            self.dq_grid = (cdiv(seq_q, dq_tile.block_m), batch * num_heads)
            lse_first = dq_pass_lse_first(plan.dkdv.gluon, self.mode, self.causal, d_pad)
            self.dq_constexprs = dict(NUM_HEADS=num_heads, GROUP=group, BM=dq_tile.block_m, BN=dq_tile.block_n,
                                      **flags, LSE_FIRST=lse_first, num_warps=dq_tile.num_warps,
                                      num_stages=dq_tile.num_stages)
            self.dq_own_delta_constexprs = dict(self.dq_constexprs, OWN_DELTA=True)
        self.dkdv_grid = (cdiv(seq_k, tile.block_n), batch * num_kv_heads)
        self.dkdv_constexprs = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BM=tile.block_m,
                                    BN=tile.block_n, **flags, ONE_PASS=self.one_pass,
                                    num_warps=tile.num_warps, num_stages=tile.num_stages)
        # the relaunches after each kernel's first launch, per layout of (q, k, v, out, dO): strides specialise a
        # launch; with them each layout's gradient strides (:class:`_Layout`)
        self._bound: dict[tuple[int, ...], dict[str, Any]] = {}

    def __call__(self, do, q, k, v, out, lse, seed, dkdv_mask: LaunchArgs, dq_mask: LaunchArgs | None,
                 hooks: ExchangeHooks | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` in the inputs' dtypes and layouts (``layouts.output_like``; dk, dv summed over each GQA
        group), of the call's q, k, v and ``do`` (laid out by ``layouts.kernel_layout``), its outputs, dropout seed and
        the mask arguments of the dK/dV and the dQ passes' tiles (``dq_mask`` None for the one pass), over lists built
        before, on the current stream. ``hooks``: a context-parallel rank's exchange beside the passes
        (:class:`ExchangeHooks`); the passes then run one after the other on the current stream, dK/dV first."""
        if self.use_tma:  # every call: Triton's allocator is per thread (autograd's, a recompute's)
            ensure_tma_allocator(self.device)
        out, lse = kernel_layout(out), saved_layout(lse)
        seed = seed if seed is not None else lse  # never read without dropout
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *do.stride()[:3])
        bound = self._bound.get(strides)
        if bound is None:
            if len(self._bound) >= _MAX_LAYOUTS:
                self._bound.clear()  # relaunches are remade at the next launch of each layout: only host time
            bound = self._bound[strides] = {"layout": _Layout(q, k, v, strides)}
        layout = bound["layout"]
        delta = torch.empty_strided(self.delta_shape, self.delta_strides, dtype=torch.float32, device=self.device)
        dq_sum = None
        if self.one_pass:
            if not self.ordered:
                _alert_not_deterministic()
            # the float32 dQ accumulator, zeroed by the delta kernel (rows no tile reaches stay 0)
            dq_sum = torch.empty(self.q_shape, dtype=torch.float32, device=self.device)
        own_delta = self.dq_owns_delta and hooks is None
        if not own_delta:
            launch_bound(_DELTA, self.delta_grid,
                         (out, do, delta, dq_sum if self.one_pass else delta, self.seq_q, *layout.out8, *layout.do8),
                         self.delta_constexprs, bound, "delta")
        passes = _Passes(self, (do, q, k, v, lse, delta, seed, out), layout, bound, own_delta)
        if hooks is not None:
            return self._beside_exchange(passes, hooks, dkdv_mask, dq_mask, dq_sum)
        if self.one_pass:
            dk, dv = passes.dkdv(dkdv_mask, dq_sum)
            return self._one_pass_dq(dq_sum, layout), dk, dv
        dq = layout.new_dq(self)  # on the current stream: its memory is that stream's
        main, side = _streams(self.device) if self.plan.side_stream else (None, None)
        if side is None:
            passes.dq(dq_mask, dq)
            dk, dv = passes.dkdv(dkdv_mask, None)
            return dq, dk, dv
        side.wait_stream(main)  # delta, the block lists and the inputs are ready
        with torch.cuda.stream(side):
            passes.dq(dq_mask, dq)
        dk, dv = passes.dkdv(dkdv_mask, None)
        main.wait_stream(side)
        return dq, dk, dv

    def _beside_exchange(self, passes: _Passes, hooks: ExchangeHooks, dkdv_mask: LaunchArgs,
                         dq_mask: LaunchArgs | None,
                         dq_sum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The passes of :meth:`__call__` with ``hooks``: dK/dV (taking the keys as they land where the kernel
        can), then ``hooks.after_dkdv``, then dQ, all on the current stream."""
        keys = hooks.keys
        landing = keys is not None and self._takes_landing_keys() and not torch.cuda.is_current_stream_capturing()
        if keys is not None and not landing:
            keys.wait()  # this kernel, or a captured graph (whose flag epoch would be replayed), waits on the stream
        dk, dv = passes.dkdv(dkdv_mask, dq_sum, keys if landing else None)
        if landing:
            keys.wait()  # the dQ pass reads every key from its start
        if hooks.after_dkdv is not None:
            hooks.after_dkdv(dk, dv)
        if self.one_pass:
            return self._one_pass_dq(dq_sum, passes.layout), dk, dv
        return passes.dq(dq_mask, passes.layout.new_dq(self)), dk, dv

    def resident_rows(self, stream: int) -> int:
        """The ordered dQ writer's rows of one (batch, KV head) whose programs run at once on ``stream`` (a program
        a multiprocessor: each takes most of one's shared memory), shared with its section's other heads. Read at
        each call: a stream of a green context, or an MPS limit, leaves fewer multiprocessors than the device has,
        and ranks made for more would wait for programs that cannot start (``runtime.multiprocessors``)."""
        return max(1, usable_multiprocessors(self.device, stream) // self.head_section)

    def _takes_landing_keys(self) -> bool:
        """The dK/dV pass can start before every key has landed: the Gluon dK/dV kernel of the two passes (head
        dims up to 128), which waits in each key block for the keys it reads (``WAIT_ARRIVAL``)."""
        dkdv = self.plan.dkdv
        return dkdv.gluon and not dkdv.dq_writer and not self.dkdv_d256 and not self.one_pass

    def _one_pass_dq(self, dq_sum: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """dQ in q's dtype and layout from the one pass's float32 sum (contiguous; queued after its kernel on the
        current stream)."""
        if self.dtype == torch.float32 and layout.dq == dq_sum.stride():
            return dq_sum
        dq = layout.new_dq(self)
        dq.copy_(dq_sum)
        return dq


class _Layout:
    """What one layout of the saved q, k, v, out and of dO gives, worked out once: the gradients' strides (each
    follows its input's, ``layouts.output_like``) and the strides the tl kernels take, in units of 8 elements
    (``layouts.in_eights``). ``strides``: q's, k's, v's, out's and dO's batch, head and row strides."""

    __slots__ = ("dq", "dk", "dv", "qkv8", "out8", "do8", "dq8", "dk8", "dv8")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, strides: tuple[int, ...]) -> None:
        self.dq, self.dk, self.dv = output_strides(q), output_strides(k), output_strides(v)
        self.qkv8, self.out8, self.do8 = in_eights(strides[:9]), in_eights(strides[9:12]), in_eights(strides[12:])
        self.dq8, self.dk8, self.dv8 = (in_eights(s[:3]) for s in (self.dq, self.dk, self.dv))

    def new_dq(self, launch: BackwardLaunch) -> torch.Tensor:
        return torch.empty_strided(launch.q_shape, self.dq, dtype=launch.dtype, device=launch.device)

    def new_dk_dv(self, launch: BackwardLaunch, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty_strided(launch.kv_shape, self.dk, dtype=k.dtype, device=launch.device),
                torch.empty_strided(launch.kv_shape, self.dv, dtype=v.dtype, device=launch.device))


@dataclass(frozen=True)
class ExchangeHooks:
    """A context-parallel rank's exchange beside its backward (:meth:`BackwardLaunch.__call__`). ``keys``: the
    gathered keys still landing when the backward starts: the dK/dV pass takes its key blocks as they land where
    its kernel can (:meth:`BackwardLaunch._takes_landing_keys`), else the stream waits for them first; the dQ pass
    runs after every key has landed. ``after_dkdv(dk, dv)``: called once dK and dV are queued, before the dQ pass
    is, so that what it queues elsewhere (the return of dK/dV to their owners, on copy engines or NCCL) runs beside
    the dQ pass."""

    keys: KeysArrival | None = None
    after_dkdv: Callable[[torch.Tensor, torch.Tensor], None] | None = None


class _Passes:
    """The dQ and dK/dV passes of one backward call, launched on the current stream: the call's launch, its
    tensors (``(do, q, k, v, lse, delta, seed, out)``), its layout (:class:`_Layout`) and its
    relaunches (``bound``). ``own_delta``: the tl dQ pass computes delta (``BackwardLaunch.dq_owns_delta``) and
    runs first."""

    def __init__(self, launch: BackwardLaunch, tensors: tuple, layout: _Layout, bound: dict[str, Any],
                 own_delta: bool = False) -> None:
        self.launch, self.tensors, self.layout, self.bound = launch, tensors, layout, bound
        self.own_delta = own_delta

    def dq(self, mask: LaunchArgs, dq: torch.Tensor) -> torch.Tensor:
        """The dQ pass, into ``dq`` (the inputs' dtype); returns it."""
        launch, bound = self.launch, self.bound
        do, q, k, v, lse, delta, seed, out = self.tensors
        layout = self.layout
        if launch.plan.dq.gluon:
            _gluon().run_dq(q, k, v, do, lse, delta, dq, mask, launch.mode, launch.causal, launch.qk_scale,
                            launch.softmax_scale, launch.plan.dq.tile, launch.has_window, bound=bound)
        else:
            mask_tensors, mask_scalars = mask
            constexprs, name = ((launch.dq_own_delta_constexprs, "dq-own-delta") if self.own_delta
                                else (launch.dq_constexprs, "dq"))
            launch_bound(_DQ, launch.dq_grid,
                         (q, k, v, do, lse, delta, dq, *mask_tensors, seed, *layout.qkv8, *layout.do8, *layout.dq8,
                          *mask_scalars, launch.qk_scale, launch.softmax_scale, launch.dropout_p, out, *layout.out8),
                         constexprs, bound, name)
        return dq

    def dkdv(self, mask: LaunchArgs, dq_sum: torch.Tensor | None,
             arrival: KeysArrival | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The dK/dV pass: (dK, dV) in the inputs' dtypes; with ``dq_sum`` (the one pass) it also adds dQ there.
        ``arrival``: the keys past ``arrival.present`` are still landing (the Gluon dK/dV kernel only)."""
        launch, bound = self.launch, self.bound
        do, q, k, v, lse, delta, seed, _ = self.tensors
        layout = self.layout
        plan, args = launch.plan, (launch.mode, launch.causal, launch.qk_scale, launch.softmax_scale)
        dk, dv = layout.new_dk_dv(launch, k, v)
        if plan.dkdv.dq_writer:
            order = None
            if launch.ordered:
                counters = torch.zeros(launch.q_shape[0] * launch.q_shape[1] * launch.query_blocks, dtype=torch.int32,
                                       device=launch.device)
                ranks = lists_add_ranks(mask[0][3], mask[0][4], launch.query_blocks,
                                        launch.resident_rows(torch.cuda.current_stream(launch.device).cuda_stream),
                                        launch.shortest_first)
                order = (counters, ranks, launch.query_blocks)
            _gluon().run_bwd_dq_writer(q, k, v, do, lse, delta, (dk, dv), dq_sum, mask, *args, plan.dkdv.tile,
                                       launch.has_window, bound=bound, order=order,
                                       shortest_first=launch.shortest_first, head_section=launch.head_section)
        elif plan.dkdv.gluon and launch.dkdv_d256:
            _gluon().run_dkdv_d256(q, k, v, do, lse, delta, (dk, dv), mask, *args, plan.dkdv.tile,
                                   launch.has_window, bound=bound)
        elif plan.dkdv.gluon:
            _gluon().run_dkdv(q, k, v, do, lse, delta, (dk, dv), mask, *args, plan.dkdv.tile, launch.has_window,
                              bound=bound, arrival=arrival)
        else:
            mask_tensors, mask_scalars = mask
            dq_arg = dk if dq_sum is None else dq_sum  # DQ: unread without ONE_PASS
            launch_bound(_DKDV, launch.dkdv_grid,
                         (q, k, v, do, lse, delta, dk, dv, dq_arg, *mask_tensors, seed, *layout.qkv8, *layout.do8,
                          *layout.dk8, *layout.dv8, *mask_scalars, launch.qk_scale, launch.softmax_scale,
                          launch.dropout_p),
                         launch.dkdv_constexprs, bound, "dkdv")
        return dk, dv


_MAX_LAYOUTS = 8  # layouts of one call's saved q, k, v, out and its dO whose relaunches are kept (offloaded: 2)


def saved_layout(lse: torch.Tensor) -> torch.Tensor:
    """The saved lse as the kernels read it: contiguous on a 16-byte aligned base. The forward made it so, but a
    saved-tensor hook may hand back another layout or a view into a buffer of its own. (The saved out is read at
    its strides: ``layouts.kernel_layout``.)"""
    if lse.is_contiguous() and not lse.data_ptr() & 15:
        return lse
    return lse.clone(memory_format=torch.contiguous_format)


def _alert_not_deterministic() -> None:
    """As torch's own ops without a deterministic kernel: under ``torch.use_deterministic_algorithms(True)`` the
    one-pass backward raises a RuntimeError (a warning with ``warn_only=True``)."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = ("mmsparse's one-pass backward (deterministic=False, or use_config(deterministic=False)) adds dQ with "
               "atomics and is not deterministic, but torch.use_deterministic_algorithms(True) is set: pass "
               "deterministic=True to the attention call or module for the bitwise repeatable backward")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=2)
    else:
        raise RuntimeError(message)


def _gluon() -> ModuleType:
    """The Gluon launchers (the plan chose a Gluon pass)."""
    from . import gluon_launch  # imports Gluon: reached only where dispatch.hopper_gluon_available said yes

    return gluon_launch


_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device index, caller's stream id) -> side stream
_SIDE_STREAMS_LOCK = threading.Lock()


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(current stream, its side stream for the dQ pass). One side stream per caller's stream, not per device or
    thread: a CUDA-graph capture's side stream stays in the capture until it ends, and autograd runs every
    backward of a device on one thread of its own, so a side stream shared with another caller's stream would
    take that caller's dQ pass into the capture (or fail it). For the same reason a side stream is one no one else
    holds (:func:`mmsparse.runtime.streams.own_stream`), never one of torch's pool, which hands its 32 streams out
    again to whoever asks next. The plan forks only on the GPU and over SHORT_KEYS
    keys or more: below, a call is bound by host work, and switching streams adds ~75 us to it (H100 host, the
    seed: 0.48 ms with the side stream, 0.41 without; docs/performance.md)."""
    index = cuda_index(device)
    main = torch.cuda.current_stream(index)
    key = (index, main.stream_id)
    return main, kept_own_stream(_SIDE_STREAMS, _SIDE_STREAMS_LOCK, key, index)
