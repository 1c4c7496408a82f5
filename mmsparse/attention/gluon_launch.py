"""Launchers of the Gluon Hopper passes: host-side TMA descriptors and the grid, around mask arguments made from
block lists built before the launch (:mod:`.kernel_args`). Importing this module imports Gluon: :mod:`.dispatch`
decides whether it is used."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

from ..kernels.constants import TURNS_MBARRIER, TURNS_NAMED_RELEASE
from ..kernels.gluon.bwd_dq_writer import BLOCK_N as DQ_WRITER_BLOCK_N
from ..kernels.gluon.bwd_dq_writer import attention_bwd_dq_writer_gluon
from ..kernels.gluon.common import BLOCK_M, WG_ROWS
from ..kernels.gluon.dkdv import BLOCK_N, WG_KEYS, attention_dkdv_gluon
from ..kernels.gluon.dkdv_d256 import BLOCK_N as D256_BLOCK_N
from ..kernels.gluon.dkdv_d256 import attention_dkdv_d256_gluon
from ..kernels.gluon.dq import attention_dq_gluon
from ..kernels.gluon.forward import attention_fwd_gluon
from ..mask.blocks import cdiv
from ..runtime.arrival import KeysArrival
from ..runtime.launch import FastKernel, launch_bound
from ..runtime.tma_args import Boxes
from .config import Tile, head_dim_pad
from .host_tma import HostBox
from .kernel_args import LaunchArgs
from .layouts import output_strides

# Registers per thread at launch, for the 9 warps of a CTA (two consumer warpgroups and the producer) before the
# partitions set their own (kernels.gluon.common.WORKER_REGS): 168 x 288 threads fit an SM's 64K.
_LAUNCH_REGS = 168

# Tile.turns: how the forward's ping-pong warpgroups take turns (kernels.constants.TURNS_*).
TURNS = {"mbarrier": TURNS_MBARRIER, "named_release": TURNS_NAMED_RELEASE}

_FWD, _DQ, _DKDV = FastKernel(attention_fwd_gluon), FastKernel(attention_dq_gluon), FastKernel(attention_dkdv_gluon)
_DKDV_D256 = FastKernel(attention_dkdv_d256_gluon)
_DQ_WRITER = FastKernel(attention_bwd_dq_writer_gluon)


def run_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: LaunchArgs, mode: int, causal: bool,
    qk_scale_log2: float, tile: Tile, has_window: bool = False, bound: dict[str, Any] | None = None,
    out_strides: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of ``forward.ForwardLaunch`` without dropout or splits (qk_scale_log2 = softmax scale * log2(e)),
    at ``tile`` (block_m 128; block_n, gluon_stages, pingpong and turns are read), over the mask arguments ``mask`` of
    that tile (mask mode ``mode``): ``(out [B, Hq, Sq, D] in q's dtype and layout, lse [B, Hq, Sq] float32 in log2
    units)``. ``bound``: as :func:`run_dq`'s; ``out_strides``: ``layouts.output_strides(q)``, if the caller has
    them."""
    batch, num_heads, seq_q, head_dim = q.shape
    s = _setup_of(bound, "forward", lambda: _query_setup(q, k, tile, mode, causal, has_window, None,
                                                         PINGPONG=tile.pingpong, TURNS=TURNS[tile.turns]))
    mask_tensors, mask_scalars = mask
    out = torch.empty_strided(q.shape, output_strides(q) if out_strides is None else out_strides, dtype=q.dtype,
                              device=q.device)
    lse = torch.empty_strided((batch, num_heads, seq_q), (num_heads * seq_q, seq_q, 1), dtype=torch.float32,
                              device=q.device)
    launch_bound(_FWD, s.grid, (q, k, v, out, lse, *mask_tensors, *mask_scalars, qk_scale_log2), s.constexprs, bound,
                 "forward", s.boxes)
    return out, lse


def run_dq(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    dq: torch.Tensor, mask: LaunchArgs, mode: int, causal: bool, qk_scale_log2: float, softmax_scale: float,
    tile: Tile, has_window: bool = False, bound: dict[str, Any] | None = None,
) -> None:
    """Write dQ into ``dq`` (``[B, Hq, Sq, D]``, q's dtype, any layout the kernels take) as the tl dQ kernel
    computes it without dropout, at ``tile`` (block_m 128; block_n and gluon_stages are read; no ping-pong), over
    the mask arguments ``mask`` of that tile. ``do``: any layout the kernels take, as q's. The caller allocates dq,
    so that it belongs to the caller's stream when this runs on a side stream. ``bound``: the caller's relaunches for
    launches that specialise alike (:func:`mmsparse.runtime.launch.launch_bound`)."""
    s = _setup_of(bound, "dq", lambda: _query_setup(q, k, tile, mode, causal, has_window, "dQ", dq_at=6))
    mask_tensors, mask_scalars = mask
    launch_bound(_DQ, s.grid, (q, k, v, do, lse, delta, dq, *mask_tensors, *mask_scalars, qk_scale_log2, softmax_scale),
                 s.constexprs, bound, "dq", s.boxes)


def run_dkdv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    dk_dv: tuple[torch.Tensor, torch.Tensor], mask: LaunchArgs, mode: int, causal: bool, qk_scale_log2: float,
    softmax_scale: float, tile: Tile, has_window: bool = False, bound: dict[str, Any] | None = None,
    arrival: KeysArrival | None = None,
) -> None:
    """Write dK and dV (``[B, Hkv, Sk, D]``, any layout the kernels take, summed over each GQA group) into ``dk_dv`` as
    the tl dK/dV kernel computes them without dropout, at ``tile`` (block_n 128; block_m and gluon_stages (at least 2)
    are read; no ping-pong), over the mask arguments ``mask`` of that tile, by key. ``bound``: as :func:`run_dq`'s.
    ``arrival``: keys past ``arrival.present`` are still landing; their key blocks wait in the kernel for its flag,
    after the blocks of the keys already there."""
    # the arrival variant is a launch of its own (another compile key)
    flags = dict(WAIT_ARRIVAL=True) if arrival is not None else {}
    name = "dkdv" + ("-arrival" if arrival is not None else "")
    s = _setup_of(bound, name, lambda: _key_setup(q, k, tile, BLOCK_N, WG_KEYS.value, "dK/dV", mode, causal,
                                                  has_window, **flags))
    # (flag, epoch, key blocks already there); unread without WAIT_ARRIVAL (delta stands in)
    landing = (delta, 0, 0) if arrival is None else (arrival.flag, arrival.epoch, arrival.present // BLOCK_N)
    _launch_by_key(_DKDV, name, s, (q, k, v, do, *dk_dv), (lse, delta), mask, qk_scale_log2, softmax_scale, bound,
                   landing)


def run_dkdv_d256(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    dk_dv: tuple[torch.Tensor, torch.Tensor], mask: LaunchArgs, mode: int, causal: bool, qk_scale_log2: float,
    softmax_scale: float, tile: Tile, has_window: bool = False, bound: dict[str, Any] | None = None,
) -> None:
    """:func:`run_dkdv` at head dims 129-256 (padded to 256) by ``kernels.gluon.dkdv_d256``: 64 keys a CTA (block_n
    64; block_m, at least 64, and gluon_stages are read; ``config.GLUON_D256["dkdv"]``), no one-pass variant.
    ``bound``: as :func:`run_dq`'s."""
    s = _setup_of(bound, "dkdv_d256",
                  lambda: _key_setup(q, k, tile, D256_BLOCK_N, D256_BLOCK_N, "dK/dV", mode, causal, has_window))
    _launch_by_key(_DKDV_D256, "dkdv_d256", s, (q, k, v, do, *dk_dv), (lse, delta), mask, qk_scale_log2,
                   softmax_scale, bound)


def run_bwd_dq_writer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    dk_dv: tuple[torch.Tensor, torch.Tensor], dq_sum: torch.Tensor, mask: LaunchArgs, mode: int, causal: bool,
    qk_scale_log2: float, softmax_scale: float, tile: Tile, has_window: bool = False,
    bound: dict[str, Any] | None = None, order: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    shortest_first: bool = True, head_section: int = 1,
) -> None:
    """The one-pass backward by ``kernels.gluon.bwd_dq_writer`` (two MMA warpgroups, a producer warp and a dQ writer
    warp): dK and dV into ``dk_dv`` as :func:`run_dkdv`, and dQ times the softmax scale added into ``dq_sum`` (a
    zeroed contiguous float32 ``[B, Hq, Sq, D]``) by TMA bulk reduce-adds, at ``tile`` (block_n 128; block_m and
    gluon_stages are read; ``config.GLUON_DQ_WRITER``), over the mask arguments ``mask`` of that tile, by key.
    ``order`` (deterministic): ``(counters, ranks, query_blocks)``, a zeroed int32 ``[B * Hq, query_blocks]``
    and the lists' ``mask.add_order.dq_add_ranks``: the adds into each query block then land in that fixed order.
    ``shortest_first``: the direction of the launch order those ranks were made for (read only with ``order``).
    ``head_section``: the programs take each key block for this many consecutive (batch, KV head)s in turn (with
    ``order``, whose ranks must be made for groups of that many times fewer rows: ``KernelConfig``'s
    ``ordered_head_section``). ``bound``: as :func:`run_dq`'s."""
    name, flags = _writer_flags(order is not None, shortest_first, head_section)
    s = _setup_of(bound, name, lambda: _key_setup(q, k, tile, DQ_WRITER_BLOCK_N, WG_KEYS.value, "one-pass", mode,
                                                  causal, has_window, True, **flags))
    tail = (delta, delta, 0) if order is None else order  # unread without ORDERED: delta stands in
    _launch_by_key(_DQ_WRITER, name, s, (q, k, v, do, *dk_dv), (lse, delta, dq_sum), mask, qk_scale_log2,
                   softmax_scale, bound, tail)


@functools.cache
def _writer_flags(ordered: bool, shortest_first: bool, head_section: int) -> tuple[str, dict[str, Any]]:
    """(the launch's name in ``bound``, the dQ-writer kernel's own constexprs): its order and launch direction,
    and its sections of heads, each left off where unused, so that the default launch keeps its constexprs (and
    compiled kernel); the name holds them all (one relaunch and setup per set). Made once per set: a call reads
    them (the dict is only unpacked, never changed)."""
    flags: dict[str, Any] = dict(ORDERED=True, SHORTEST_FIRST=shortest_first) if ordered else {}
    if head_section > 1:
        flags["HEADS_SECTION"] = head_section
    return "bwd_dq_writer" + "".join(f"-{key}={value}" for key, value in flags.items()), flags


class _Setup(NamedTuple):
    """What a Gluon launch works out from its shapes, tile and flags alone, once per launch owner (``bound``): the
    grid, the boxes of its descriptor arguments by position, and the constexprs. The launch passes the live
    tensors at those positions (a descriptor holds a pointer and strides: made, or found encoded, from the tensor
    of each call: ``runtime.tma_args``)."""

    grid: tuple[int, int]
    boxes: Boxes
    constexprs: dict[str, Any]


def _query_setup(q: torch.Tensor, k: torch.Tensor, tile: Tile, mode: int, causal: bool, has_window: bool,
                 no_pingpong: str | None, dq_at: int | None = None, **flags: Any) -> _Setup:
    """The setup of a launch by query block (the forward, dQ): a CTA per 128 query rows of a (batch, head); its
    arguments start with the descriptors of q, k, v and a Q-side one (the forward's out, dQ's dO), and ``dq_at``
    is the position of dQ's own (None: the forward). ``no_pingpong``: the pass's name where it takes no ping-pong
    turns; ``flags``: its own constexprs."""
    batch, num_heads, seq_q, head_dim = q.shape
    _check_rows(tile.block_m, BLOCK_M)
    if no_pingpong is not None:
        _check_no_pingpong(tile, no_pingpong)
    pad = head_dim_pad(head_dim)
    q_box, kv_box = HostBox(WG_ROWS.value, pad), HostBox(tile.block_n, pad)
    boxes: Boxes = ((0, q_box), (1, kv_box), (2, kv_box), (3, q_box))
    if dq_at is not None:
        boxes += ((dq_at, q_box),)
    return _Setup(
        (cdiv(seq_q, BLOCK_M), batch * num_heads), boxes,
        dict(NUM_HEADS=num_heads, GROUP=num_heads // k.shape[1], HEAD_DIM_PAD=pad, BN=tile.block_n,
             STAGES=tile.gluon_stages, MASK_MODE=mode, IS_CAUSAL=causal, HAS_WINDOW=has_window, **flags,
             num_warps=4, maxnreg=_LAUNCH_REGS))


def _key_setup(q: torch.Tensor, k: torch.Tensor, tile: Tile, block_n: int, kv_rows: int, name: str, mode: int,
               causal: bool, has_window: bool, dq_sum: bool = False, **flags: Any) -> _Setup:
    """The setup of a launch by key block (the dK/dV kernels, the dQ writer): a CTA per ``block_n`` keys of a
    (batch, KV head); its arguments start with the descriptors of q, k, v, dO, dK and dV (K-side boxes of
    ``kv_rows`` rows), then lse and delta; with ``dq_sum``, dQ's float32 sum follows as a ``[B * Hq, Sq, D]``
    descriptor whose box is one consumer warpgroup's half of a block's columns. ``flags``: the kernel's own
    constexprs."""
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    _check_rows(tile.block_n, block_n)
    _check_no_pingpong(tile, name)
    pad = head_dim_pad(head_dim)
    q_box, kv_box = HostBox(tile.block_m, pad), HostBox(kv_rows, pad)
    boxes = tuple(enumerate((q_box, kv_box, kv_box, q_box, kv_box, kv_box)))
    if dq_sum:
        boxes += ((8, HostBox(tile.block_m, pad // 2, head_rows=True)),)
    return _Setup(
        (cdiv(seq_k, block_n), batch * num_kv_heads), boxes,
        dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM_PAD=pad,
             BM=tile.block_m, STAGES=tile.gluon_stages, MASK_MODE=mode, IS_CAUSAL=causal, HAS_WINDOW=has_window,
             num_warps=4, maxnreg=_LAUNCH_REGS, **flags))


def _launch_by_key(kernel: FastKernel, name: str, s: _Setup, tensors: tuple[torch.Tensor, ...], middle: tuple,
                   mask: LaunchArgs, qk_scale_log2: float, softmax_scale: float,
                   bound: dict[str, Any] | None, tail: tuple = ()) -> None:
    """Launch a kernel by key block: ``tensors`` (q, k, v, dO, dK, dV, taken as descriptors), then ``middle``
    (lse, delta, the kernel's own), the mask arguments, the two scales and ``tail`` (the kernel's own)."""
    mask_tensors, mask_scalars = mask
    launch_bound(kernel, s.grid, (*tensors, *middle, *mask_tensors, *mask_scalars, qk_scale_log2, softmax_scale, *tail),
                 s.constexprs, bound, name, s.boxes)


def _setup_of(bound: dict[str, Any] | None, name: str, make: Callable[[], _Setup]) -> _Setup:
    """The launch's :class:`_Setup`, kept in ``bound`` beside its relaunch: the owner of ``bound`` keeps one per set
    of launches of equal shapes, tiles and flags (``forward.ForwardLaunch``, ``backward.BackwardLaunch``)."""
    if bound is None:
        return make()
    key = f"{name}:setup"
    setup = bound.get(key)
    if setup is None:
        setup = bound[key] = make()
    return setup


def _check_rows(planned: int, kernel: int) -> None:
    """The kernel's fixed block size is the planned tile's, whose block lists the mask arguments hold."""
    if planned != kernel:
        raise ValueError(f"the Gluon kernel's blocks have {kernel} rows, the planned tile {planned}")


def _check_no_pingpong(tile: Tile, name: str) -> None:
    """Only the forward takes ping-pong turns: a backward tile that asks for them is refused rather than run
    without (``KernelConfig`` refuses it when it is made; this covers tiles passed here directly)."""
    if tile.pingpong:
        raise ValueError(f"Tile.pingpong is the Gluon forward's: the {name} pass takes no ping-pong turns; got {tile}")
