"""Tile sizes and launch settings, from a pre-tuned table keyed on head dim, dtype and device kind.

Nothing here depends on the sequence or segment lengths, so a new length never triggers a new compile or a
tuning sweep. The block metadata is built for exactly these tiles.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from ..mask.bit_lists import COMPACT_BYTES
from ..runtime.traced import assume_constant_result
from .dispatch import hopper_gluon_available

TURN_SCHEMES = ("mbarrier", "named_release")  # Tile.turns
EVERY_LENGTH = 1 << 62  # a key-count threshold no call reaches: the path runs at every length
# The KernelConfig fields that switch a path, which use_tuning sets on every call's config.
THRESHOLDS = ("decode_max_q", "short_keys", "short_samples", "compact_bytes", "one_pass_max_keys", "dq_writer_max_keys",
              "ordered_samples", "ordered_max_keys")


@dataclass(frozen=True)
class Tile:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int = 4
    num_stages: int = 2
    # > 0 runs the Gluon Hopper kernel of the pass (kernels/gluon/forward.py, dkdv.py, dq.py) at this
    # tile with that many stages where it applies; num_warps and num_stages stay the tl kernel's, which runs the
    # tile elsewhere (dropout, split key lists).
    gluon_stages: int = 0
    # The Gluon forward's two consumer warpgroups take turns to issue their matmuls; a backward tile may not ask
    # for it (KernelConfig refuses it): the dQ and dK/dV kernels have no turns.
    pingpong: bool = False
    # How the Gluon forward's warpgroups take turns with pingpong (gluon_launch.TURNS): "mbarrier" (a turn
    # mbarrier each, stages released apart: two arrives a key block) or "named_release" (hardware named barriers
    # for the turns and the releases: no mbarrier arrive in the consumer loop).
    turns: str = "mbarrier"

    def __post_init__(self) -> None:
        _check_block("block_m", self.block_m)
        _check_block("block_n", self.block_n)
        _check_warps(self.num_warps)
        _check_num_stages(self.num_stages)
        _check_gluon_stages(self.gluon_stages)
        _check_bool("Tile.pingpong", self.pingpong)
        if self.turns not in TURN_SCHEMES:
            raise ValueError(f"Tile.turns must be one of {list(TURN_SCHEMES)}; got {self.turns!r}")

    @property
    def gluon(self) -> bool:
        return self.gluon_stages > 0


@dataclass(frozen=True)
class KernelConfig:
    fwd: Tile
    bwd_dkdv: Tile  # block_n: the key block a program owns; block_m: the query tiles it walks
    bwd_dq: Tile  # block_m: the query block a program owns; block_n: the key tiles it walks
    decode: Tile  # the forward's tile when seq_q <= DECODE_MAX_Q (decoding)
    use_tma: bool = True  # tiles through tensor descriptors (TMA on Hopper); pointer loads otherwise
    fwd_short: Tile | None = None  # the forward's tile over fewer than SHORT_KEYS keys, if not fwd
    bwd_dq_short: Tile | None = None  # the dQ pass's tile over fewer than SHORT_KEYS keys, if not bwd_dq
    fwd_short_samples: Tile | None = None  # the forward's tile for packs of samples of <= SHORT_SAMPLES tokens
    # The tl one-pass backward's tile (deterministic=False: the tl dK/dV kernel adds dQ by atomics), if not
    # bwd_dkdv's; where the dQ-writer kernel runs (gluon_dq_writer), the tl one runs only with dropout.
    # block_n: the key block a program owns; block_m: the query tiles it walks.
    bwd_one_pass: Tile | None = None
    # The warp-specialised one-pass backward's tile (kernels/gluon/bwd_dq_writer.py: two MMA warpgroups, a producer
    # warp and a dQ writer warp; block_n 128: GLUON_DQ_WRITER). Where set, bwd_dkdv is a Gluon tile and there is no
    # dropout, the one-pass backward runs it rather than the tl kernel at bwd_one_pass. None: off (by default at head
    # dims other than GLUON_DQ_WRITER_HEAD_DIMS).
    gluon_dq_writer: Tile | None = None
    # The dQ-writer kernel's tile over short_keys keys or more, except for packs of samples of up to short_samples
    # tokens (GLUON_DQ_WRITER_LONG: 128 query rows a step). None: gluon_dq_writer's everywhere.
    gluon_dq_writer_long: Tile | None = None
    # The tl dK/dV kernel's tile with dropout (no Gluon kernel has it), where bwd_dkdv is a Gluon tile the tl kernel
    # runs poorly: at D=256 the Gluon kernel's 64 keys by 64 rows spill in the tl kernel. None: bwd_dkdv's.
    bwd_dkdv_dropout: Tile | None = None
    # The tl dQ kernel's tile with dropout, where bwd_dq is a Gluon tile: at D=256 the Gluon dQ tile (128 x 32, 8
    # warps) ran the tl kernel 0.95x as fast as the tl table's. None: bwd_dq's (bwd_dq_short's over few keys).
    bwd_dq_dropout: Tile | None = None
    # Thresholds that switch a path (defaults below): decoding's tile at most this many queries; short key
    # lists' tiles (and no side stream) below this many keys; the short-samples tile up to this mean sample length;
    # block lists packed end to end (CSR) when their fixed slots would pass this many bytes.
    decode_max_q: int = 16
    short_keys: int = 2048
    short_samples: int = 4096
    compact_bytes: int = COMPACT_BYTES
    # deterministic=False runs the one-pass backward below this many keys, the two-pass one from there, where the
    # two passes were faster (docs/performance.md, "The tile tables' reasons"); where that one pass is the dQ-writer
    # kernel (gluon_dq_writer, no dropout), below dq_writer_max_keys instead: it beat the two passes at every length
    # measured (13k-64k keys at D=64), so by default it runs at every length.
    one_pass_max_keys: int = 2048
    dq_writer_max_keys: int = EVERY_LENGTH
    # deterministic=True runs the dQ-writer kernel too (where it runs: gluon_dq_writer, no dropout, below
    # dq_writer_max_keys keys), its adds into each query block in a fixed order, each waiting for the one before
    # (mask.add_order), instead of the two passes: over packs of samples of at most ordered_samples tokens on
    # average; over masks whose programs it launches longest list first (a bit mask without the causal flag, not a
    # pack) from short_keys keys and below ordered_max_keys (0: never); everywhere with ordered_dq_writer. Over packs
    # it beat the two passes on samples of 128 and 1,024 tokens (1.03-1.42x) and lost at 2,048 (0.90x at D=128,
    # 0.99x at D=64) and 4,096 (0.85-0.92x). Launched longest first, in sections of ordered_head_section query
    # heads, it ran 0.99-1.12x the two passes on five masks of 13k-43k tokens at D=128 and D=64
    # (benchmarks/results/h200/ordered_longest_first.md); launched shortest first (the causal flag, segment codes)
    # it lost on the cyclic and transfusion masks (docs/performance.md, "Backward"). It holds dQ as a float32 sum
    # (1.5x the two passes' peak memory at D=128, as deterministic=False does).
    ordered_samples: int = 1024
    ordered_max_keys: int = EVERY_LENGTH
    ordered_dq_writer: bool = False
    # Where its programs launch longest list first, the ordered dQ writer's programs take each key block in turn
    # for a section of consecutive (batch, KV head)s, as many as hold this many query heads (this over the GQA
    # group, at least 1), instead of a (batch, KV head)'s key blocks one after the other, and rank their adds in
    # groups of as many rows fewer: the key blocks of one head that reach a query block at the same step then run
    # on fewer multiprocessors at once, and wait in shorter chains. 1: one head after the other; up to
    # MAX_ORDERED_HEAD_SECTION. On an H200 sections of 4 ran the ordered writer 0.95-1.12x the two passes without
    # GQA, where one head after the other ran 0.80-1.05x; with GQA groups of 4, one KV head a section ran
    # 1.03-1.07x and four 0.96-1.06x (benchmarks/results/h200/ordered_longest_first.md).
    ordered_head_section: int = 4

    def __post_init__(self) -> None:
        for name in _TILE_FIELDS:
            _check_tile(name, getattr(self, name), optional=name in _OPTIONAL_TILES)
        _check_bool("KernelConfig.use_tma", self.use_tma)
        _check_bool("KernelConfig.ordered_dq_writer", self.ordered_dq_writer)
        _check_head_section(self.ordered_head_section)
        for name in THRESHOLDS:
            check_threshold(f"KernelConfig.{name}", name, getattr(self, name))
        for name, rows in _GLUON_ROWS.items():
            _check_gluon_rows(name, getattr(self, name), rows)
        backward = {"bwd_dkdv": self.bwd_dkdv, "bwd_dq": self.bwd_dq, "bwd_dq_short": self.bwd_dq_short,
                    "bwd_one_pass": self.bwd_one_pass,
                    "gluon_dq_writer": self.gluon_dq_writer, "gluon_dq_writer_long": self.gluon_dq_writer_long,
                    "bwd_dkdv_dropout": self.bwd_dkdv_dropout,
                    "bwd_dq_dropout": self.bwd_dq_dropout}
        for name, tile in backward.items():
            if tile is not None and tile.pingpong:
                # said when the config is made rather than ignored: no backward kernel has ping-pong turns
                raise ValueError(f"KernelConfig.{name} has pingpong=True, but only the Gluon forward takes ping-pong "
                                 f"turns; give the backward tiles pingpong=False")
        for name, tile in (("bwd_dkdv_dropout", self.bwd_dkdv_dropout), ("bwd_dq_dropout", self.bwd_dq_dropout)):
            if tile is not None and tile.gluon:
                raise ValueError(f"KernelConfig.{name} is a tl kernel's tile with dropout, which no Gluon kernel "
                                 f"has: give it gluon_stages=0; got {tile}")
        for name in ("gluon_dq_writer", "gluon_dq_writer_long"):
            tile = getattr(self, name)
            if tile is not None and not tile.gluon:
                raise ValueError(f"KernelConfig.{name} is the Gluon dQ-writer kernel's tile: it needs gluon_stages "
                                 f"(2 or more); got {tile}. None turns it off")

    def forward_tile(self, seq_q: int, seq_k: int, sample_len: int | None = None) -> Tile:
        """A few queries (decoding) get short query tiles: a 128-row tile would compute 127 padding rows. Few keys
        get ``fwd_short``: the Gluon forward's fixed cost per program (descriptors, barriers, warp roles) is not
        repaid by short key lists. A pack of short samples (``sample_len`` tokens each on average) gets
        ``fwd_short_samples``: its rows' lists are a few partial tiles, and narrower key tiles waste less."""
        if seq_q <= self.decode_max_q:
            return self.decode
        if self.fwd_short_samples is not None and self.short_samples_pack(sample_len):
            return self.fwd_short_samples
        return _by_length(self.fwd, self.fwd_short, seq_k, self)

    def dq_tile(self, seq_k: int, dropout: bool = False) -> Tile:
        """The dQ pass's tile: ``bwd_dq_dropout`` with dropout where set; else ``bwd_dq_short`` over few keys, for
        the same reason as the forward's, and ``bwd_dq``."""
        if dropout and self.bwd_dq_dropout is not None:
            return self.bwd_dq_dropout
        return _by_length(self.bwd_dq, self.bwd_dq_short, seq_k, self)

    def dkdv_tile(self, dropout: bool = False) -> Tile:
        """The dK/dV pass's tile: ``bwd_dkdv_dropout`` with dropout where set, else ``bwd_dkdv``."""
        return self.bwd_dkdv_dropout if dropout and self.bwd_dkdv_dropout is not None else self.bwd_dkdv

    def one_pass_tile(self) -> Tile:
        """The one-pass backward's tile: ``bwd_one_pass``, else ``bwd_dkdv``'s sizes."""
        return self.bwd_one_pass if self.bwd_one_pass is not None else self.bwd_dkdv

    def one_pass_runs_dq_writer(self, dropout: bool = False) -> bool:
        """The one-pass backward is the warp-specialised Gluon dQ-writer kernel, its only Gluon kernel: the config
        has its tile (``gluon_dq_writer``), the dK/dV pass is Gluon, and no dropout (no Gluon kernel has it)."""
        return self.gluon_dq_writer is not None and self.bwd_dkdv.gluon and not dropout

    def one_pass_kernel_tile(self, dropout: bool = False, seq_k: int | None = None,
                             sample_len: int | None = None) -> Tile:
        """The tile the one-pass backward runs at over ``seq_k`` keys (None: few) and samples of ``sample_len``
        tokens (None: not a pack): :meth:`dq_writer_tile` where :meth:`one_pass_runs_dq_writer`, elsewhere the tl
        kernel's :meth:`one_pass_tile`."""
        if self.gluon_dq_writer is not None and self.one_pass_runs_dq_writer(dropout):
            return self.dq_writer_tile(seq_k, sample_len)
        return self.one_pass_tile()

    def dq_writer_tile(self, seq_k: int | None = None, sample_len: int | None = None) -> Tile | None:
        """The dQ-writer kernel's tile: ``gluon_dq_writer_long`` where set, over ``short_keys`` keys or more and not
        for a pack of short samples (:meth:`short_samples_pack`), else ``gluon_dq_writer``. The longer query steps
        lost there: the lists are a few steps, and a stage's rows take the producer longer to fill."""
        long = self.gluon_dq_writer_long
        if long is None or seq_k is None or self.few_keys(seq_k) or self.short_samples_pack(sample_len):
            return self.gluon_dq_writer
        return long

    def short_samples_pack(self, sample_len: int | None) -> bool:
        """A pack (``sample_len``: its tokens per sample on average; None: not a pack) of samples of at most
        ``short_samples`` tokens."""
        return sample_len is not None and sample_len <= self.short_samples

    def one_pass(self, seq_k: int) -> bool:
        """A backward allowed to be non-deterministic runs in one pass over this many keys."""
        return seq_k < self.one_pass_max_keys

    def runs_one_pass(self, seq_k: int, deterministic: bool, dropout: bool = False,
                      sample_len: int | None = None, longest_first: bool = False) -> bool:
        """The backward over ``seq_k`` keys (of samples of ``sample_len`` tokens on average in a pack; None: not
        a pack) runs in one pass (dQ added, not owned): where ``deterministic`` is False, below
        ``dq_writer_max_keys`` keys where the one pass is the dQ-writer kernel, else below ``one_pass_max_keys``;
        where it is True, only the dQ-writer kernel with ordered adds, below ``dq_writer_max_keys``, over packs of
        samples of at most ``ordered_samples`` tokens, over a mask whose programs it launches ``longest_first``
        (``mask.add_order.adds_shortest_first``; not a pack) from ``short_keys`` keys and below
        ``ordered_max_keys``, or, with ``ordered_dq_writer``, any call."""
        if deterministic:
            # the pack's length last: a traced graph guards on each comparison it makes
            if not (self.one_pass_runs_dq_writer(dropout) and seq_k < self.dq_writer_max_keys):
                return False
            if self.ordered_dq_writer:
                return True
            if sample_len is None:
                return longest_first and not self.few_keys(seq_k) and seq_k < self.ordered_max_keys
            return sample_len <= self.ordered_samples
        if self.one_pass_runs_dq_writer(dropout):
            return seq_k < self.dq_writer_max_keys
        return self.one_pass(seq_k)

    def few_keys(self, seq_k: int) -> bool:
        """Fewer than ``short_keys`` keys: a call this short is bound by host work and fixed costs per program."""
        return seq_k < self.short_keys


def _by_length(tile: Tile, short: Tile | None, seq_k: int, config: KernelConfig) -> Tile:
    return short if short is not None and config.few_keys(seq_k) else tile


# The checks of Tile and KernelConfig fields (and of use_tuning's thresholds), one function per rule: a value the
# kernels cannot run is refused when the tile, config or block is made, with what it must be, not at a launch.

MIN_BLOCK = 16  # tl.dot multiplies tiles of at least 16 x 16
MAX_BLOCK = 256  # twice the tables' largest: larger tiles outgrow registers and shared memory at most head dims
MAX_WARPS = 16  # more than any tile here uses (on AMD's 64-wide wavefronts, 16 is a block's most threads)
# The Gluon kernels' fixed block (kernels/gluon: common.BLOCK_M query rows in the forward and dQ, dkdv.BLOCK_N keys
# in dK/dV; two consumer warpgroups of one 64-row wgmma each), here so that a config is checked without Gluon.
GLUON_BLOCK = 128
# The keys of the dK/dV kernel at head dims 129-256 (kernels/gluon/dkdv_d256.BLOCK_N: its warpgroups split the head
# dim of one 64-key block). KernelConfig takes either block in bwd_dkdv; the plan checks it against the head dim
# (gluon_tile_problem).
GLUON_D256_DKDV_BLOCK = 64
_TILE_FIELDS = ("fwd", "bwd_dkdv", "bwd_dq", "decode", "fwd_short", "bwd_dq_short", "fwd_short_samples",
                "bwd_one_pass", "bwd_dkdv_dropout", "gluon_dq_writer", "bwd_dq_dropout",
                "gluon_dq_writer_long")
_OPTIONAL_TILES = frozenset(_TILE_FIELDS[4:])
# The tiles a Gluon kernel runs where they have gluon_stages, and the dimension its fixed block sets: "block_m"
# (query rows) or "block_n" (keys). bwd_one_pass is the tl one-pass kernel's (gluon_dq_writer is the Gluon one's).
_GLUON_ROWS = {"fwd": "block_m", "fwd_short": "block_m", "fwd_short_samples": "block_m", "decode": "block_m",
               "bwd_dq": "block_m", "bwd_dq_short": "block_m", "bwd_dkdv": "block_n", "gluon_dq_writer": "block_n",
               "gluon_dq_writer_long": "block_n"}
# The blocks each of those tiles may have (GLUON_BLOCK where not listed).
_GLUON_BLOCKS = {"bwd_dkdv": (GLUON_BLOCK, GLUON_D256_DKDV_BLOCK)}
_THRESHOLD_UNITS = {"decode_max_q": "queries", "short_keys": "keys", "short_samples": "tokens per sample",
                    "compact_bytes": "bytes", "one_pass_max_keys": "keys", "dq_writer_max_keys": "keys",
                    "ordered_samples": "tokens per sample", "ordered_max_keys": "keys"}


def _check_int(label: str, value: object) -> int:
    """An int (a bool is refused: ``True`` is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int; got {type(value).__name__} {value!r}")
    return value


# The query heads whose programs the ordered dQ writer interleaves at most: each program holds a multiprocessor, and
# each group of ranks holds the programs an H100 or H200 runs at once divided by the section's KV heads.
MAX_ORDERED_HEAD_SECTION = 16


def _check_head_section(value: object) -> None:
    _check_int("KernelConfig.ordered_head_section", value)
    if not 1 <= value <= MAX_ORDERED_HEAD_SECTION:
        raise ValueError(f"KernelConfig.ordered_head_section is the query heads whose (batch, KV head)s' programs the "
                         f"ordered dQ writer takes key block by key block, from 1 (one head after the other) to "
                         f"{MAX_ORDERED_HEAD_SECTION}; got {value}")


def _check_bool(label: str, value: object) -> bool:
    if value is not True and value is not False:
        raise TypeError(f"{label} must be True or False; got {type(value).__name__} {value!r}")
    return value


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _nearest_powers(n: int, low: int, high: int) -> str:
    """The powers of two in ``low..high`` next to ``n``, as a fix: ``"32 or 64"``."""
    if n <= low or n >= high:
        return str(low if n <= low else high)
    below = 1 << (n.bit_length() - 1)
    return f"{below} or {below * 2}"


def _check_block(name: str, value: object) -> None:
    """A tile's rows or keys: tl.arange spans a power of two and tl.dot needs 16 or more; the interpreter crashed
    the process on a negative size."""
    _check_int(f"Tile.{name}", value)
    if not (_power_of_two(value) and MIN_BLOCK <= value <= MAX_BLOCK):
        raise ValueError(f"Tile.{name} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK} (tl.dot multiplies "
                         f"tiles of {MIN_BLOCK} or more, tl.arange spans a power of two); got {value}: use "
                         f"{_nearest_powers(value, MIN_BLOCK, MAX_BLOCK)}")


def _check_warps(value: object) -> None:
    """Triton takes a power of two warps per program."""
    _check_int("Tile.num_warps", value)
    if not (_power_of_two(value) and value <= MAX_WARPS):
        raise ValueError(f"Tile.num_warps must be a power of two from 1 to {MAX_WARPS} (Triton's rule, and no tile "
                         f"here uses more); got {value}: use {_nearest_powers(value, 1, MAX_WARPS)}")


def _check_num_stages(value: object) -> None:
    _check_int("Tile.num_stages", value)
    if value < 1:
        raise ValueError(f"Tile.num_stages must be at least 1 (the tl kernel's software pipeline depth); got {value}")


def _check_gluon_stages(value: object) -> None:
    """Every Gluon kernel holds a stage while the next one loads (their static_assert STAGES >= 2)."""
    _check_int("Tile.gluon_stages", value)
    if value < 0 or value == 1:
        raise ValueError(f"Tile.gluon_stages must be 0 (no Gluon kernel) or at least 2 (the Gluon kernels hold one "
                         f"stage while the next loads); got {value}")


def _check_tile(name: str, value: object, optional: bool) -> None:
    if not isinstance(value, Tile) and not (optional and value is None):
        raise TypeError(f"KernelConfig.{name} must be a mmsparse.tuning.Tile{' or None' if optional else ''}; got "
                        f"{type(value).__name__} {value!r}")


def _check_gluon_rows(name: str, tile: Tile | None, dim: str) -> None:
    """A Gluon tile's fixed dimension is the kernel's block: its launch refuses any other (only on a Hopper GPU)."""
    blocks = _GLUON_BLOCKS.get(name, (GLUON_BLOCK,))
    if tile is None or not tile.gluon or getattr(tile, dim) in blocks:
        return
    what = "query rows" if dim == "block_m" else "keys"
    if len(blocks) == 1:
        takes, give = f"{GLUON_BLOCK} {what} per block", f"{dim}={GLUON_BLOCK}"
    else:  # bwd_dkdv: the D <= 128 kernel's block, or the D=256 kernel's
        takes = f"{GLUON_BLOCK} {what} per block ({GLUON_D256_DKDV_BLOCK} at head dims 129-256)"
        give = f"{dim}={GLUON_BLOCK} (or {GLUON_D256_DKDV_BLOCK} at head dims 129-256)"
    raise ValueError(f"KernelConfig.{name} is a Gluon tile (gluon_stages={tile.gluon_stages}), and the Gluon kernel "
                     f"of that pass takes {takes}; got {dim}={getattr(tile, dim)}. Give it {give}, or gluon_stages=0 "
                     f"for the tl kernel at this tile")


def check_threshold(label: str, name: str, value: object) -> int:
    """A threshold that switches a path (``THRESHOLDS``): an int >= 0, where 0 turns the path off (no decoding
    tile, no short tiles, always packed lists, never one pass). ``label``: how the message names it."""
    unit = _THRESHOLD_UNITS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
        raise error(f"{label} must be an int >= 0, a number of {unit}; got {type(value).__name__} {value!r}")
    return value


# The thresholds' defaults, for the docs and the tools; a config carries its own (use_config changes them).
DECODE_MAX_Q = KernelConfig.decode_max_q
SHORT_KEYS = KernelConfig.short_keys
SHORT_SAMPLES = KernelConfig.short_samples  # tokens per sample: the largest mean measured to gain (1.08x)


# Through the interpreter each tile op is a numpy call: small tiles, and mixed shapes so that the tests
# exercise ragged ends and lists built at different granularities.
_INTERPRETER = KernelConfig(fwd=Tile(32, 16), bwd_dkdv=Tile(16, 32), bwd_dq=Tile(32, 16), decode=Tile(16, 16))


def _cuda_config(head_dim_pad: int, tma: bool, shared_bytes: int) -> KernelConfig:
    """The tl tables of a CUDA GPU: tiles through TMA where ``tma`` (Hopper on), else pointer loads; past D=128 a
    dK/dV tile its blocks' ``shared_bytes`` take."""
    if head_dim_pad <= 64:
        # 64-row forward tiles beat 128 rows; below SHORT_KEYS 32-key tiles skip more ragged partial blocks.
        return KernelConfig(
            fwd=Tile(64, 64, num_warps=4, num_stages=2),
            fwd_short=Tile(64, 32, num_warps=4, num_stages=2),
            bwd_dkdv=Tile(64, 64, num_warps=4, num_stages=3),
            bwd_dq=Tile(64, 64, num_warps=4, num_stages=3),
            decode=Tile(16, 64, num_warps=2, num_stages=3),
            use_tma=tma,
        )
    if head_dim_pad <= 128:
        # The fastest measured of each pass: one warpgroup at 128x64 in the forward, 16x64 with 2 warps decoding,
        # 2 dK/dV stages (dP issued before the exponentials) and 3 dQ stages.
        return KernelConfig(
            fwd=Tile(128, 64, num_warps=4, num_stages=2),
            bwd_dkdv=Tile(64, 64, num_warps=4, num_stages=2),
            bwd_dq=Tile(64, 64, num_warps=4, num_stages=3),
            decode=Tile(16, 64, num_warps=2, num_stages=3),
            use_tma=tma,
        )
    wide = wide_dkdv_tile(shared_bytes, tma)
    return KernelConfig(
        fwd=Tile(64, 64, num_warps=4, num_stages=2),
        decode=Tile(16, 64, num_warps=4, num_stages=2),
        bwd_dkdv=wide,
        bwd_dq=Tile(64, 32, num_warps=4, num_stages=1),
        bwd_one_pass=WIDE_ONE_PASS_TMA if tma else wide,
        use_tma=tma,
    )


# The tl dK/dV tile at head dims 129-256 by the shared memory a block of the GPU may take, largest first: (bytes,
# tile). Two 64 x 256 fp32 accumulators (dK and dV) take 256 registers a thread in 4 warps, so every tile has 8.
# Bytes are what Triton allots the kernel in bf16, compiled for sm_90 with TMA for the first (197,648 B) and for sm_80
# and sm_89 with pointer loads for the others (163,840 and 90,112 B; none spills there). On an H200 (vlm32k_d256,
# the tl kernels alone, docs/tuning.md) 64 x 64 with 2 stages ran the backward at 267 TF/s against 111 for the
# 32 x 64 tile of 4 warps it replaces (2,888 B of spills; 114,688 B with pointer loads, past an sm_89's 101,376).
WIDE_DKDV_TILES = (
    (197_648, Tile(64, 64, num_warps=8, num_stages=2)),  # with TMA (sm_90 and later): a Hopper's 232,448 B
    (163_840, Tile(64, 64, num_warps=8, num_stages=1)),  # an A100's 166,912 B
    (0, Tile(16, 64, num_warps=8, num_stages=1)),  # 90,112 B: an sm_86 or sm_89's 101,376 B
)
# The tl one-pass dK/dV kernel there, through TMA: at the dK/dV tile above it needs 263,440 B (its dQ adds).
WIDE_ONE_PASS_TMA = Tile(32, 64, num_warps=4, num_stages=1)
# A block's shared memory by compute capability, where the device is not asked (cuda_kernel_config's default):
# the sm_80 and sm_87 parts and the data-centre parts from sm_90 on take more than the others.
_SHARED_BYTES_BY_CAPABILITY = {(8, 0): 166_912, (8, 7): 166_912, (9, 0): 232_448, (10, 0): 232_448}
_OTHER_GPU_SHARED_BYTES = 101_376  # sm_86, sm_89 and sm_120 parts


def wide_dkdv_tile(shared_bytes: int, tma: bool) -> Tile:
    """The tl dK/dV tile of :data:`WIDE_DKDV_TILES` for a GPU whose blocks may take ``shared_bytes`` of shared
    memory (``tma``: tiles load through TMA, which the first needs)."""
    for needs, tile in WIDE_DKDV_TILES[0 if tma else 1:]:
        if shared_bytes >= needs:
            return tile
    return WIDE_DKDV_TILES[-1][1]


@dataclass(frozen=True)
class Settings:
    """What ``use_config`` and ``use_tuning`` set for one thread's calls: tiles (None: the device's table),
    thresholds and the default backward. Interned (:func:`intern_settings`): one object per value, so that a
    compiled graph guards on one object per value; a call carries the object to its backward however the
    thread's settings change meanwhile. Across a graph boundary (the custom ops, ``torch.export``) it travels as
    ``text``, its whole value as JSON (:func:`settings_from_text`), never as a handle valid in one process only."""

    config: KernelConfig | None = None
    thresholds: tuple[tuple[str, int], ...] = ()
    deterministic: bool = True
    text: str = field(default="", compare=False)


def _settings_json(settings: Settings) -> str:
    config = None if settings.config is None else asdict(settings.config)  # nested tiles as dicts too
    value = {"config": config, "thresholds": [list(pair) for pair in settings.thresholds],
             "deterministic": settings.deterministic}
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


DEFAULT_SETTINGS = Settings(text=_settings_json(Settings()))
_interned: dict[Settings, Settings] = {DEFAULT_SETTINGS: DEFAULT_SETTINGS}
_intern_lock = threading.Lock()
_thread = threading.local()  # .settings: the thread's Settings (use_config), DEFAULT_SETTINGS where unset


def intern_settings(settings: Settings) -> Settings:
    """The one interned object equal to ``settings``, with its ``text``. Kept for the process: the values a
    program uses are few."""
    with _intern_lock:
        known = _interned.get(settings)
        if known is None:
            known = _interned[settings] = replace(settings, text=_settings_json(settings))
        return known


@functools.lru_cache(maxsize=64)
def with_threshold(settings: Settings, name: str, value: int) -> Settings:
    """The interned ``settings`` with the threshold ``name`` (of ``THRESHOLDS``) set to ``value``, over any value
    they held for it. Kept per arguments: a context-parallel call asks each time."""
    check_threshold(name, name, value)
    thresholds = tuple(pair for pair in settings.thresholds if pair[0] != name) + ((name, value),)
    return intern_settings(replace(settings, thresholds=thresholds))


@functools.lru_cache(maxsize=256)
def settings_from_text(text: str) -> Settings:
    """The interned settings whose :attr:`Settings.text` is ``text`` (a custom op, or a graph exported by another
    process, gets the text)."""
    try:
        value = json.loads(text)
        config = value["config"]
        if config is not None:
            config = KernelConfig(**{name: Tile(**field_value) if isinstance(field_value, dict) else field_value
                                     for name, field_value in config.items()})
        thresholds = tuple((str(name), int(number)) for name, number in value["thresholds"])
        settings = Settings(config, thresholds, bool(value["deterministic"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not the text of mmsparse settings (a graph exported by another version of mmsparse?): "
                         f"{text[:200]!r} ({err})") from err
    return intern_settings(settings)


def current_settings() -> Settings:
    """This thread's settings now: the innermost ``use_config`` block's, else the defaults. A call reads them once,
    when its forward runs, and carries them to its backward."""
    return getattr(_thread, "settings", DEFAULT_SETTINGS)


def default_deterministic() -> bool:
    """Whether a call that passes no ``deterministic`` argument gets the deterministic two-pass backward: True,
    unless set otherwise by an enclosing ``use_config(deterministic=...)`` of this thread."""
    return current_settings().deterministic


def kernel_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                  settings: Settings | None = None) -> KernelConfig:
    """The tiles and thresholds for one call under ``settings`` (None: this thread's now, :func:`current_settings`).
    ``mmsparse.tuning.use_tuning`` overrides them."""
    settings = current_settings() if settings is None else settings
    if settings.config is not None:
        cfg = settings.config
    elif device.type != "cuda":
        cfg = _INTERPRETER
    elif torch.compiler.is_compiling():
        cfg = _TRACED_CONFIGS[_traced_config_slot(head_dim_pad(head_dim), dtype, cuda_index(device))]
    else:
        cfg = _cached_cuda_config(head_dim_pad(head_dim), dtype, cuda_index(device))
    return _with_thresholds(cfg, settings.thresholds) if settings.thresholds else cfg


# The CUDA configs a traced graph has read, by slot. Dynamo refuses to trace the lookup inside an
# autograd.Function (it queries the device and finds Triton's Gluon with importlib), and a config handed back by
# assume_constant_result itself cannot be read (torch 2.11 cannot guard on its methods): the graph keeps the slot,
# a constant int, and reads the config from this list, which only grows.
_TRACED_CONFIGS: list[KernelConfig] = []


@assume_constant_result
def _traced_config_slot(head_dim_pad: int, dtype: torch.dtype, device_index: int) -> int:
    """The slot in ``_TRACED_CONFIGS`` of :func:`_cached_cuda_config`'s config, run as Python when traced."""
    cfg = _cached_cuda_config(head_dim_pad, dtype, device_index)
    for slot, seen in enumerate(_TRACED_CONFIGS):
        if seen is cfg:
            return slot
    _TRACED_CONFIGS.append(cfg)
    return len(_TRACED_CONFIGS) - 1


@functools.lru_cache(maxsize=64)
def _with_thresholds(cfg: KernelConfig, thresholds: tuple[tuple[str, int], ...]) -> KernelConfig:
    """``cfg`` with other thresholds, one object per combination (launches are kept per config)."""
    return replace(cfg, **dict(thresholds))


def head_dim_pad(head_dim: int) -> int:
    """The head dim rounded up to a power of two (at least 16): the width of the kernels' tiles."""
    return max(16, 1 << (head_dim - 1).bit_length())


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _cached_cuda_config(head_dim_pad: int, dtype: torch.dtype, device_index: int) -> KernelConfig:
    half = dtype in (torch.float16, torch.bfloat16)
    gluon_dims = set(_GLUON_FWD) | ({GLUON_D256_HEAD_DIM} if GLUON_D256_ENABLED else set())
    gluon = half and head_dim_pad in gluon_dims and hopper_gluon_available(device_index)
    return cuda_kernel_config(head_dim_pad, dtype, torch.cuda.get_device_capability(device_index), gluon,
                              shared_bytes=_device_shared_bytes(device_index))


def _device_shared_bytes(device_index: int) -> int | None:
    """The shared memory a block of the device may take (opted in), or None where torch does not say."""
    return getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", None)


HOPPER = (9, 0)  # the compute capability the Gluon kernels are written for


def cuda_kernel_config(head_dim: int, dtype: torch.dtype, capability: tuple[int, int] = HOPPER,
                       gluon: bool = True, gluon_d256: bool | None = None,
                       gluon_d256_dkdv: bool | None = None, gluon_dq_writer: bool | None = None,
                       shared_bytes: int | None = None) -> KernelConfig:
    """The tiles and thresholds of a CUDA GPU of compute ``capability`` (an H100 or H200 by default), with the
    Gluon kernels where ``gluon`` (they run on sm_90 with Triton's Gluon API), without asking a device: for tools
    that model that GPU on a machine without it. A call on a GPU gets :func:`kernel_config` (its device's, and
    ``use_config``'s overrides). ``gluon_d256``: with ``gluon``, head dims 129-256 in half precision run the Gluon
    forward and dQ pass at :data:`GLUON_D256`'s tiles; None: as :data:`GLUON_D256_ENABLED` says.
    ``gluon_d256_dkdv``: with ``gluon_d256`` as well, the dK/dV pass there runs its Gluon kernel
    (``kernels/gluon/dkdv_d256.py``) at ``GLUON_D256["dkdv"]``, else its tl kernel; None: as
    :data:`GLUON_D256_DKDV_ENABLED` says. ``gluon_dq_writer``: with ``gluon``, the one-pass backward at head dims up
    to 128 in half precision runs the warp-specialised dQ-writer kernel (``kernels/gluon/bwd_dq_writer.py``) at
    :data:`GLUON_DQ_WRITER`'s tile; None: at the head dims of :data:`GLUON_DQ_WRITER_HEAD_DIMS` (D=64 and 128).
    ``shared_bytes``: the shared memory a block may take, which picks the tl dK/dV tile past D=128
    (:func:`wide_dkdv_tile`); None: as such a GPU of ``capability`` has. One object per combination of arguments."""
    enabled = GLUON_D256_ENABLED if gluon_d256 is None else gluon_d256
    dkdv = GLUON_D256_DKDV_ENABLED if gluon_d256_dkdv is None else gluon_d256_dkdv
    d_pad = head_dim_pad(head_dim)
    writer = d_pad in GLUON_DQ_WRITER_HEAD_DIMS if gluon_dq_writer is None else gluon_dq_writer
    if shared_bytes is None:
        shared_bytes = _SHARED_BYTES_BY_CAPABILITY.get(capability, _OTHER_GPU_SHARED_BYTES)
    return _cuda_kernel_config(d_pad, dtype, capability, gluon, enabled, dkdv, writer, shared_bytes)


@functools.cache
def _cuda_kernel_config(d_pad: int, dtype: torch.dtype, capability: tuple[int, int], gluon: bool,
                        gluon_d256: bool, gluon_d256_dkdv: bool, gluon_dq_writer: bool,
                        shared_bytes: int) -> KernelConfig:
    cfg = _cuda_config(d_pad, capability[0] >= 9, shared_bytes)  # no TMA before Hopper
    half = dtype in (torch.float16, torch.bfloat16)
    if half and gluon and gluon_d256 and d_pad == GLUON_D256_HEAD_DIM:
        # The forward below SHORT_KEYS keys keeps the tl tile, as at D=128; the one-pass backward stays tl (no
        # gluon_dq_writer), and so does every pass with dropout: the forward at these tiles, dQ at the tl
        # table's (bwd_dq_dropout; 1.05x the backward at the Gluon tile on an H200).
        cfg = replace(cfg, fwd=GLUON_D256["fwd"], fwd_short=cfg.fwd_short or cfg.fwd, bwd_dq=GLUON_D256["dq"],
                      bwd_dq_dropout=cfg.bwd_dq)
        if gluon_d256_dkdv:
            # The Gluon dK/dV kernel has no one pass, and the tl one pass (at the tl dK/dV tile, whose registers
            # it was written for) ran 0.215x the Gluon two passes' speed on the seed's 925 keys (H200,
            # benchmarks/results/h200/one_pass_d256.md): deterministic=False runs the two passes at every length
            # here (use_tuning(one_pass_max_keys=N) brings the tl one pass back). The tl dK/dV kernel with dropout
            # keeps the tl tile too (at the Gluon tile it spilled: 0.91x the tl tile's backward on an H200).
            cfg = replace(cfg, bwd_dkdv=GLUON_D256["dkdv"], bwd_one_pass=cfg.bwd_one_pass or cfg.bwd_dkdv,
                          bwd_dkdv_dropout=cfg.bwd_dkdv, one_pass_max_keys=0)
    if half and d_pad in _GLUON_FWD and gluon:
        # The one-pass backward runs the dQ-writer kernel at gluon_dq_writer where set (plan.plan_attention), else
        # (and with dropout) the tl kernel, which keeps the tl dK/dV tile, whose registers it was written for.
        cfg = replace(cfg, fwd=_GLUON_FWD[d_pad], fwd_short=cfg.fwd_short or cfg.fwd,
                      fwd_short_samples=_GLUON_FWD_SHORT_SAMPLES.get(d_pad),
                      bwd_one_pass=cfg.bwd_one_pass or cfg.bwd_dkdv,
                      bwd_dkdv=_GLUON_DKDV[d_pad], bwd_dq=_GLUON_DQ[d_pad],
                      bwd_dq_short=cfg.bwd_dq if d_pad in _GLUON_DQ_LONG_ONLY else None)
        if gluon_dq_writer and d_pad in GLUON_DQ_WRITER:
            cfg = replace(cfg, gluon_dq_writer=GLUON_DQ_WRITER[d_pad],
                          gluon_dq_writer_long=GLUON_DQ_WRITER_LONG.get(d_pad))
    if dtype == torch.float32:  # twice the bytes per tile: halve the key tiles to stay within shared memory
        cfg = replace(
            cfg,
            fwd=replace(cfg.fwd, block_n=max(16, cfg.fwd.block_n // 2)),
            decode=replace(cfg.decode, block_n=max(16, cfg.decode.block_n // 2), num_stages=2),
            bwd_dkdv=replace(cfg.bwd_dkdv, block_m=max(16, cfg.bwd_dkdv.block_m // 2), num_stages=1),
            bwd_dq=replace(cfg.bwd_dq, block_n=max(16, cfg.bwd_dq.block_n // 2), num_stages=1),
        )
    return cfg


# The Gluon forward (the reasons and timings of each table: docs/performance.md, "The tile tables' reasons"): 128-key
# tiles; ping-pong with named turns and releases at D=128, the fastest there; D=64 gained nothing from ping-pong.
# num_warps and num_stages are the tl kernel's, which runs the tile with dropout or split key lists.
_GLUON_FWD = {
    64: Tile(128, 128, num_warps=8, num_stages=2, gluon_stages=2, pingpong=False),
    128: Tile(128, 128, num_warps=8, num_stages=2, gluon_stages=3, pingpong=True, turns="named_release"),
}
# Packs of short samples: a row block meets a few partial tiles, which 64-key tiles waste less of; their short lists
# keep the turn mbarriers, which beat named turns and releases there.
_GLUON_FWD_SHORT_SAMPLES = {
    128: Tile(128, 64, num_warps=4, num_stages=2, gluon_stages=3, pingpong=True, turns="mbarrier"),
}
# The Gluon dQ pass (kernels/gluon/dq.py): 128 query rows, 64-key tiles (128-key tiles spill registers), the
# fastest stage count per head dim; D=64 keeps the tl pass below SHORT_KEYS, where the Gluon one was slower. The tl
# dQ kernel runs this tile with dropout.
_GLUON_DQ = {
    64: Tile(128, 64, num_warps=8, num_stages=2, gluon_stages=3),
    128: Tile(128, 64, num_warps=8, num_stages=2, gluon_stages=4),
}
_GLUON_DQ_LONG_ONLY = {64}  # head dims whose short key lists keep the tl dQ tile
# The Gluon dK/dV pass (kernels/gluon/dkdv.py): 128 keys per CTA, software-pipelined warpgroups, 64-row query tiles.
# A stage is held for two steps (its Q feeds the next step's dK), so 4 stages, the fastest, give the producer slack.
# The tl kernel runs the tile with dropout.
_GLUON_DKDV = {
    64: Tile(64, 128, num_warps=8, num_stages=2, gluon_stages=4),
    128: Tile(64, 128, num_warps=8, num_stages=2, gluon_stages=4),
}
# The warp-specialised one-pass backward (kernels/gluon/bwd_dq_writer.py), for KernelConfig.gluon_dq_writer: 128 keys a
# CTA, 64 query rows a step. A stage is held for one step (every matmul of a step reads it and is waited for in it),
# so 3 stages give the producer two steps of slack; at D=128 a 4th does not fit beside the dQ staging buffer
# (249,856 B of 232,448: dq_writer_shared_bytes). At D=64 5 stages (152,576 B), of 3-6, were the fastest or within
# 1.5% of it on every config measured but mm13k_hub_gqa, 2.7% behind 4 there (H200, tools.one_pass;
# docs/performance.md).
GLUON_DQ_WRITER = {
    64: Tile(64, 128, num_warps=8, num_stages=2, gluon_stages=5),
    128: Tile(64, 128, num_warps=8, num_stages=2, gluon_stages=3),
}
# Its tile over SHORT_KEYS keys or more outside packs of short samples (KernelConfig.gluon_dq_writer_long): 128 query
# rows a step, taken by each MMA warpgroup whole where lse is in the scores (else in halves of 64:
# kernels/gluon/bwd_dq_writer.py), and 3 stages (202,752 B; 4 would need 237,568). At D=64
# it beat the 64-row tile by 1.01-1.14x on 13k-64k keys (mm13k_hub, mm13k_cyclic, mm13k_hub_gqa, transfusion_16k,
# video_64k), but lost 0.86x on a pack of 512-token samples, and at the seed's 925 keys (bound by host work) ran
# 0.87x in one run (H200, tools.one_pass, benchmarks/results/h200/dq_writer_d64_bm128.md). Between 2,048 and 13k
# keys it was not measured.
GLUON_DQ_WRITER_LONG = {
    64: Tile(128, 128, num_warps=8, num_stages=2, gluon_stages=3),
}
# The head dims (padded) whose deterministic=False backward runs the dQ-writer kernel by default. At D=64 it beat
# the two passes by 1.02-1.20x at 13k-64k keys, and the dK/dV kernel's one-pass variant with bulk dQ adds (since
# removed) by 1.01-1.03x (pack_64k_x512, mm13k_hub_gqa) and at the seed (H200, tools.one_pass). At D=128, once its
# loop no longer spilled under Triton 3.6 and 3.7, it beat the two passes by 1.01-1.33x and that variant by
# 1.07-1.36x on every config measured, 925 to 64k keys (0.90-0.98x the two passes while it spilled;
# benchmarks/results/h200/dq_writer_d128.md). cuda_kernel_config(..., gluon_dq_writer=False) turns it off: the
# one pass is then the tl kernel (tools/one_pass.py's "one-pass" side).
GLUON_DQ_WRITER_HEAD_DIMS = frozenset({64, 128})
# The Gluon forward and dQ pass at head dims 129-256 (padded to 256: Gemma's), with 128 query rows a CTA, 64 per
# consumer warpgroup (registers and shared memory: tests/kernels/test_gluon_compiles.py; timings on an H200:
# docs/tuning.md):
# - forward: a 64 x 256 fp32 O accumulator (128 of a thread's 240 registers) beside 64 x 64 scores, 2 stages of 64
#   keys (192 KB of shared memory with Q): 1.44x the tl forward on a Gemma-3-like 16k mask, where 4 stages of 32
#   keys (no spill at all) gave 1.28x and ping-pong turns less (FlashAttention-3 drops them past D=128 too), and
#   1.15x that since a stage's K and its V are released apart (kernels/gluon/forward.py); its masked variants
#   reload a few spilled registers in the loop;
# - dQ: a 64 x 256 fp32 dQ accumulator beside the scores and dP of 32 keys; Q and dO stay resident (128 KB), so
#   64-key stages do not fit beside them, 3 stages of 32 keys do (224 KB).
# num_warps and num_stages are the tl kernels', which run these tiles with dropout or split key lists.
# - dK/dV (kernels/gluon/dkdv_d256.py; 4.2x the tl pass on the mask above): the D <= 128 kernel's two 64 x 256
#   fp32 accumulators a warpgroup would take 256 registers a thread alone, so a CTA owns 64 keys, one
#   warpgroup their dV and the other their dK (64 x 256 fp32 each); 64 query rows a step, 2 stages of Q and dO
#   (128 KB) beside K and V (64 KB) and the P^T hand-over tile (16 KB). With dropout the tl dK/dV kernel runs its
#   own tile (bwd_dkdv_dropout).
GLUON_D256_HEAD_DIM = 256
GLUON_D256 = {
    "fwd": Tile(128, 64, num_warps=8, num_stages=2, gluon_stages=2, pingpong=False),
    "dq": Tile(128, 32, num_warps=8, num_stages=1, gluon_stages=3),
    "dkdv": Tile(64, GLUON_D256_DKDV_BLOCK, num_warps=8, num_stages=1, gluon_stages=2),
}
GLUON_D256_ENABLED = True  # a source switch, read by cuda_kernel_config (tools compare against False)
# The D=256 Gluon dK/dV pass (GLUON_D256["dkdv"]) where GLUON_D256_ENABLED, a source switch as that one
# (tests/kernels/test_hopper_d256.py, tools/d256_probe.py); cuda_kernel_config(..., gluon_d256_dkdv=False) drops it.
GLUON_D256_DKDV_ENABLED = True
# What one CTA of an H100 or H200 may take, and what the Gluon kernels hold beside their tiles (their barriers and
# alignment: under 400 bytes measured; under segment codes the kernels by key block also hold their key block's
# runs, KEY_RUNS_BYTES).
HOPPER_SHARED_BYTES = 227 * 1024
_GLUON_SHARED_SLACK = 1024
# int32 shift of each key of a block, codes of 16 runs (kernels/gluon/key_runs.py)
KEY_RUNS_BYTES = 4 * (GLUON_BLOCK + 16)
GLUON_DKDV_MAX_HEAD_DIM = 128  # the D <= 128 Gluon dK/dV kernel's (GLUON_D256's note says why)
# Query rows a step of the D <= 128 Gluon dK/dV kernel (kernels/gluon/dkdv.py: S^T of a warpgroup's 64 keys by
# them, one wgmma). 128 rows a step, each step whole rather than pipelined (at D=64 the pipeline's registers
# spilled there), ran 0.87-1.06x its backward (docs/performance.md) and was removed.
GLUON_WG_ROWS = 64


def _key_block_bytes(tile: Tile, d_pad: int, itemsize: int) -> int:
    """What every Gluon dK/dV kernel holds in shared memory at ``tile``: K and V of its ``block_n`` keys, and the
    stages of Q and dO (``block_m`` rows) with their lse, delta, query-index and query-bit rows."""
    keys, rows, row_bytes = tile.block_n, tile.block_m, itemsize * d_pad
    return 2 * keys * row_bytes + tile.gluon_stages * (2 * rows * row_bytes + 4 * rows * 4)


def _dq_tiles_bytes(tile: Tile, d_pad: int, itemsize: int) -> int:
    """A one pass's dQ tiles: both warpgroups' dS^T tiles and the float32 ``[block_m, d_pad]`` dQ staging."""
    return tile.block_n * tile.block_m * itemsize + tile.block_m * d_pad * 4


def dkdv_shared_bytes(tile: Tile, d_pad: int, itemsize: int = 2) -> int:
    """The shared memory of the D <= 128 Gluon dK/dV kernel's tiles at ``tile``: :func:`_key_block_bytes`."""
    return _key_block_bytes(tile, d_pad, itemsize)


def dkdv_d256_shared_bytes(tile: Tile, d_pad: int = GLUON_D256_HEAD_DIM, itemsize: int = 2) -> int:
    """The shared memory of the D=256 Gluon dK/dV kernel's tiles at ``tile``: :func:`_key_block_bytes` of its 64
    keys, and the P^T tile (float32) one consumer warpgroup hands the other."""
    return _key_block_bytes(tile, d_pad, itemsize) + tile.block_n * tile.block_m * 4


def dq_writer_shared_bytes(tile: Tile, d_pad: int, itemsize: int = 2) -> int:
    """The shared memory of the dQ-writer kernel's tiles at ``tile`` (its module docstring has the table):
    :func:`_key_block_bytes` of its 128 keys, both MMA warpgroups' dS^T tiles and the float32 ``[block_m, d_pad]``
    dQ staging buffer."""
    return _key_block_bytes(tile, d_pad, itemsize) + _dq_tiles_bytes(tile, d_pad, itemsize)


def _dq_writer_problem(tile: Tile, d_pad: int, itemsize: int) -> str | None:
    """:func:`gluon_tile_problem` of the dQ-writer kernel: head dims up to 128, 128 keys a block, and its shared
    memory within a CTA's."""
    if d_pad > GLUON_DKDV_MAX_HEAD_DIM or tile.block_n != GLUON_BLOCK:
        return (f"the Gluon dQ-writer one-pass kernel runs head dims up to {GLUON_DKDV_MAX_HEAD_DIM} at {GLUON_BLOCK} "
                f"keys a block; got {tile} at head dim {d_pad}")
    need = dq_writer_shared_bytes(tile, d_pad, itemsize) + _GLUON_SHARED_SLACK
    if need > HOPPER_SHARED_BYTES:
        return (f"the Gluon dQ-writer kernel at {tile} needs {need} bytes of shared memory at head dim {d_pad}, a CTA "
                f"has {HOPPER_SHARED_BYTES}: fewer stages")
    return None


def _dkdv_problem(tile: Tile, d_pad: int, itemsize: int) -> str | None:
    """:func:`gluon_tile_problem` of the dK/dV pass: the D <= 128 kernel (``kernels/gluon/dkdv.py``: 128 keys) up to
    GLUON_DKDV_MAX_HEAD_DIM, the D=256 one (``dkdv_d256.py``: 64 keys, 64 query rows a step or more) past it."""
    if d_pad <= GLUON_DKDV_MAX_HEAD_DIM:
        if tile.block_n != GLUON_BLOCK:
            return (f"the Gluon dK/dV kernel at head dims up to {GLUON_DKDV_MAX_HEAD_DIM} takes {GLUON_BLOCK} keys a "
                    f"block; got {tile} at head dim {d_pad}")
        if tile.block_m != GLUON_WG_ROWS:
            return (f"the Gluon dK/dV kernel at head dims up to {GLUON_DKDV_MAX_HEAD_DIM} takes {GLUON_WG_ROWS} query "
                    f"rows a step; got {tile} at head dim {d_pad}")
        need = dkdv_shared_bytes(tile, d_pad, itemsize) + _GLUON_SHARED_SLACK
        if need > HOPPER_SHARED_BYTES:
            return (f"the Gluon dK/dV kernel at {tile} needs {need} bytes of shared memory at head dim {d_pad}, a CTA "
                    f"has {HOPPER_SHARED_BYTES}: fewer stages or query rows")
        return None
    if d_pad > GLUON_D256_HEAD_DIM:
        return f"no Gluon dK/dV kernel runs head dim {d_pad}"
    if tile.block_n != GLUON_D256_DKDV_BLOCK or tile.block_m < 64:
        return (f"the Gluon dK/dV kernel at head dims {GLUON_DKDV_MAX_HEAD_DIM + 1}-{GLUON_D256_HEAD_DIM} takes "
                f"{GLUON_D256_DKDV_BLOCK} keys a block and 64 query rows a step or more (at {d_pad} the "
                f"{GLUON_BLOCK}-key kernel's two 64 x {d_pad} float32 accumulators a warpgroup take more than its 240 "
                f"registers a thread); got {tile}")
    need = dkdv_d256_shared_bytes(tile, d_pad, itemsize) + _GLUON_SHARED_SLACK
    if need > HOPPER_SHARED_BYTES:
        return (f"the Gluon dkdv kernel at {tile} needs {need} bytes of shared memory at head dim {d_pad}, a CTA has "
                f"{HOPPER_SHARED_BYTES}: fewer stages or query rows")
    return None


def gluon_tile_problem(kind: str, tile: Tile, d_pad: int, itemsize: int = 2) -> str | None:
    """Why the Gluon kernel of pass ``kind`` ("fwd", "dq", "dkdv" or "dq_writer") cannot run ``tile`` at head dim
    ``d_pad`` (padded: :func:`head_dim_pad`) with inputs of ``itemsize`` bytes, or None where it can: a dK/dV tile
    that is not its kernel's at that head dim (:func:`_dkdv_problem`), the dQ-writer kernel's past its head dims or
    shared memory (:func:`_dq_writer_problem`), the forward's Q and the dQ pass's Q and dO (``block_m`` rows,
    resident) with their K/V stages past a Hopper CTA's shared memory."""
    if kind == "dkdv":
        return _dkdv_problem(tile, d_pad, itemsize)
    if kind == "dq_writer":
        return _dq_writer_problem(tile, d_pad, itemsize)
    row_bytes = itemsize * d_pad
    resident = (1 if kind == "fwd" else 2) * tile.block_m * row_bytes  # Q; Q and dO
    need = resident + tile.gluon_stages * 2 * tile.block_n * row_bytes + _GLUON_SHARED_SLACK
    if need > HOPPER_SHARED_BYTES:
        return (f"the Gluon {kind} kernel at {tile} needs {need} bytes of shared memory at head dim {d_pad}, a CTA "
                f"has {HOPPER_SHARED_BYTES}: fewer stages or narrower key tiles")
    return None


# Keywords use_config once took, and what to pass instead: said by name rather than as an unknown keyword.
REMOVED_SETTINGS = {
    "deterministic_backward": "use_config(deterministic_backward=...) was removed along with the ordered one-pass "
                              "backward it selected (0.32-0.47x the speed of the two passes on an H200): "
                              "deterministic=True, the default, runs a bitwise-repeatable backward",
}


def use_config(*args: object, deterministic: bool | None = None,
               **kwargs: object) -> contextlib.AbstractContextManager[None]:
    """``with use_config(deterministic=False):`` allows the one-pass backward (dQ by atomic adds, not bitwise
    repeatable; run below ``one_pass_max_keys`` keys) to every enclosed call that does not pass ``deterministic``
    itself (an argument given to the call wins); ``deterministic=True`` restores the bitwise-repeatable two passes.
    Tiles and thresholds are :func:`mmsparse.tuning.use_tuning`'s: the older spellings ``use_config(config)``,
    ``use_config(config=...)`` and ``use_config(short_keys=0)`` still set them, with a DeprecationWarning, until
    the next release.

    The setting is this thread's: other threads keep theirs, and blocks nest. A call reads it once, when its
    forward runs; its backward runs with it wherever and whenever it runs (outside the block, on autograd's
    thread). Arguments are checked when it is called."""
    removed = sorted(set(kwargs) & set(REMOVED_SETTINGS))
    if removed:
        raise TypeError(REMOVED_SETTINGS[removed[0]])
    if deterministic is not None and deterministic is not True and deterministic is not False:
        raise TypeError(f"use_config(deterministic=...) must be True, False or None (keep the current default); got "
                        f"{type(deterministic).__name__} {deterministic!r}")
    config, thresholds = None, {}
    if args or kwargs:
        if len(args) + ("config" in kwargs) > 1:
            raise TypeError(f"use_config takes one config; got {len(args)} positional arguments"
                            + (" and config=" if "config" in kwargs else ""))
        config = args[0] if args else kwargs.pop("config", None)
        config, thresholds = _tuning_arguments("use_config", config, kwargs)
        warnings.warn("use_config(config, **thresholds) is deprecated and goes in the next release: tiles and "
                      "thresholds are set with mmsparse.tuning.use_tuning(config, **thresholds), deterministic with "
                      "use_config(deterministic=...)", DeprecationWarning, stacklevel=2)
    return _settings_block(config, thresholds, deterministic)


def use_tuning(config: KernelConfig | None = None, **thresholds: int) -> contextlib.AbstractContextManager[None]:
    """Run the enclosed calls with fixed tiles, ``with use_tuning(KernelConfig(Tile(16, 16), ...)):``, and/or with
    other thresholds on every call's config, ``with use_tuning(short_keys=0):`` (``decode_max_q``, ``short_keys``,
    ``short_samples``, ``compact_bytes``, ``one_pass_max_keys``, ``dq_writer_max_keys``, ``ordered_samples``: ints >=
    0). This thread's, as :func:`use_config`'s setting is, and read by a call when its forward runs. Arguments are
    checked when it is called: a value that cannot run is a TypeError or ValueError naming it, before any block."""
    config, thresholds = _tuning_arguments("use_tuning", config, thresholds)
    return _settings_block(config, thresholds)


def _tuning_arguments(caller: str, config: object, thresholds: dict[str, object]
                      ) -> tuple[KernelConfig | None, dict[str, int]]:
    """``use_tuning``'s arguments, checked: a config (or None) and thresholds by name (:func:`check_threshold`)."""
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"{caller}(config) takes a mmsparse.tuning.KernelConfig (or None); got "
                        f"{type(config).__name__}")
    removed = sorted(set(thresholds) & set(REMOVED_SETTINGS))
    if removed:
        raise TypeError(REMOVED_SETTINGS[removed[0]])
    unknown = set(thresholds) - set(THRESHOLDS)
    if unknown:
        raise TypeError(f"{caller} sets a config and the thresholds {', '.join(THRESHOLDS)}; got {sorted(unknown)}"
                        + (" (deterministic is mmsparse.use_config's)" if "deterministic" in unknown else ""))
    return config, {name: check_threshold(f"{caller}({name}=...)", name, value) for name, value in thresholds.items()}


@contextlib.contextmanager
def _settings_block(config: KernelConfig | None, thresholds: dict[str, int],
                    deterministic: bool | None = None) -> Iterator[None]:
    """The block of checked settings: the thread's settings when it is entered (blocks nest), with ``config``,
    ``thresholds`` and ``deterministic`` where given."""
    previous = current_settings()
    fields = {**dict(previous.thresholds), **thresholds}
    with applied_settings(Settings(config if config is not None else previous.config, tuple(sorted(fields.items())),
                                   previous.deterministic if deterministic is None else deterministic)):
        yield


@contextlib.contextmanager
def applied_settings(settings: Settings) -> Iterator[Settings]:
    """This thread's settings inside the block (interned), the previous ones after it: a backward that must run
    as its forward's settings said, on whichever thread it runs."""
    previous = current_settings()
    _thread.settings = settings = intern_settings(settings)
    try:
        yield settings
    finally:
        _thread.settings = previous

