"""compute-sanitizer over the kernels: ``python -m tests.stress.sanitize --tool memcheck --out DIR``.

The driver runs, for each tool and each kernel group, one child process under NVIDIA's compute-sanitizer,

    compute-sanitizer --tool TOOL --error-exitcode 1 python -m tests.stress.sanitize --child --group GROUP

with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (every tensor its own allocation, so that an access past a tensor's end
leaves the allocation instead of landing in the caching allocator's slack), so that one failing group hides no
other and each child stays small. It reads the sanitizer's summary (``ERROR SUMMARY: N errors``, racecheck's
hazards) and the child's own ``CASE`` lines, and writes ``sanitizer.json`` and ``sanitizer.md`` (per tool and
group: status, errors, seconds, the first lines of any report) to ``--out`` (default
``benchmarks/results/<gpu>/``). Exit status: 0 when every child ran clean, 1 on any error or failed case, 2 when
it cannot run here (no CUDA, no compute-sanitizer, or a sanitizer that does not support the device).

Each child runs forward and backward once per case on tiny ragged shapes (S of a few hundred, one of 2048 for
split key lists): the tl kernels (forced with ``use_config``) and the Gluon Hopper kernels (``SHORT_KEYS = 0``, and
enough heads that the forward's grid is not split); long and decode (short) query tiles, split-KV and its combine,
dropout, the dense-mask path, bit masks, segment codes (pair types 0/1/2, k > 32, packs, ``[total, H, D]``),
GQA, per-sample lengths and ``q_start``; and the block-list, segment-list and token-bit builders on their own.
A case states which special paths it must take (a split, the Gluon passes); the call's plan
(``AttentionPlan.kernels``) says whether it did, so the case list cannot silently drift off its target.

memcheck runs every group; racecheck and synccheck (slow: they track every shared-memory access and barrier)
run a subset: the Gluon TMA/mbarrier kernels and one tl case. The Gluon groups are skipped off sm_90.
Under the sanitizer the whole process is instrumented and the kernels are compiled as usual (Triton's cache
helps a second run). Estimated, not yet measured: a few minutes per group under memcheck, more under racecheck;
``--timeout`` bounds each child (a child that runs out is recorded as such), and ``--groups`` with ``--merge``
splits a run over several commands.

    python -m tests.stress.sanitize --tool memcheck --out DIR                # every group under memcheck
    python -m tests.stress.sanitize --tool racecheck --tool synccheck         # the subset under the other two
    python -m tests.stress.sanitize --tool memcheck --groups tl-bits,builders --merge   # some groups, kept beside
                                                                            # the others already in DIR
    python -m tests.stress.sanitize --child --dry-run                         # list the cases (no GPU needed)
    python -m tests.stress.sanitize --child --group tl-codes                  # one group without the sanitizer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.env import REPO_DIR, git_commit, gpu_slug, results_dir

TOOLS = ("memcheck", "racecheck", "synccheck")
EXIT_CANNOT_RUN = 2
DEFAULT_TIMEOUT = 540  # seconds per child
REPORT_LINES = 40  # lines of a sanitizer report kept in the record
NONE, FULL, CAUSAL = 0, 1, 2

# ---------------------------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class SanCase:
    """One forward + backward (``kind="attention"``) or one set of list builds (``kind="lists"``)."""

    name: str
    topology: Any = None  # k x k pair types; a string names a drawn one (see _topology)
    lens: Any = None  # k lengths, [B, k] per sample, or [N, k] packed
    causal: bool = False
    batch: int = 1
    heads: int = 2
    kv_heads: int = 1
    seq_q: int | None = None  # default: every position
    seq_k: int | None = None  # default: the longest row of lengths
    q_start: tuple[int, ...] | None = None
    head_dim: int = 64
    dtype: str = "bf16"
    packed: bool = False
    layout: str = "bhsd"  # packed: "bhsd" or "thd" ([total, H, D])
    dense: float = 0.0  # > 0: a random attn_mask of this density (with an empty row) instead of the topology
    dropout: float = 0.0
    use_tma: bool = True  # False: the tl kernels' pointer loads
    fill_grid: bool = False  # more heads, so that the forward has 2 programs per SM (the Gluon forward: no split)
    expect: frozenset[str] = frozenset()  # of "split", "gluon-fwd", "gluon-dq", "gluon-dkdv"
    kind: str = "attention"
    packed_lists: bool = False  # the block lists packed end to end (CSR), as large masks get them

    def summary(self) -> str:
        if self.kind == "lists":
            return f"lists of {self._mask()}"
        heads = f"H {self.heads}/{self.kv_heads}{' x more' if self.fill_grid else ''}"
        extra = [x for x, on in (("causal", self.causal), (f"dropout {self.dropout}", self.dropout),
                                 ("pointer loads", not self.use_tma), ("[total, H, D]", self.layout == "thd"),
                                 (f"q_start {list(self.q_start or ())}", self.q_start),
                                 ("packed block lists", self.packed_lists)) if on]
        want = f"; must take {', '.join(sorted(self.expect))}" if self.expect else ""
        return f"{self._mask()}, B {self.batch}, {heads}, D {self.head_dim} {self.dtype}{', ' if extra else ''}" \
               f"{', '.join(extra)}{want}"

    def _mask(self) -> str:
        if self.dense:
            return f"dense mask ({self.dense:.0%}), S {seq_lengths(self)}"
        k = len(_topology(self.topology))
        rows = len(self.lens) if isinstance(self.lens[0], (list, tuple)) else 1
        what = f"pack of {rows}" if self.packed else (f"{rows} rows of lengths" if rows > 1 else "lengths")
        return f"k={k} ({'0/1/2' if _has_causal_pairs(self.topology) else '0/1'}), {what}, Sq/S {seq_lengths(self)}"


@dataclass(frozen=True)
class Group:
    description: str
    path: str  # "tl" (forced), "gluon" (Hopper, SHORT_KEYS = 0), "any" (the builders: no attention)
    cases: tuple[SanCase, ...]
    hopper: bool = False


HUB = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]
CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
RING = [[1, 1, 0], [0, 1, 1], [1, 0, 1]]
FOUR = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0], [0, 1, 0, 1]]
TYPES3 = [[CAUSAL, NONE, FULL], [FULL, CAUSAL, NONE], [NONE, FULL, CAUSAL]]
TRANSFUSION5 = [[CAUSAL if r == c and r % 2 == 0 else FULL if c <= r else NONE for c in range(5)] for r in range(5)]


def _drawn_lengths(seed: int, rows: int, k: int, choices: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(choices) for _ in range(k)] for _ in range(rows)]


PACK50 = _drawn_lengths(50, 50, 3, (0, 1, 2, 5, 9))
PACK7 = _drawn_lengths(7, 7, 5, (0, 3, 17, 40))
PACK300 = _drawn_lengths(300, 300, 3, (0, 0, 1, 2, 3))
K40 = _drawn_lengths(40, 1, 40, (0, 1, 2, 5, 11))[0]
K600 = _drawn_lengths(600, 1, 600, (0, 0, 1, 1, 2))[0]

_SPLIT = frozenset({"split"})
_GLUON_ALL = frozenset({"gluon-fwd", "gluon-dq", "gluon-dkdv"})
_GLUON_BWD = frozenset({"gluon-dq", "gluon-dkdv"})

GROUPS: dict[str, Group] = {
    "tl-bits": Group(
        "tl kernels, 0/1 topologies (bit masks): long and decode query tiles, split-KV and its combine, GQA "
        "packing in decode, per-sample lengths with padding, q_start, TMA and pointer loads, D 40/64/128/256, "
        "fp16/bf16/fp32", "tl", (
            SanCase("bits-causal-gqa", HUB, (100, 37, 120), causal=True, heads=4, kv_heads=2),
            SanCase("bits-per-sample-d128", CYCLIC, [(50, 90, 60), (30, 10, 0)], batch=2, head_dim=128,
                    dtype="fp16"),
            SanCase("bits-decode-split", RING, (700, 600, 748), heads=4, kv_heads=1, seq_q=1, expect=_SPLIT),
            SanCase("bits-decode-q_start", HUB, [(300, 200, 500), (100, 0, 40)], batch=2, heads=2, kv_heads=2,
                    seq_q=5, q_start=(900, 3), head_dim=128, expect=_SPLIT),
            SanCase("bits-prefill-split", FOUR, (500, 548, 700, 300), causal=True, heads=1, kv_heads=1, seq_q=64,
                    expect=_SPLIT),
            SanCase("bits-fp32-d40", FOUR, (90, 17, 120, 73), heads=2, kv_heads=1, head_dim=40, dtype="fp32"),
            SanCase("bits-pointer-loads", HUB, (100, 37, 120), causal=True, heads=4, kv_heads=2, use_tma=False),
            SanCase("bits-d256", RING, (40, 33, 57), heads=2, kv_heads=2, head_dim=256),
            SanCase("bits-packed-lists", HUB, [(100, 37, 120), (50, 0, 60)], batch=2, causal=True, heads=4,
                    kv_heads=2, packed_lists=True),
        )),
    "tl-codes": Group(
        "tl kernels, segment codes: pair types 0/1/2, k > 32 (40 and 600), packs with empty segments and samples "
        "in both layouts, q_start with a split", "tl", (
            SanCase("codes-types-causal", TYPES3, (70, 0, 90), causal=True, heads=4, kv_heads=2),
            SanCase("codes-k40", "k40", K40, heads=2, kv_heads=1, dtype="fp16"),
            SanCase("codes-k600", "k600", K600, heads=2, kv_heads=1, head_dim=128),
            SanCase("codes-pack50-causal", TYPES3, PACK50, packed=True, causal=True, heads=2, kv_heads=1),
            SanCase("codes-pack7-thd", TRANSFUSION5, PACK7, packed=True, layout="thd", heads=4, kv_heads=2,
                    head_dim=128),
            SanCase("codes-decode-q_start", TRANSFUSION5, [(300, 100, 700, 48, 900), (10, 0, 30, 0, 5)], batch=2,
                    heads=2, kv_heads=2, seq_q=3, q_start=(2000, 1), expect=_SPLIT),
        )),
    "tl-dense": Group(
        "tl kernels, a dense attn_mask: [Sq, S] and [B, Sq, S], an empty row, causal, decode", "tl", (
            SanCase("dense-gqa", dense=0.3, lens=(257,), heads=4, kv_heads=2),
            SanCase("dense-per-sample-causal", dense=0.5, lens=[(200,), (200,)], batch=2, causal=True,
                    head_dim=128, dtype="fp16"),
            SanCase("dense-decode", dense=0.3, lens=(2048,), seq_q=4, heads=2, kv_heads=1, expect=_SPLIT),
        )),
    "tl-dropout": Group(
        "tl kernels with dropout (the Gluon kernels take none): bit masks, segment codes in a pack, a dense "
        "mask, a split decode", "tl", (
            SanCase("dropout-bits", HUB, (100, 37, 120), causal=True, heads=4, kv_heads=2, dropout=0.2),
            SanCase("dropout-pack", TYPES3, PACK50, packed=True, heads=2, kv_heads=1, dropout=0.3),
            SanCase("dropout-dense", dense=0.4, lens=(190,), heads=2, kv_heads=2, dropout=0.1, head_dim=128),
            SanCase("dropout-decode-split", RING, (700, 600, 748), heads=2, kv_heads=1, seq_q=2, dropout=0.2,
                    expect=_SPLIT),
        )),
    "builders": Group(
        "the mask builders on their own: token bits (k 3 and 32), block lists of bit masks (tiles 16 to 128, "
        "by query and by key, causal, q_start, small program sizes), segment lists of codes (pair types, k=600, "
        "a pack of 300, q_start)", "any", (
            SanCase("lists-bits", HUB, [(100, 37, 120), (50, 0, 60)], batch=2, causal=True, kind="lists"),
            SanCase("lists-bits-q_start", RING, [(300, 200, 500), (100, 0, 40)], batch=2, seq_q=70,
                    q_start=(900, 0), kind="lists"),
            SanCase("lists-bits-k32", "k32", _drawn_lengths(32, 1, 32, (0, 1, 7, 30))[0], causal=True,
                    kind="lists"),
            SanCase("lists-codes", TYPES3, [(70, 0, 90), (5, 100, 1)], batch=2, seq_q=40, q_start=(100, 0),
                    causal=True, kind="lists"),
            SanCase("lists-codes-k600", "k600", K600, kind="lists"),
            SanCase("lists-codes-pack300", TYPES3, PACK300, packed=True, causal=True, kind="lists"),
            SanCase("lists-packed", HUB, [(100, 37, 120), (50, 0, 60)], batch=2, causal=True, kind="lists",
                    packed_lists=True),
            SanCase("lists-codes-pack300-packed", TYPES3, PACK300, packed=True, causal=True, kind="lists",
                    packed_lists=True),
        )),
    "gluon-bits": Group(
        "Gluon Hopper forward, dQ and dK/dV (TMA, mbarriers, wgmma) with bit masks: D 64/128, causal, GQA, "
        "per-sample lengths, fewer queries than keys, a sequence shorter than one tile, a zero-length segment",
        "gluon", (
            SanCase("gluon-bits-causal-d128", HUB, (100, 37, 163), causal=True, heads=4, kv_heads=2, head_dim=128,
                    fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-bits-per-sample-d64", CYCLIC, [(50, 90, 160), (30, 10, 0)], batch=2, dtype="fp16",
                    fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-bits-fewer-queries", RING, (300, 200, 200), seq_q=200, head_dim=128, fill_grid=True,
                    expect=_GLUON_ALL),
            SanCase("gluon-bits-short", HUB, (10, 20, 10), heads=2, kv_heads=2, fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-bits-empty-segment", CYCLIC, (0, 200, 100), causal=True, head_dim=128, dtype="fp16",
                    fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-bits-packed-lists", HUB, [(100, 37, 163), (30, 0, 99)], batch=2, causal=True, heads=4,
                    kv_heads=2, head_dim=128, fill_grid=True, expect=_GLUON_ALL, packed_lists=True),
        ), hopper=True),
    "gluon-codes": Group(
        "Gluon Hopper kernels with segment codes: pair types 0/1/2, k=40, a pack of 50 as [total, H, D], decode "
        "with q_start (tl forward tile, Gluon backward)", "gluon", (
            SanCase("gluon-codes-types", TYPES3, (70, 0, 190), causal=True, heads=4, kv_heads=2, head_dim=128,
                    fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-codes-k40", "k40", K40, fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-codes-pack50-thd", TYPES3, PACK50, packed=True, layout="thd", fill_grid=True,
                    expect=_GLUON_ALL),
            SanCase("gluon-codes-pack50-packed-lists", TYPES3, PACK50, packed=True, head_dim=128, fill_grid=True,
                    expect=_GLUON_ALL, packed_lists=True),
            SanCase("gluon-codes-decode", TRANSFUSION5, [(300, 100, 700, 48, 900), (10, 0, 30, 0, 5)], batch=2,
                    heads=2, kv_heads=2, seq_q=3, q_start=(2000, 1), head_dim=128, expect=_GLUON_BWD),
        ), hopper=True),
    "gluon-dense": Group(
        "Gluon Hopper kernels with a dense attn_mask (an empty row), causal", "gluon", (
            SanCase("gluon-dense", dense=0.3, lens=(300,), heads=4, kv_heads=2, head_dim=128, fill_grid=True,
                    expect=_GLUON_ALL),
            SanCase("gluon-dense-causal-d64", dense=0.5, lens=(200,), causal=True, dtype="fp16", fill_grid=True,
                    expect=_GLUON_ALL),
        ), hopper=True),
    "gluon-d256": Group(
        "Gluon Hopper kernels of head dims 129-256 (the dK/dV pass's warpgroups hand P^T over in shared memory): "
        "pair types 0/1/2 with per-sample lengths and GQA, D 256 and 192, a dense mask", "gluon", (
            SanCase("gluon-d256-codes-per-sample", TRANSFUSION5, [(90, 64, 130, 64, 70), (40, 0, 200, 64, 3)],
                    batch=2, heads=4, kv_heads=2, head_dim=256, fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-d192-bits-causal", HUB, (100, 37, 163), causal=True, heads=2, kv_heads=2, head_dim=192,
                    dtype="fp16", fill_grid=True, expect=_GLUON_ALL),
            SanCase("gluon-d256-dense", dense=0.3, lens=(300,), heads=2, kv_heads=1, head_dim=256, fill_grid=True,
                    expect=_GLUON_ALL),
        ), hopper=True),
}

# racecheck and synccheck: the Gluon kernels (TMA, mbarriers, warp specialisation) and one tl case.
SUBSET = {
    "tl-bits": ("bits-causal-gqa",),
    "gluon-bits": ("gluon-bits-causal-d128", "gluon-bits-per-sample-d64"),
    "gluon-codes": ("gluon-codes-types",),
    "gluon-dense": ("gluon-dense",),
    "gluon-d256": ("gluon-d256-codes-per-sample",),
}
TOOL_GROUPS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "memcheck": dict.fromkeys(GROUPS),  # None: every case
    "racecheck": dict(SUBSET),
    "synccheck": dict(SUBSET),
}


def _topology(spec: Any) -> list[list[int]]:
    if not isinstance(spec, str):
        return spec
    k = int(spec[1:])
    rng = random.Random(k)
    if k <= 32:  # 0/1 (bits)
        return [[int(rng.random() < 0.4) for _ in range(k)] for _ in range(k)]
    return [[rng.choice((NONE, NONE, FULL, CAUSAL)) for _ in range(k)] for _ in range(k)]


def _has_causal_pairs(spec: Any) -> bool:
    return any(CAUSAL in row for row in _topology(spec))


def seq_lengths(case: SanCase) -> str:
    seq_k = _seq_k(case)
    return f"{case.seq_q or seq_k}/{seq_k}"


def _rows(case: SanCase) -> list[list[int]]:
    return [list(r) for r in case.lens] if isinstance(case.lens[0], (list, tuple)) else [list(case.lens)]


def _seq_k(case: SanCase) -> int:
    rows = _rows(case)
    if case.packed:
        return sum(map(sum, rows))
    return case.seq_k or max(map(sum, rows))


def selected_cases(group: str, only: tuple[str, ...] | None) -> list[SanCase]:
    cases = list(GROUPS[group].cases)
    if only is None:
        return cases
    unknown = set(only) - {c.name for c in cases}
    if unknown:
        raise ValueError(f"group {group} has no case {sorted(unknown)}; it has {[c.name for c in cases]}")
    return [c for c in cases if c.name in only]


# ---------------------------------------------------------------------------------------------------------------
# The child: run a group's cases (on the GPU, under the sanitizer or not)


def _tl_config(head_dim: int, dtype: Any, device: Any, use_tma: bool) -> Any:
    """This device's tiles with every Gluon kernel off (the tl kernels at the same tiles)."""
    from mmsparse.attention import config

    cfg = config.kernel_config(head_dim, dtype, device)

    def tl(tile: Any) -> Any:
        return None if tile is None else replace(tile, gluon_stages=0, pingpong=False)

    return replace(cfg, fwd=tl(cfg.fwd), fwd_short=tl(cfg.fwd_short), fwd_short_samples=tl(cfg.fwd_short_samples),
                   bwd_dkdv=tl(cfg.bwd_dkdv), bwd_dq=tl(cfg.bwd_dq), bwd_dq_short=tl(cfg.bwd_dq_short),
                   decode=tl(cfg.decode), use_tma=cfg.use_tma and use_tma)


def taken_paths(plan: Any) -> set[str]:
    """What a call's plan runs, in the cases' terms: "split" (a forward with split key lists), "gluon-fwd",
    "gluon-dq", "gluon-dkdv" (the Gluon kernel of that pass)."""
    kernels = plan.kernels()
    taken = {"split"} if kernels["forward"] == "tl-split" else set()
    taken.update(f"gluon-{tag}" for tag, name in (("fwd", "forward"), ("dq", "dq"), ("dkdv", "dkdv"))
                 if kernels[name] == "gluon")
    return taken


def _run_attention(case: SanCase, path: str, device: Any) -> Any:
    """Forward and backward of ``case``; returns the call's plan (:func:`mmsparse.attention.plan.plan_attention`
    with the call's shapes, tiles and dropout)."""
    import torch

    import mmsparse
    from mmsparse.attention import config
    from mmsparse.attention.plan import plan_attention

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    rows = _rows(case)
    seq_k = _seq_k(case)
    seq_q = case.seq_q or seq_k
    batch, heads, kv_heads = case.batch, case.heads, case.kv_heads
    if case.fill_grid:  # 2 programs per SM at the Gluon forward's 128-row tiles: no split key lists
        programs = -(-seq_q // 128) * batch * heads
        more = -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // programs)
        heads, kv_heads = heads * more, kv_heads * more

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    if case.layout == "thd":
        q, k, v = rnd(seq_q, heads, case.head_dim), rnd(seq_k, kv_heads, case.head_dim), rnd(
            seq_k, kv_heads, case.head_dim)
    else:
        q = rnd(batch, heads, seq_q, case.head_dim)
        k, v = rnd(batch, kv_heads, seq_k, case.head_dim), rnd(batch, kv_heads, seq_k, case.head_dim)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    topo = None if case.dense else _topology(case.topology)
    topo_arg = mmsparse.Topology(torch.tensor(topo)) if topo is not None and len(topo) > 64 else topo
    context = (config.use_tuning(_tl_config(case.head_dim, dtype, device, case.use_tma)) if path == "tl"
               else contextlib.nullcontext())
    with context:
        # A pack runs as one sample of all its tokens ([1, H, total, D]), its mean sample length picking the tile.
        plan = plan_attention(config.kernel_config(case.head_dim, dtype, device), 1 if case.packed else batch, heads,
                              kv_heads, seq_q, seq_k, device, seq_k // len(rows) if case.packed else None,
                              case.dropout > 0)
        if case.packed:
            out = mmsparse.mbs_attention_varlen(q, k, v, topo_arg, rows, causal=case.causal, dropout_p=case.dropout)
        elif case.dense:
            mask = torch.rand(len(rows), seq_q, seq_k, generator=gen) < case.dense
            mask[:, seq_q // 2] = False  # a query that sees nothing
            mask = mask.to(device)
            out = mmsparse.mbs_attention(q, k, v, attn_mask=mask if batch > 1 else mask[0], causal=case.causal,
                                         dropout_p=case.dropout)
        else:
            lens = rows if len(rows) > 1 else rows[0]
            out = mmsparse.mbs_attention(q, k, v, topo_arg, lens, causal=case.causal, dropout_p=case.dropout,
                                         q_start=list(case.q_start) if case.q_start else None)
        out.backward(torch.randn(out.shape, generator=gen).to(device, dtype))
    _sync(device)
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        if not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{name} has {int((~torch.isfinite(t)).sum())} non-finite values")
    return plan


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_lists(case: SanCase, device: Any) -> None:
    import torch

    from mmsparse.mask.bit_lists import build_block_lists
    from mmsparse.mask.info import BitMask, MaskInfo
    from mmsparse.mask.token_bits import launch_token_bits
    from mmsparse.mask.topology import Topology

    topo = Topology(torch.tensor(_topology(case.topology)))
    rows = _rows(case)
    seq_k = _seq_k(case)
    seq_q = case.seq_q or seq_k
    lens = torch.tensor(rows, device=device)
    q_start = torch.tensor(case.q_start, device=device) if case.q_start else None
    if topo.uses_bits and not case.packed:
        launch_token_bits(topo, lens, seq_k)
        info = MaskInfo.from_topology(topo, lens, seq_q, seq_k, case.causal, q_start)
    else:
        info = MaskInfo.from_segments(topo, lens, seq_q, seq_k, case.causal, q_start, packed=case.packed)
    lists = []
    for block_m, block_n in ((16, 16), (16, 64), (64, 64), (128, 64), (64, 128), (128, 128)):
        for by_key in (False, True):
            lists.append(info.lists(block_m, block_n, by_key))
            if isinstance(info, BitMask) and block_m == 64:  # bits: several column chunks and row groups per program
                lists.append(build_block_lists(info.q_bits, info.k_bits, topo.num_segments, block_m, block_n,
                                               case.causal, info.q_start, by_key, tile_elems=256, fit=False))
    _sync(device)
    for got in lists:
        if bool((got.counts[..., :2] < 0).any()):
            raise AssertionError("a block list has a negative count")


def run_child(group: str, only: tuple[str, ...] | None, device_name: str = "cuda") -> int:
    """Run the cases; print ``CASE <name> ok <seconds>s [taken]`` or ``CASE <name> FAIL <reason>`` for each and a
    closing ``DONE`` line. 1 if any case failed."""
    import torch

    from mmsparse.attention import config


    spec = GROUPS[group]
    device = torch.device(device_name)
    if spec.path == "gluon":  # the Gluon kernels at every key length (the cases are short)
        with config.use_tuning(short_keys=0):
            return _run_cases(group, only, spec, device)
    return _run_cases(group, only, spec, device)


def _run_cases(group: str, only: tuple[str, ...] | None, spec: Any, device: Any) -> int:
    from .lists_layout import lists_layout

    failed = 0
    cases = selected_cases(group, only)
    for case in cases:
        start = time.monotonic()
        taken: set[str] = set()
        try:
            with lists_layout(case.packed_lists):
                if case.kind == "lists":
                    _run_lists(case, device)
                else:
                    taken = taken_paths(_run_attention(case, spec.path, device))
            missing = case.expect - taken
            stray = {t for t in taken if t.startswith("gluon")} if spec.path == "tl" else set()
            if missing or stray:
                raise AssertionError(f"took {sorted(taken) or 'nothing special'}; expected {sorted(case.expect)}")
            print(f"CASE {case.name} ok {time.monotonic() - start:.1f}s {sorted(taken)}", flush=True)
        except Exception as err:  # report and go on: the sanitizer's report covers what ran before
            failed += 1
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            print(f"CASE {case.name} FAIL {reason}", flush=True)
            if "illegal" in reason.lower() or "launch failure" in reason.lower():
                break  # the CUDA context is gone: later cases would fail for the same reason
    print(f"DONE {len(cases)} cases, {failed} failed", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# Reading the sanitizer's output

_ERROR_SUMMARY = re.compile(r"^=+ ERROR SUMMARY: (\d+) errors?\s*$", re.M)
_RACE_SUMMARY = re.compile(r"^=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)",
                           re.M)
_CASE = re.compile(r"^CASE (\S+) (ok|FAIL)\b ?(.*)$", re.M)
_DONE = re.compile(r"^DONE (\d+) cases, (\d+) failed", re.M)
_UNSUPPORTED = ("Device not supported", "Target application terminated before first instrumented API call",
                "Internal Sanitizer Error", "Unable to find injection library")


def parse_sanitizer(text: str) -> dict[str, Any]:
    """What a sanitizer log says: ``errors`` (its ERROR SUMMARY, or racecheck's error count; None without a
    summary), ``hazards`` and ``warnings`` (racecheck), ``report`` (its first REPORT_LINES lines other than the
    banner and the summaries), ``problem`` (a line saying the sanitizer itself could not run, if any)."""
    errors = [int(m.group(1)) for m in _ERROR_SUMMARY.finditer(text)]
    race = _RACE_SUMMARY.findall(text)
    result: dict[str, Any] = {"errors": max(errors) if errors else None, "hazards": None, "warnings": None}
    if race:
        result["hazards"] = sum(int(h) for h, _, _ in race)
        result["warnings"] = sum(int(w) for _, _, w in race)
        race_errors = sum(int(e) for _, e, _ in race)
        result["errors"] = max(result["errors"] or 0, race_errors)
    report = []
    for line in text.splitlines():
        if not line.startswith("=" * 9):
            continue
        body = line.lstrip("=").strip()
        if not body or body == "COMPUTE-SANITIZER" or "SUMMARY:" in body:
            continue
        report.append(line.rstrip())
    result["report"] = report[:REPORT_LINES]
    result["report_lines"] = len(report)
    result["problem"] = next((line.strip("= ").strip() for line in text.splitlines()
                              if any(p in line for p in _UNSUPPORTED)), None)
    return result


def parse_child(text: str) -> dict[str, Any]:
    """The child's own lines: cases that passed, that failed (with the reason), and whether it got to the end."""
    ok = [name for name, status, _ in _CASE.findall(text) if status == "ok"]
    failed = {name: rest.strip() for name, status, rest in _CASE.findall(text) if status == "FAIL"}
    done = _DONE.search(text)
    return {"ok": ok, "failed": failed, "finished": done is not None,
            "total": int(done.group(1)) if done else None}


def judge(sanitizer: dict[str, Any] | None, child: dict[str, Any], returncode: int | None, timed_out: bool) -> str:
    """One word for a run: clean, errors, child failed, timeout, no summary, sanitizer unsupported."""
    if timed_out:
        return "timeout"
    if sanitizer is not None:
        if sanitizer["problem"] and sanitizer["errors"] is None:
            return "sanitizer unsupported"
        if sanitizer["errors"] is None:
            return "no summary"
        if sanitizer["errors"] > 0:
            return "errors"
    if child["failed"] or not child["finished"] or returncode not in (0, None):
        return "child failed"
    return "clean"


# ---------------------------------------------------------------------------------------------------------------
# The driver


def find_sanitizer(explicit: str | None = None) -> str | None:
    """compute-sanitizer: the given path, on PATH, under $CUDA_HOME/bin or /usr/local/cuda/bin."""
    if explicit:
        return explicit if Path(explicit).is_file() and os.access(explicit, os.X_OK) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidate = Path(root) / "bin" / "compute-sanitizer"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def gluon_available() -> bool:
    import torch

    from mmsparse.attention.dispatch import hopper_gluon_available

    return hopper_gluon_available(torch.cuda.current_device())


def gpu_environment() -> dict[str, str]:
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit()}


def sanitizer_command(sanitizer: str, tool: str, child: list[str], api_errors: bool, help_text: str) -> list[str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", "--print-limit", "50"]
    if not api_errors and "--report-api-errors" in help_text:  # the kernels' errors, not the host's probes
        cmd += ["--report-api-errors", "no"]
    return cmd + child


def child_command(group: str, only: tuple[str, ...] | None) -> list[str]:
    cmd = [sys.executable, "-m", "tests.stress.sanitize", "--child", "--group", group]
    return cmd + (["--only", ",".join(only)] if only else [])


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, bool, float, str]:
    """Run ``cmd`` in the checkout with PYTORCH_NO_CUDA_MEMORY_CACHING=1, output (both streams) to ``log``:
    (return code, timed out, seconds, output). On a timeout the whole process group it started is killed."""
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_DIR, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the sanitizer and the child it started, nothing else
            proc.wait()
            rc, timed_out = None, True
    return rc, timed_out, time.monotonic() - start, log.read_text(errors="replace")


def preflight(sanitizer: str, logs: Path, timeout: float, api_errors: bool, help_text: str) -> dict[str, Any]:
    """A two-line CUDA program under memcheck: does the sanitizer run on this device at all?"""
    code = "import torch; x = torch.ones(8, device='cuda'); print('probe', (x + 1).sum().item())"
    cmd = sanitizer_command(sanitizer, "memcheck", [sys.executable, "-c", code], api_errors, help_text)
    rc, timed_out, seconds, text = run_logged(cmd, logs / "preflight.log", timeout)
    parsed = parse_sanitizer(text)
    ok = not timed_out and rc == 0 and "probe 16.0" in text and parsed["errors"] == 0
    tail = [line for line in text.splitlines() if line.strip()][-8:]
    return {"ok": ok, "seconds": round(seconds, 1), "problem": parsed["problem"], "tail": tail}


def plan(tools: list[str], groups: list[str] | None, hopper: bool) -> list[dict[str, Any]]:
    """The (tool, group, cases) runs in order, with a reason where one is skipped."""
    runs = []
    for tool in tools:
        for group, only in TOOL_GROUPS[tool].items():
            if groups is not None and group not in groups:
                continue
            skip = "the Gluon kernels run only on sm_90 with Gluon" if GROUPS[group].hopper and not hopper else None
            runs.append({"tool": tool, "group": group, "only": only, "skipped": skip})
    return runs


def markdown(record: dict[str, Any]) -> str:
    env = record["env"]
    lines = [
        "# compute-sanitizer over the kernels",
        "",
        f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}; commit {env['commit']}; "
        f"{record['sanitizer'].get('version') or 'compute-sanitizer'}; PYTORCH_NO_CUDA_MEMORY_CACHING=1. "
        f"**{'All clean.' if record['ok'] else 'Not clean.'}**",
        "",
        "| tool | group | status | errors | cases ok | seconds |",
        "|---|---|---|---:|---:|---:|",
    ]
    for run in record["runs"]:
        if run.get("skipped"):
            lines.append(f"| {run['tool']} | {run['group']} | skipped: {run['skipped']} | | | |")
            continue
        errors = "-" if run["errors"] is None else str(run["errors"])
        if run.get("hazards") is not None:
            errors += f" ({run['hazards']} hazards, {run['warnings']} warnings)"
        cases = f"{len(run['cases']['ok'])}/{run['cases']['total'] or len(run['cases']['ok'])}"
        lines.append(f"| {run['tool']} | {run['group']} | {run['status']} | {errors} | {cases} | "
                     f"{run['seconds']:.0f} |")
    lines += ["", "Groups:", ""]
    lines += [f"- **{name}**: {g.description}" for name, g in GROUPS.items()]
    for run in record["runs"]:
        if run.get("skipped") or (run["status"] == "clean"):
            continue
        lines += ["", f"## {run['tool']} / {run['group']}: {run['status']}", ""]
        for name, reason in run["cases"]["failed"].items():
            lines.append(f"- case {name}: {reason}")
        if run["report"]:
            lines += ["", "```", *run["report"], "```"]
    return "\n".join(lines) + "\n"


def drive(args: argparse.Namespace) -> int:
    if not cuda_available():
        print("tests.stress.sanitize: no CUDA device here. The sanitizer checks the kernels on a GPU: run it on a "
              "machine with an NVIDIA GPU and the CUDA toolkit's compute-sanitizer (the case list needs neither: "
              "python -m tests.stress.sanitize --child --dry-run).", file=sys.stderr)
        return EXIT_CANNOT_RUN
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        where = args.sanitizer or "on PATH, in $CUDA_HOME/bin or in /usr/local/cuda/bin"
        print(f"tests.stress.sanitize: compute-sanitizer not found ({where}). It ships with the CUDA toolkit: put "
              "its bin folder on PATH or pass --sanitizer /path/to/compute-sanitizer.", file=sys.stderr)
        return EXIT_CANNOT_RUN
    help_text = subprocess.run([sanitizer, "--help"], capture_output=True, text=True).stdout
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout
    version_line = next((line.strip() for line in version.splitlines() if line.strip().startswith("Version")), None)
    env = gpu_environment()
    out = args.out or results_dir(env["gpu"])
    out.mkdir(parents=True, exist_ok=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="mmsparse-sanitize-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"sanitizer {sanitizer} ({version_line}); logs in {logs}", flush=True)
    check = preflight(sanitizer, logs, min(args.timeout, 300), args.api_errors, help_text)
    if not check["ok"]:
        print("tests.stress.sanitize: compute-sanitizer does not run a plain CUDA program on this machine"
              f"{' (' + check['problem'] + ')' if check['problem'] else ''}; nothing to check here. Its last "
              "lines:\n  " + "\n  ".join(check["tail"]), file=sys.stderr)
        return EXIT_CANNOT_RUN
    runs = []
    hopper = gluon_available()
    for item in plan(args.tools, args.groups, hopper):
        tool, group, only = item["tool"], item["group"], item["only"]
        if item["skipped"]:
            runs.append({"tool": tool, "group": group, "skipped": item["skipped"]})
            print(f"{tool:9s} {group:12s} skipped: {item['skipped']}", flush=True)
            continue
        child = child_command(group, only)
        if args.warm:  # without the sanitizer: compiles into Triton's cache, and shows a case failing on its own
            rc, timed_out, seconds, text = run_logged(child, logs / f"plain-{group}.log", args.timeout)
            plain = parse_child(text)
            print(f"{'plain':9s} {group:12s} {judge(None, plain, rc, timed_out)} in {seconds:.0f} s", flush=True)
        cmd = sanitizer_command(sanitizer, tool, child, args.api_errors, help_text)
        rc, timed_out, seconds, text = run_logged(cmd, logs / f"{tool}-{group}.log", args.timeout)
        parsed, cases = parse_sanitizer(text), parse_child(text)
        status = judge(parsed, cases, rc, timed_out)
        runs.append({"tool": tool, "group": group, "selected": list(only) if only else "all",
                     "status": status, "errors": parsed["errors"],
                     "hazards": parsed["hazards"], "warnings": parsed["warnings"], "seconds": round(seconds, 1),
                     "returncode": rc, "cases": cases, "report": parsed["report"],
                     "report_lines": parsed["report_lines"],
                     "command": " ".join(cmd).replace(sys.executable, "python")})
        errors = "-" if parsed["errors"] is None else parsed["errors"]
        print(f"{tool:9s} {group:12s} {status} ({errors} errors, {len(cases['ok'])} cases ok) in {seconds:.0f} s",
              flush=True)
    if args.merge and (out / "sanitizer.json").exists():
        ran = {(r["tool"], r["group"]) for r in runs}
        kept = [r for r in json.loads((out / "sanitizer.json").read_text()).get("runs", [])
                if (r["tool"], r["group"]) not in ran]
        runs = kept + runs
    ok = all(r.get("skipped") or r["status"] == "clean" for r in runs)
    record = {"env": env, "gpu_slug": gpu_slug(env["gpu"]), "ok": ok,
              "sanitizer": {"path": sanitizer, "version": version_line, "preflight": check},
              "environment": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "runs": runs}
    from benchmarks.report import write_record

    path = write_record(out, "sanitizer", record, markdown(record))
    print(f"{'all clean' if ok else 'NOT CLEAN'}; wrote {path} and its .md", flush=True)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------------
# Command line


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.stress.sanitize", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--tool", dest="tools", action="append", choices=[*TOOLS, "all"],
                   help="a compute-sanitizer tool (repeatable; 'all' = all three; default memcheck)")
    p.add_argument("--groups", type=_names, default=None, help=f"comma-separated groups (default all): "
                   f"{', '.join(GROUPS)}")
    p.add_argument("--out", type=Path, default=None, help="folder for sanitizer.json and sanitizer.md (default "
                   "benchmarks/results/<gpu>/)")
    p.add_argument("--logs", type=Path, default=None, help="folder for the full logs (default a new temporary one)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per child (default %(default)s)")
    p.add_argument("--sanitizer", default=None, help="path of compute-sanitizer (default: found on PATH, "
                   "$CUDA_HOME/bin, /usr/local/cuda/bin)")
    p.add_argument("--merge", action="store_true", help="keep the runs of other tools/groups already in "
                   "--out's sanitizer.json (to run the groups in several commands)")
    p.add_argument("--warm", action="store_true", help="run each child once without the sanitizer first")
    p.add_argument("--api-errors", action="store_true", help="also count CUDA API errors (default: the kernels' "
                   "memory errors only: PyTorch's probing API calls fail on purpose)")
    p.add_argument("--child", action="store_true", help="run the cases of --group here (what the driver starts)")
    p.add_argument("--group", default=None, choices=list(GROUPS), help="with --child: the group to run")
    p.add_argument("--only", type=_names, default=None, help="with --child: only these cases")
    p.add_argument("--dry-run", action="store_true", help="with --child: list the cases, run nothing")
    p.add_argument("--device", default="cuda", help="with --child: cuda, or cpu for Triton's interpreter (the "
                   "tl groups and the builders only; no sanitizer: a check of the cases themselves)")
    args = p.parse_args(argv)
    tools = args.tools or ["memcheck"]
    args.tools = list(TOOLS) if "all" in tools else list(dict.fromkeys(tools))
    if args.groups is not None:
        unknown = [g for g in args.groups if g not in GROUPS]
        if unknown:
            p.error(f"unknown group(s) {', '.join(unknown)}; the groups are {', '.join(GROUPS)}")
    if not args.child and (args.group or args.only or args.dry_run):
        p.error("--group, --only and --dry-run go with --child")
    if args.child and not args.dry_run and args.group is None:
        p.error("--child needs --group (or --dry-run to list every group)")
    if args.only is not None:
        if args.group is None:
            p.error("--only needs --group")
        try:
            selected_cases(args.group, tuple(args.only))
        except ValueError as err:
            p.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.child:
        return drive(args)
    only = tuple(args.only) if args.only else None
    if args.dry_run:
        for name in [args.group] if args.group else list(GROUPS):
            g = GROUPS[name]
            print(f"{name} ({g.path}{', sm_90 only' if g.hopper else ''}): {g.description}")
            for case in selected_cases(name, only):
                print(f"  {case.name}: {case.summary()}")
        return 0
    if args.device == "cpu":
        if GROUPS[args.group].path == "gluon":
            print("tests.stress.sanitize --child: the Gluon kernels have no CPU interpreter", file=sys.stderr)
            return EXIT_CANNOT_RUN
        return run_child(args.group, only, "cpu")
    if not cuda_available():
        print("tests.stress.sanitize --child: no CUDA device here (the cases run on a GPU; --dry-run lists them)",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    return run_child(args.group, only, args.device)


if __name__ == "__main__":
    sys.exit(main())
