"""Which kernel runs each pass of one call, at which tile: decided from the call's shapes, dtype, device, mask and
dropout alone. Planning builds nothing and launches nothing.

A call plans first, then has the mask build the block lists the plan names (:meth:`AttentionPlan.list_tiles`), on
the current stream and before any launch, then launches. The launchers only read what was built. The tools ask
the plan which kernel runs rather than watching the launchers.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields

import torch

from ..mask.add_order import adds_shortest_first
from ..mask.blocks import cdiv
from ..mask.info import TileKey
from ..runtime.multiprocessors import device_multiprocessors
from ..runtime.traced import assume_constant_result
from .config import KernelConfig, Tile, cuda_index, gluon_tile_problem, head_dim_pad


@dataclass(frozen=True)
class ForwardPass:
    """The forward's launch: ``tile`` (its block lists), the Gluon or the tl kernel, and the grid's shape."""

    tile: Tile
    gluon: bool
    block_m: int  # query rows per program: the tile's, or the GQA pack's rows (decoding)
    num_warps: int
    pack_rows: int  # > 0: one program per (batch, KV head) holds all of the group's queries (list row block 0)
    row_blocks: int  # query blocks per (batch, head) program column
    bh_programs: int  # programs along the (batch, head) axis
    n_splits: int  # programs that share one row block's key list (flash-decoding); 1: no split

    @property
    def lists(self) -> TileKey:
        return (self.tile.block_m, self.tile.block_n, False)


@dataclass(frozen=True)
class BackwardPass:
    """One backward pass (dQ: per query block; dK/dV: per key block, ``by_key``) and its kernel. ``one_pass``: the
    dK/dV pass also adds dQ into a float32 accumulator, and there is no dQ pass. ``dq_writer``: that one pass is the
    warp-specialised Gluon kernel with a dQ writer warp (``kernels/gluon/bwd_dq_writer.py``,
    ``KernelConfig.gluon_dq_writer``), the one pass's only Gluon kernel; else it is the tl kernel, adding by atomics.
    ``ordered``: its adds into each query block land in a fixed order (deterministic:
    ``KernelConfig.ordered_dq_writer``), its programs taking each key block in turn for the (batch, KV head)s of
    ``head_section`` query heads where launched longest first (``KernelConfig.ordered_head_section``; 1 where not
    ordered)."""

    tile: Tile
    gluon: bool
    by_key: bool
    one_pass: bool = False
    dq_writer: bool = False
    ordered: bool = False
    head_section: int = 1

    def __post_init__(self) -> None:
        # A plan's text crosses the ops and may come from another release: a Gluon one pass that is not the dQ
        # writer would run the dK/dV kernel, which adds no dQ.
        if self.one_pass and self.gluon != self.dq_writer:
            raise ValueError(f"a one-pass backward runs the Gluon dQ-writer kernel or the tl kernel; got gluon="
                             f"{self.gluon}, dq_writer={self.dq_writer}")
        if self.dq_writer and not self.one_pass:
            raise ValueError("the dQ-writer kernel is a one-pass backward: dq_writer needs one_pass")
        if self.head_section != 1 and not (self.ordered and self.dq_writer):
            raise ValueError(f"head_section is the ordered dQ writer's: a pass without it takes 1; got "
                             f"{self.head_section}")

    @property
    def lists(self) -> TileKey:
        return (self.tile.block_m, self.tile.block_n, self.by_key)


@dataclass(frozen=True)
class AttentionPlan:
    forward: ForwardPass
    dq: BackwardPass | None  # None: the one-pass backward (dQ added by the dK/dV pass, ``dkdv.one_pass``)
    dkdv: BackwardPass
    side_stream: bool  # the dQ pass runs on a side stream, concurrently with dK/dV

    def list_tiles(self, forward: bool = True, backward: bool = True) -> list[TileKey]:
        """The block lists the planned passes read, each once."""
        passes = [self.dkdv] + ([self.dq] if self.dq is not None else [])
        keys = ([self.forward.lists] if forward else []) + ([p.lists for p in passes] if backward else [])
        return list(dict.fromkeys(keys))

    def check_head_dim(self, head_dim: int, itemsize: int) -> None:
        """Raise ValueError where a pass this plan runs as its Gluon kernel cannot run at ``head_dim`` with inputs
        of ``itemsize`` bytes (:func:`mmsparse.attention.config.gluon_tile_problem`): a config made for another
        head dim (``use_tuning``) is refused with the reason before anything compiles."""
        check_passes((("fwd", self.forward), ("dq", self.dq), ("dkdv", self.dkdv)), head_dim, itemsize)

    def kernels(self) -> dict[str, str]:
        """Which kernel each pass runs: ``{"forward": "gluon" or "tl" (+ "-split"), "dq": ..., "dkdv": ...}``; the
        one-pass backward has ``"dq": "one-pass"`` (added by the dK/dV kernel), and ``"dkdv": "gluon-dq-writer"`` where
        that is the dQ-writer kernel (``"gluon-dq-writer-ordered"`` with its adds in order: deterministic)."""
        fwd = "gluon" if self.forward.gluon else "tl-split" if self.forward.n_splits > 1 else "tl"
        dq = "one-pass" if self.dq is None else "gluon" if self.dq.gluon else "tl"
        dkdv = "gluon" if self.dkdv.gluon else "tl"
        if self.dkdv.dq_writer:
            dkdv = "gluon-dq-writer-ordered" if self.dkdv.ordered else "gluon-dq-writer"
        return {"forward": fwd, "dq": dq, "dkdv": dkdv}


@functools.lru_cache(maxsize=1024)
def plan_attention(
    config: KernelConfig, batch: int, num_heads: int, num_kv_heads: int, seq_q: int, seq_k: int,
    device: torch.device, sample_len: int | None = None, dropout: bool = False, sms: int | None = None,
    deterministic: bool = True, longest_first: bool = False,
) -> AttentionPlan:
    """The plan of a call with q ``[batch, num_heads, seq_q, D]`` over k/v ``[batch, num_kv_heads, seq_k, D]`` on
    ``device``, with the tiles of ``config`` (:func:`mmsparse.attention.config.kernel_config` of D, dtype and device).

    Args:
        sample_len: tokens per sample of a pack on average (None: not a pack): short samples take their own
            forward tile.
        dropout: dropout is on (the Gluon kernels have none: their passes run the tl kernels at the same tiles).
        sms: the GPU's multiprocessors (None: ``device``'s), for a tool that plans for a GPU it does not run on
            (with :func:`mmsparse.attention.config.cuda_kernel_config`).
        deterministic: False allows the one-pass backward (the dK/dV kernel also adds dQ by atomics, with no dQ
            pass and no side stream): the Gluon dQ-writer kernel at ``config.gluon_dq_writer`` where set and the
            dK/dV pass is Gluon, without dropout, else the tl one at ``config.one_pass_tile()``; planned below
            ``config.dq_writer_max_keys`` keys for the dQ-writer kernel (every length by default), below
            ``config.one_pass_max_keys`` for the tl one, from where it was slower than the two-pass backward on
            every config measured.
            True: the two passes (bitwise repeatable), or the dQ-writer kernel with its adds in order (bitwise
            repeatable too) where it runs, over packs of samples of at most ``config.ordered_samples`` tokens on
            average, over a mask whose programs it launches longest list first from ``config.short_keys`` keys and
            below ``config.ordered_max_keys`` or, with ``config.ordered_dq_writer``, any call.
        longest_first: the ordered dQ writer launches this mask's programs longest list first (a bit mask without
            the causal flag: :func:`mmsparse.mask.add_order.adds_shortest_first`); False where unknown.

    Returns:
        :class:`AttentionPlan`. Kept per arguments: a small call is bound by host work.
    """
    tile = config.forward_tile(seq_q, seq_k, sample_len)
    forward = forward_pass(tile, config.decode_max_q, batch, num_heads, num_kv_heads, seq_q, seq_k, device, dropout,
                           sms)
    dq, dkdv, side_stream = backward_passes(config, seq_k, device, dropout, deterministic, sample_len, longest_first)
    return AttentionPlan(forward=forward, dq=dq, dkdv=dkdv, side_stream=side_stream)


def backward_passes(config: KernelConfig, seq_k: int, device: torch.device, dropout: bool, deterministic: bool,
                    sample_len: int | None = None,
                    longest_first: bool = False) -> tuple[BackwardPass | None, BackwardPass, bool]:
    """(dQ pass or None for the one pass, dK/dV pass, side stream) of :func:`plan_attention`: they depend on the
    key count and the samples' length only through the config's thresholds, so a traced call decides them once for
    every length on the same side of those (:func:`plan_call`)."""
    if config.runs_one_pass(seq_k, deterministic, dropout, sample_len, longest_first):
        one_pass = BackwardPass(config.one_pass_kernel_tile(dropout, seq_k, sample_len),
                                config.one_pass_runs_dq_writer(dropout), True, one_pass=True,
                                dq_writer=config.one_pass_runs_dq_writer(dropout), ordered=deterministic,
                                head_section=config.ordered_head_section if deterministic else 1)
        return None, one_pass, False
    dq_tile, dkdv_tile = config.dq_tile(seq_k, dropout), config.dkdv_tile(dropout)
    return (BackwardPass(dq_tile, dq_tile.gluon and not dropout, False),
            BackwardPass(dkdv_tile, dkdv_tile.gluon and not dropout, True),
            device.type == "cuda" and not config.few_keys(seq_k))


def forward_pass(tile: Tile, decode_max_q: int, batch: int, num_heads: int, num_kv_heads: int, seq_q: int,
                 seq_k: int, device: torch.device, dropout: bool, sms: int | None = None) -> ForwardPass:
    """The forward's launch at ``tile``: the GQA pack of a short query block, the grid and the key-list splits,
    which follow every length (a traced call works them out when its op runs: :func:`attention_plan_of`)."""
    group = num_heads // num_kv_heads
    pack_rows = gqa_pack_rows(group, seq_q, tile.block_m, decode_max_q)
    if pack_rows:
        block_m, num_warps = pack_rows, max(tile.num_warps, pack_rows // 16)
        row_blocks, bh_programs = 1, batch * num_kv_heads
    else:
        block_m, num_warps = tile.block_m, tile.num_warps
        row_blocks, bh_programs = cdiv(seq_q, tile.block_m), batch * num_heads
    n_splits = num_splits(row_blocks * bh_programs, cdiv(seq_k, tile.block_n), device, sms)
    return ForwardPass(tile, tile.gluon and not dropout and n_splits == 1, block_m, num_warps, pack_rows,
                       row_blocks, bh_programs, n_splits)


@dataclass(frozen=True)
class CallPlan:
    """The frozen plan of one call, everything about it that its lengths do not change: each pass's tile and
    kernel, the mask's kind and the thresholds' outcomes. Made once (in eager, with the call's launches; traced,
    when the graph is traced) and read by the forward, by the backward and by the block-list builder; it crosses
    the custom ops as its :meth:`text`, by value (the scale and dropout probability travel beside it, as floats
    a graph may hold as symbols). What follows each length (the forward's grid and key-list splits) is worked out
    from it by :func:`attention_plan_of`, kept per shapes."""

    forward: Tile
    dq: BackwardPass | None  # None: the one-pass backward
    dkdv: BackwardPass
    side_stream: bool
    mode: int  # the mask's kind (kernels.constants.MASK_*)
    causal: bool
    window: int | None
    num_segments: int
    dropout: bool  # the Gluon kernels have none: with it their passes run the tl kernels at the same tiles
    use_tma: bool
    compact_bytes: int
    decode_max_q: int

    def list_tiles(self, forward: bool = True, backward: bool = True) -> list[TileKey]:
        """The block lists the planned passes read, each once."""
        passes = [self.dkdv] + ([self.dq] if self.dq is not None else [])
        keys = ([(self.forward.block_m, self.forward.block_n, False)] if forward else [])
        keys += [p.lists for p in passes] if backward else []
        return list(dict.fromkeys(keys))

    @property
    def text(self) -> str:
        """The plan's whole value as JSON (:func:`call_plan_from_text` inverts it): what a custom op takes."""
        return _plan_text(self)


_TILE_FIELDS = tuple(f.name for f in fields(Tile))
_PLAN_SCALARS = ("side_stream", "mode", "causal", "window", "num_segments", "dropout", "use_tma",
                 "compact_bytes", "decode_max_q")


def _plan_text(plan: CallPlan) -> str:
    # The plan's value as nested pairs of names and constants: what a traced graph can hand to _text_of.
    def tile(t: Tile) -> tuple:
        return tuple((name, getattr(t, name)) for name in _TILE_FIELDS)

    def step(p: BackwardPass | None) -> tuple | None:
        return None if p is None else (("tile", tile(p.tile)), ("gluon", p.gluon), ("by_key", p.by_key),
                                       ("one_pass", p.one_pass), ("dq_writer", p.dq_writer), ("ordered", p.ordered),
                                       ("head_section", p.head_section))

    return _text_of((("forward", tile(plan.forward)), ("dq", step(plan.dq)), ("dkdv", step(plan.dkdv)),
                     *((name, getattr(plan, name)) for name in _PLAN_SCALARS)))


@assume_constant_result  # traced, run as Python on the constants: Dynamo does not trace json
def _text_of(pairs: tuple) -> str:
    def value(v: object) -> object:
        if isinstance(v, tuple):
            return {name: value(item) for name, item in v}
        return v

    return json.dumps(value(pairs), sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=1024)
def call_plan_from_text(text: str) -> CallPlan:
    """The :class:`CallPlan` whose :attr:`CallPlan.text` is ``text`` (one object per text, so that launches kept
    per plan hit by identity as well as by value)."""
    try:
        value = json.loads(text)

        def pass_of(step: dict | None) -> BackwardPass | None:
            return None if step is None else BackwardPass(Tile(**step["tile"]), bool(step["gluon"]),
                                                          bool(step["by_key"]), bool(step["one_pass"]),
                                                          bool(step["dq_writer"]), bool(step["ordered"]),
                                                          int(step.get("head_section", 1)))

        dkdv = pass_of(value["dkdv"])
        if dkdv is None:
            raise ValueError("no dK/dV pass")
        return CallPlan(forward=Tile(**value["forward"]), dq=pass_of(value["dq"]), dkdv=dkdv,
                        **{name: value[name] for name in _PLAN_SCALARS})
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not the text of an mmsparse call plan (a graph made by another version of mmsparse?): "
                         f"{text[:200]!r} ({err})") from err


def plan_call(config: KernelConfig, seq_q: int, seq_k: int, device: torch.device, sample_len: int | None,
              dropout: bool, deterministic: bool, mode: int, causal: bool, window: int | None,
              num_segments: int) -> CallPlan:
    """The :class:`CallPlan` of a call (the lengths may be a traced graph's symbols: they are only compared with
    the config's thresholds, which the graph then guards on)."""
    dq, dkdv, side_stream = backward_passes(config, seq_k, device, dropout, deterministic, sample_len,
                                            not adds_shortest_first(mode, causal))
    return CallPlan(forward=config.forward_tile(seq_q, seq_k, sample_len), dq=dq, dkdv=dkdv,
                    side_stream=side_stream, mode=mode, causal=causal, window=window, num_segments=num_segments,
                    dropout=dropout, use_tma=config.use_tma,
                    compact_bytes=config.compact_bytes, decode_max_q=config.decode_max_q)


@functools.lru_cache(maxsize=1024)
def attention_plan_of(plan: CallPlan, batch: int, num_heads: int, num_kv_heads: int, seq_q: int, seq_k: int,
                      device: torch.device) -> AttentionPlan:
    """The :class:`AttentionPlan` of a frozen plan at these shapes (the forward's grid and splits), kept."""
    forward = forward_pass(plan.forward, plan.decode_max_q, batch, num_heads, num_kv_heads, seq_q, seq_k, device,
                           plan.dropout)
    return AttentionPlan(forward=forward, dq=plan.dq, dkdv=plan.dkdv, side_stream=plan.side_stream)


def check_passes(passes: tuple, head_dim: int, itemsize: int) -> None:
    """:meth:`AttentionPlan.check_head_dim` of ``(kind, pass or None)`` pairs; a "dkdv" pass that is the dQ-writer
    kernel is checked as that kernel."""
    for kind, step in passes:
        if kind == "dkdv" and step is not None and step.dq_writer:
            kind = "dq_writer"
        problem = step is not None and step.gluon and gluon_tile_problem(kind, step.tile, head_dim_pad(head_dim),
                                                                         itemsize)
        if problem:
            raise ValueError(f"mmsparse: {problem}; give this head dim its own tiles (mmsparse.tuning."
                             f"default_config) or a tl tile (gluon_stages=0)")


_PACK_MAX_ROWS = 64


def gqa_pack_rows(group: int, seq_q: int, block_m: int, decode_max_q: int = KernelConfig.decode_max_q) -> int:
    """Rows of the packed GQA tile for a short query block (decoding), 0 for no packing: the group's
    ``group * seq_q`` query rows rounded up to a power of two, at least the decode tile's rows, at most 64
    (more rows would cost registers that a separate program per head does not need)."""
    rows = group * seq_q
    if group == 1 or seq_q > min(block_m, decode_max_q) or rows > _PACK_MAX_ROWS:
        return 0
    return max(block_m, 1 << (rows - 1).bit_length())


def num_splits(programs: int, key_blocks: int, device: torch.device, sms: int | None = None) -> int:
    """How many programs share one row block's key list (flash-decoding): only when the grid is too small to
    fill the GPU (a few queries over a long cache), each split keeping at least 4 key blocks. Through the
    interpreter the bar is 8 programs and 1 block, so that the CPU tests exercise splits and the combine.
    ``sms``: the GPU's multiprocessors (None: ``device``'s)."""
    if device.type == "cuda":
        target, min_blocks = 2 * (sms if sms is not None else sm_count(device)), 4
    else:
        target, min_blocks = 8, 1
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), key_blocks // min_blocks))


def sm_count(device: torch.device) -> int:
    """The CUDA ``device``'s multiprocessors (``runtime.multiprocessors`` keeps the count per device)."""
    return device_multiprocessors(cuda_index(device))
