"""Random cases against an independent reference: ``python -m tests.stress.fuzz --minutes N --seed S``.

Each case draws, from its own 64-bit seed:
  - a topology of pair types: 0/1 only, or NONE/FULL/CAUSAL (0/1/2), drawn i.i.d. or with structure
    (Transfusion-like, banded, diagonal, global segments); k mostly small (1 to 32: the bit path for 0/1), sometimes
    33 to 600, rarely up to :data:`mmsparse.mask.topology.MAX_SEGMENTS` (4095 on the GPU, 1024 on the CPU), with
    segment lengths that shrink as k grows (many of 0 and 1), so that S stays bounded;
  - segment lengths with zeros, ones and ragged ends, B, causal, a GQA ratio, fewer queries than keys (decoding,
    or a chunk of queries) with per-sample ``q_start``, per-sample lengths with padding, a dense ``attn_mask``
    (instead of the topology), dropout;
  - packed batches through ``mbs_attention_varlen``: up to thousands of samples on the GPU (a few dozen on the
    CPU), empty segments and empty samples, causal per sample, q/k/v as ``[1, H, total, D]`` or ``[total, H, D]``;
  - how the arguments are given: lengths as lists or device tensors, the topology as a list, a tensor or a
    :class:`mmsparse.Topology`.
What compiles stays on a small menu (head dims, three dtypes, two head counts: :data:`HEADS`), so only lengths,
topology, S, B and seeds vary freely. Sizes favour small S (on the GPU about 3 cases in 4 have S <= 4096), with a
share past 8k (1 in 6), where the backward's dQ pass runs beside dK/dV, and 1 in 20 past 32k. They fit two
budgets, both decided from the seed alone (``--repro`` draws the same case): the estimated
peak memory of the case (:func:`estimate_bytes`: inputs, outputs, gradients, the reference's chunks, a dense
mask) within :func:`memory_budget` (a quarter of the GPU, at most 16 GiB), and the reference's work B * Hq * Sq *
Sk within :data:`WORK_MAX` (about a second on an H100). A draw over budget halves B, then takes the smallest head
count, then halves S (a pack drops trailing samples). An out-of-memory error within the budget is a failure like
any other. Between cases nothing is kept: the failures hold strings, mmsparse's mask cache is cleared, and the
CUDA cache is emptied when it holds more than a GiB. fuzz.json records each case's peak against its estimate.

Outputs are NaN-poisoned; out, dq, dk and dv are checked against the float32 reference (computed without autograd) on
sampled rows (every row on the CPU, where S is small; on the GPU random rows plus rows at segment boundaries, and dK/dV
on every key row of the first sample's first KV head), within a few times the error of the same reference in the input
dtype. The reference's mask rows come from the dense ``reference_mask``/``reference_packed_mask`` when S is small, else
straight from per-token segment and sample ids and the pair types (no S x S); neither uses the kernels' bits, codes or
block lists. It prints the case count, the failures and a one-line repro for each, writes ``fuzz.json`` and ``fuzz.md``
(on the GPU by default to ``benchmarks/results/<gpu>/``; ``--out DIR`` elsewhere; ``--merge`` adds the run to the record
already there), and exits 1 on any failure.

``--warmup`` first pays for compilation: it picks, from a fixed stream of draws, the cheapest cases that together
touch every kernel variant the fuzzer's model (:func:`kernel_keys`) knows of, and runs them (checked like any
case) in ``--jobs`` worker processes that fill Triton's on-disk cache, starting none after ``--warmup-minutes``;
the timed run then loads kernels instead of compiling them. Its time, cases and failures are reported apart
(its failures also among the run's); ``--minutes`` counts after it. A second run on the same machine finds the
kernels in Triton's cache, so its warm-up only loads and checks (not yet timed on a GPU).

    python -m tests.stress.fuzz --minutes 10 --seed 1 --warmup         # GPU: S up to 64k, writes results/<gpu>/
    python -m tests.stress.fuzz --minutes 5 --seed 2 --warmup --out DIR --merge   # a second run, added to DIR
    python -m tests.stress.fuzz --cases 4 --seed 1 --device cpu       # the interpreter, small S
    python -m tests.stress.fuzz --repro 1234567890123                 # one case again
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import mmsparse
from benchmarks.env import REPO_DIR, environment, results_dir
from benchmarks.report import write_record
from mmsparse.attention.config import cuda_kernel_config
from mmsparse.attention.dropout import dropout_keep_rows, new_dropout_seed
from mmsparse.attention.plan import plan_attention
from mmsparse.mask.topology import MAX_SEGMENTS
from mmsparse.reference import reference_group_rows, reference_mask, reference_packed_mask
from tests.poison import poisoned_empty

from .lists_layout import lists_layout

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GPU = torch.device("cuda")  # the device kernel_keys plans for (on any machine: no device is asked)
H100_SMS = 132  # the multiprocessors of the GPU kernel_keys models (an H100 SXM)
NONE, FULL, CAUSAL = 0, 1, 2  # the pair types, spelled out here so that the reference does not import them
# A case passes when the kernel is within SLACK times the error of the same reference computed in the input
# dtype (FlashAttention's calibrated check), plus a floor.
SLACK = 3.0
# The floor, absolute for unit-scale inputs (times the output's max): 8 units in the last place of the input
# dtype. The backward reads the output rounded to that dtype (delta = rowsum(dO * O)), which the reference does
# not, so a gradient that is 0 in exact arithmetic (a query that sees one key) comes out at a few ulps; dK and dV
# sum that over the query heads of a GQA group (times sqrt(group)).
FLOOR = {"fp16": 8 * 2.0**-11, "bf16": 8 * 2.0**-8, "fp32": 1e-4}
SAMPLED_ROWS = 24  # rows (and key rows) checked per sample and KV head on the GPU, of which BOUNDARY_ROWS sit at
BOUNDARY_ROWS = 8  # segment or sample boundaries (where the pair types, tiles and samples change)
SMALL_K = (1, 2, 3, 3, 3, 4, 5, 8, 13, 32)
CPU_MAX_K = 1024  # the CPU draws no more segments than this (the interpreter, and the k x k validation)
GPU_MAX_SAMPLES = 4000
STYLES = ("iid", "iid", "transfusion", "banded", "diagonal", "global")
# The reference's mask rows come from the dense S x S reference up to this many (query, key) pairs over the batch
# (and packs of at most DENSE_MAX_SAMPLES samples: it loops over them), from segment and sample ids beyond.
DENSE_PAIRS = 1 << 24
DENSE_MAX_SAMPLES = 256

# The compiled menu: every kernel specialises on the dtype, the head dim, the query heads and the GQA group.
HEAD_DIMS = {"cuda": (64, 128), "cpu": (16, 32, 40)}
HEADS = ((2, 2), (4, 2))  # (query heads, key/value heads): no GQA, and GQA (group 2 over two kv heads)
# The longest sequence a case may draw (on the GPU, weighted: most cases short, a few up to 64k; k > 600 only the
# first three), before the budgets below.
GPU_MAX_SEQ = ((64, 2.0), (512, 3.0), (4096, 2.5), (16384, 2.0), (65536, 1.5))
CPU_MAX_SEQ = (40, 96)
# The budgets. Memory: a case's estimated peak (estimate_bytes) within a quarter of the GPU, at most
# GPU_BUDGET_MAX, so that draws agree on every GPU of 64 GB or more; on the CPU a fixed, small one. Work: the
# reference walks every query of every head over every key (dk and dv need them all), B * Hq * Sq * Sk pairs,
# ~1e-10 s each on an H100: WORK_MAX is about a second (S = 64k at B = 1 and 2 heads).
GPU_BUDGET_MAX = 16 << 30
CPU_BUDGET = 256 << 20
WORK_MAX = {"cuda": 9 << 30, "cpu": 1 << 22}
SEQ_SLACK = 64  # tokens a drawn sequence may run past its max_seq (segments set to 1, padding)
DENSE_MAX = 1 << 30  # a dense attn_mask has at most this many (query, key) pairs over the batch
REF_PAIRS = 1 << 23  # the reference takes queries in chunks of about this many (query, key) pairs
RESERVED_KEEP = 1 << 30  # empty the CUDA cache after a case when it holds more than this
# The warm-up's cases come from this fixed stream (not the run's seed), so that every run warms the same kernels
# and a second run on the machine finds them in Triton's cache.
WARMUP_SEED = 20_261_124
WARMUP_DRAWS = {"cuda": 10_000, "cpu": 300}
# A warm-up case is cheap: the workers run side by side on one GPU. Variants only an expensive case reaches
# compile during the run.
WARMUP_MAX_BYTES, WARMUP_MAX_WORK = 1 << 30, 1 << 30


@dataclass
class Case:
    seed: int
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int
    k: int  # segments; the topology itself is drawn again from topo_seed by types_of()
    style: str  # how the topology was drawn: iid, transfusion, banded, diagonal, global
    pair_types: str  # "01" (0/1 topologies) or "012" (NONE/FULL/CAUSAL)
    topo_seed: int
    seg_lens: list[list[int]]  # one row per sample (packed: per packed sample), or a single row shared by the batch
    seq_k: int
    seq_q: int
    q_start: list[int] | None
    causal: bool
    dense: bool
    packed: bool
    dropout_p: float
    layout: str = "bhsd"  # packed q/k/v: "bhsd" ([1, H, total, D]) or "thd" (flash-attn's [total, H, D])
    lens_as: str = "list"  # seg_lens given as a host "list" or a device "tensor"
    topology_as: str = "list"  # the topology given as a nested "list", a "tensor" or a "Topology"
    packed_lists: bool = False  # block lists packed end to end (CSR), as masks past COMPACT_BYTES get them
    types: tuple[tuple[int, ...], ...] | None = None  # a given topology instead of one drawn (tests.stress.cold_runs)


# ---------------------------------------------------------------------------------------------------------------
# Budgets


@functools.cache
def memory_budget(device: torch.device) -> int:
    """Bytes a case may use at its peak: a quarter of the GPU's memory, at most GPU_BUDGET_MAX (GPU_BUDGET_MAX
    when the device cannot be asked, as when the tests draw GPU cases on a CPU machine); CPU_BUDGET on the CPU."""
    if device.type != "cuda":
        return CPU_BUDGET
    if not torch.cuda.is_available():
        return GPU_BUDGET_MAX
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(GPU_BUDGET_MAX, torch.cuda.get_device_properties(index).total_memory // 4)


def _ref_chunk(seq_k: int) -> int:
    """Queries per step of the reference: about REF_PAIRS (query, key) pairs, 1024 to 8192 queries."""
    return max(1024, min(8192, REF_PAIRS // max(1, seq_k)))


def _bytes(dtype: str, head_dim: int, batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int,
           mask_rows: int, dense: bool, flat: bool, dropout: bool) -> int:
    """Estimated peak bytes of one case on the device (see :func:`estimate_bytes`)."""
    el = DTYPES[dtype].itemsize
    q_side, kv_side = batch * heads_q * seq_q * head_dim, batch * heads_kv * seq_k * head_dim
    total = 4 * (q_side + kv_side) * el  # q, dO, out, dq; k, v, dk, dv
    total += max(q_side, kv_side) * 4  # randn's float32 on the way to the device
    if flat:  # [total, H, D] copies of q, k, v, dO, and their [1, H, total, D] views in the kernels' layout
        total += 2 * (q_side + kv_side) * el
    total += 2 * batch * heads_q * seq_q * 4 + (1 << 26)  # lse, delta; the forward's split partials
    total += 4 * mask_rows * (seq_q // 16 + 1) * (seq_k // 32 + 1) * 4  # block lists and summaries
    rows = min(seq_q, _ref_chunk(seq_k))
    # The reference's step: float32 scores, probabilities, their gradients, the mask rows and their int64 gather
    # index (about 64 bytes a pair, 72 with dropout's keep mask), plus float32 k and v.
    total += rows * seq_k * (72 if dropout else 64) + 2 * seq_k * head_dim * 4
    if dense:  # the bool mask; the library's tile classes (masked, padded copies); the reference's rows of it
        total += 6 * mask_rows * seq_q * seq_k
    return total + (64 << 20)


def estimate_bytes(case: Case) -> int:
    """Estimated peak device memory of :func:`run_case`: q, k, v, dO, out and the gradients in the case's dtype
    (plus the [total, H, D] copies), the kernels' lse, delta and block lists, the reference's per-chunk float32
    tensors (O(chunk * Sk)), and a dense attn_mask with the copies made of it. torch.cuda.max_memory_allocated
    checks it on the GPU (fuzz.json's ``memory``)."""
    mask_rows = 1 if case.packed else len(case.seg_lens)
    return _bytes(case.dtype, case.head_dim, case.batch, case.heads_q, case.heads_kv, case.seq_q, case.seq_k,
                  mask_rows, case.dense, case.layout == "thd", case.dropout_p > 0)


def case_work(case: Case) -> int:
    """The reference's (query, key) pairs over every head: B * Hq * Sq * Sk."""
    return case.batch * case.heads_q * case.seq_q * case.seq_k


def _fit_sizes(gpu: bool, budget: int, dtype: str, head_dim: int, batch: int, heads: tuple[int, int],
               max_seq: int) -> tuple[int, tuple[int, int], int]:
    """(batch, heads, max_seq) within the budgets: halve B, then take the fewest heads, then halve max_seq, until
    a sequence of max_seq + SEQ_SLACK tokens fits (deterministic: no draws)."""
    work_max = WORK_MAX["cuda" if gpu else "cpu"]

    def fits() -> bool:
        s = max_seq + SEQ_SLACK
        return (batch * heads[0] * s * s <= work_max
                and _bytes(dtype, head_dim, batch, *heads, s, s, batch, False, True, True) <= budget)

    while not fits():
        if batch > 1:
            batch //= 2
        elif heads != min(HEADS):
            heads = min(HEADS)
        elif max_seq > 1:
            max_seq //= 2
        else:
            break
    return batch, heads, max_seq


def _within(case: Case, budget: int, gpu: bool) -> bool:
    return estimate_bytes(case) <= budget and case_work(case) <= WORK_MAX["cuda" if gpu else "cpu"]


# ---------------------------------------------------------------------------------------------------------------
# Drawing a case


def draw_case(seed: int, device: torch.device, budget: int | None = None) -> Case:
    """The case of ``seed`` on ``device`` (its type decides the menu and sizes; its memory the budget, unless
    ``budget`` is given)."""
    rng = random.Random(seed)
    gpu = device.type == "cuda"
    budget = memory_budget(device) if budget is None else budget
    u = rng.random()
    if u < 0.8:
        k = rng.choice(SMALL_K)
    elif u < 0.97:
        k = rng.randint(33, 600)
    else:
        k = rng.randint(601, MAX_SEGMENTS if gpu else CPU_MAX_K)
    pair_types = "012" if rng.random() < 0.55 else "01"
    style = rng.choice(STYLES)
    topo_seed = rng.getrandbits(63)
    dtype = rng.choice(list(DTYPES))
    head_dim = rng.choice(HEAD_DIMS["cuda" if gpu else "cpu"])
    heads = rng.choice(HEADS)
    packed = rng.random() < 0.25
    batch = 1 if packed else rng.choice([1, 2, 3] if not gpu else [1, 2, 4, 8])
    if gpu:
        menu = GPU_MAX_SEQ if k <= 600 else GPU_MAX_SEQ[:3]
        max_seq = rng.choices([m for m, _ in menu], weights=[w for _, w in menu])[0]
    else:
        max_seq = rng.choice(CPU_MAX_SEQ)
    if k > 32 and gpu:  # many segments, short ones: about 1, 4, 16 or 64 tokens each
        max_seq = min(max_seq, k * rng.choice([1, 4, 16, 64]))
    batch, (heads_q, heads_kv), max_seq = _fit_sizes(gpu, budget, dtype, head_dim, batch, heads, max_seq)
    per_sample = not packed and batch > 1 and rng.random() < 0.5

    # The segments that get tokens: all of them, except for many segments on the CPU, where a few do (the
    # interpreter's list builder pays for every run of tokens a tile meets).
    spread = k if gpu or k <= 32 else rng.choice([2, 4, 8])

    def lengths(budget: int) -> list[int]:
        """k lengths summing to ``budget`` (random cuts: many zeros once budget < k), some then set to 0 or 1."""
        cuts = sorted(rng.randint(0, budget) for _ in range(spread - 1))
        some = [b - a for a, b in zip([0, *cuts], [*cuts, budget])]
        if spread == k:
            lens = some
        else:
            lens = [0] * k
            for i, n in zip(sorted(rng.sample(range(k), spread)), some):
                lens[i] = n
        if k <= 32:
            for i in range(k):
                if rng.random() < 0.15:
                    lens[i] = rng.choice([0, 1])
        return lens

    if packed:
        if gpu:
            band = rng.random()
            cap = 32 if band < 0.5 else 400 if band < 0.8 else GPU_MAX_SAMPLES
            samples = rng.randint(1, max(1, min(cap, 50_000 // k, max_seq)))
        else:
            samples = rng.randint(1, 8 if rng.random() < 0.8 else 24)
        mean = max(1, max_seq // samples)
        rows = [lengths(0 if rng.random() < 0.05 else rng.randint(0, min(2 * mean, max_seq)))
                for _ in range(samples)]
        if not any(map(sum, rows)):
            rows[-1][-1] += 1  # a pack has a token at least
        seq_k = sum(map(sum, rows))
    elif per_sample:
        rows = [lengths(rng.randint(1, max_seq))]  # one sample fills the sequence (unless padding is added)
        rows += [lengths(rng.randint(0, sum(rows[0]))) for _ in range(batch - 1)]
        seq_k = max(1, *map(sum, rows)) + (rng.randint(1, 9) if rng.random() < 0.25 else 0)
    else:
        rows = [lengths(rng.randint(1, max_seq))]
        rows[0][-1] += sum(rows[0]) == 0  # shared lengths cover the sequence, which has a token at least
        seq_k = sum(rows[0])
    decode = not packed and rng.random() < 0.25
    seq_q = seq_k
    if decode:  # decoding (at most 16 queries: the decode tile) or a chunk of queries
        seq_q = rng.randint(1, min(16, seq_k)) if rng.random() < 0.7 else rng.randint(1, seq_k)
    q_start = [rng.randint(0, seq_k - seq_q) for _ in range(batch)] if decode and per_sample else None
    dense = not packed and q_start is None and rng.random() < 0.12 and batch * seq_q * seq_k <= DENSE_MAX
    dropout_p = rng.choice([0.1, 0.3]) if rng.random() < (0.1 if packed else 0.15) else 0.0
    causal = rng.random() < 0.4
    layout = rng.choice(["bhsd", "thd"]) if packed else "bhsd"
    lens_as = "tensor" if not dense and rng.random() < 0.3 else "list"
    topology_as = rng.choice(["list", "tensor", "Topology"]) if k <= 64 else "Topology"
    case = Case(seed, dtype, head_dim, heads_q, heads_kv, batch, k, style, pair_types, topo_seed, rows, seq_k,
                seq_q, q_start, causal, dense, packed, dropout_p, layout, lens_as, topology_as,
                packed_lists=rng.random() < 0.3)  # drawn last: the other fields of a seed stay as they were
    if dense and not _within(case, budget, gpu):  # the dense mask's copies are over budget: the topology instead
        case = replace(case, dense=False)
    while case.packed and len(case.seg_lens) > 1 and not _within(case, budget, gpu):  # a long pack: fewer samples
        rows = case.seg_lens[:max(1, len(case.seg_lens) * 3 // 4)]
        if not any(map(sum, rows)):
            rows[-1][-1] += 1
        total = sum(map(sum, rows))
        case = replace(case, seg_lens=rows, seq_k=total, seq_q=total)
    return case


def types_of(case: Case) -> torch.Tensor:
    """The case's topology: int8 ``[k, k]`` pair types (CPU), given or drawn from its topo_seed."""
    if case.types is not None:
        return torch.tensor(case.types, dtype=torch.int8)
    return _draw_types(case.k, case.style, case.pair_types, case.topo_seed)


@functools.lru_cache(maxsize=4)
def _draw_types(k: int, style: str, pair_types: str, topo_seed: int) -> torch.Tensor:
    rng = random.Random(topo_seed)
    gen = torch.Generator().manual_seed(topo_seed)
    r, c = torch.arange(k)[:, None], torch.arange(k)[None, :]
    causal_share = rng.choice([0.2, 0.5, 0.8]) if pair_types == "012" else 0.0
    # Each allowed pair is CAUSAL with probability causal_share, else FULL.
    kind = torch.where(torch.rand(k, k, generator=gen) < causal_share, CAUSAL, FULL)
    if style == "iid":
        allowed = torch.rand(k, k, generator=gen) >= rng.choice([0.1, 0.4, 0.7, 0.95])
    elif style == "transfusion":  # text runs causal, images full within; every segment sees all before it
        allowed = c <= r
        diag = torch.where(torch.arange(k) % 2 == 0, CAUSAL if pair_types == "012" else FULL, FULL)
        kind = torch.where(r == c, diag[:, None].expand(k, k), FULL)
    elif style == "banded":  # each segment sees its neighbours within w (only the earlier ones, sometimes)
        w = rng.randint(0, 3)
        allowed = (r - c).abs() <= w
        if rng.random() < 0.5:
            allowed &= c <= r
    elif style == "diagonal":  # segments see themselves only; a few see nothing
        allowed = (r == c) & (torch.rand(k, 1, generator=gen) >= 0.1)
    else:  # "global": a few segments see and are seen by everything, the rest sparsely
        hubs = torch.rand(k, generator=gen) < rng.choice([0.05, 0.2])
        allowed = hubs[:, None] | hubs[None, :] | (torch.rand(k, k, generator=gen) < 0.2)
    types = torch.where(allowed, kind, NONE).to(torch.int8)
    if pair_types == "012" and not bool((types == CAUSAL).any()):
        i = rng.randrange(k)
        types[i, i] = CAUSAL  # a 0/1/2 case has a causal pair at least (and so takes the segment-code path)
    return types


FEATURES = (
    "bit path (0/1, k <= 32)", "segment codes", "pair types 0/1/2", "k > 32", "k > 600", "packed",
    "packed, > 100 samples", "packed, [total, H, D]", "per-sample lengths", "fewer queries than keys", "q_start",
    "causal", "dense attn_mask", "dropout", "GQA", "lengths as a tensor", "packed block lists", *DTYPES, "D=16",
    "D=32", "D=40", "D=64", "D=128",
)


def features(case: Case) -> list[str]:
    """What a case covers (names from FEATURES), for the run's tally."""
    bit_path = (case.k <= 32 and case.pair_types == "01" and not case.packed and not case.dense)
    tags = {
        "bit path (0/1, k <= 32)": bit_path,
        "segment codes": not bit_path and not case.dense,
        "pair types 0/1/2": case.pair_types == "012" and not case.dense,
        "k > 32": case.k > 32,
        "k > 600": case.k > 600,
        "packed": case.packed,
        "packed, > 100 samples": case.packed and len(case.seg_lens) > 100,
        "packed, [total, H, D]": case.layout == "thd",
        "per-sample lengths": not case.packed and len(case.seg_lens) > 1,
        "fewer queries than keys": case.seq_q < case.seq_k,
        "q_start": case.q_start is not None,
        "causal": case.causal,
        "dense attn_mask": case.dense,
        "dropout": case.dropout_p > 0,
        "GQA": case.heads_q > case.heads_kv,
        "lengths as a tensor": case.lens_as == "tensor",
        "packed block lists": case.packed_lists and not case.dense,
    }
    return [name for name, on in tags.items() if on] + [case.dtype, f"D={case.head_dim}"]


def case_record(case: Case) -> dict[str, Any]:
    """The case for fuzz.json: its fields, the topology when k <= 32, large lengths summarised (--repro SEED
    draws everything again)."""
    record = asdict(case)
    if case.k <= 32:
        record["topology"] = types_of(case).tolist()
    runs = sum(map(len, case.seg_lens))
    if runs > 256:
        record["seg_lens"] = f"{len(case.seg_lens)} rows of {case.k} (drawn from the seed)"
    return record


# ---------------------------------------------------------------------------------------------------------------
# The reference's mask rows


MaskRowsOf = Callable[[int, torch.Tensor], torch.Tensor]  # (sample b, query rows [R]) -> bool [R, Sk]


def _allowed_rows(case: Case, device: torch.device, types: torch.Tensor | None = None) -> MaskRowsOf:
    """allowed(b, rows) -> bool [R, Sk]: which keys the query rows of sample b see, independent of the kernels'
    bits, codes and block lists: the dense reference mask when S is small, else from token ids (see
    :func:`_mask_rows_from_ids`). ``types``: the pair types (default the case's)."""
    types = types_of(case) if types is None else types
    if _dense_reference_fits(case):
        return _mask_rows_from_dense(case, types, device)
    return _mask_rows_from_ids(case, types, device)


def _dense_reference_fits(case: Case) -> bool:
    pairs = case.seq_q * case.seq_k * (1 if case.packed else len(case.seg_lens))
    if case.packed:
        samples = len(case.seg_lens)
        return pairs <= DENSE_PAIRS and samples <= DENSE_MAX_SAMPLES and samples * (case.k + 1) ** 2 <= 1 << 22
    return pairs <= DENSE_PAIRS and case.k <= CPU_MAX_K


def _mask_rows_from_dense(case: Case, types: torch.Tensor, device: torch.device) -> MaskRowsOf:
    """Rows of the library's dense reference, ``reference_mask`` or ``reference_packed_mask`` (S x S)."""
    if case.packed:
        mask = reference_packed_mask(types, case.seg_lens, case.causal)
    else:
        lens = case.seg_lens if len(case.seg_lens) > 1 else case.seg_lens[0]
        mask = reference_mask(types, lens, case.seq_k, case.seq_q, case.causal, case.q_start)
    mask = mask.to(device)

    def allowed(b: int, rows: torch.Tensor) -> torch.Tensor:
        return mask[b if mask.shape[0] > 1 else 0][rows.to(device)]

    return allowed


def _mask_rows_from_ids(case: Case, types: torch.Tensor, device: torch.device) -> MaskRowsOf:
    """Rows from per-token segment ids (and sample ids in a pack) and the pair types: query i sees key j when
    both are in the same sample and the pair type of their segments is FULL, or CAUSAL with j <= i (and j <= i
    everywhere when causal). Positions are absolute: ``q_start[b] + row``, or S - Sq + row. O(R * Sk) per call."""
    k = case.k
    table = torch.zeros(k + 1, k + 1, dtype=torch.int8)  # row and column k: padding, NONE
    table[:k, :k] = types
    table = table.to(device)
    keys = torch.arange(case.seq_k, device=device)
    lens = torch.tensor(case.seg_lens, dtype=torch.int64)
    if case.packed:  # one sequence: sample n's segments, then sample n + 1's
        seg = torch.repeat_interleave(torch.arange(k).repeat(lens.shape[0]), lens.flatten())
        doc = torch.repeat_interleave(torch.arange(lens.shape[0]), lens.sum(1))
        seg, doc = seg[None].to(device), doc.to(device)
    else:
        seg = torch.full((lens.shape[0], case.seq_k), k, dtype=torch.int64)
        for b, row in enumerate(lens):
            ids = torch.repeat_interleave(torch.arange(k), row)
            seg[b, :ids.numel()] = ids
        seg = seg.to(device)

    def allowed(b: int, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(device)
        s = seg[b if seg.shape[0] > 1 else 0]
        if case.packed:
            pos = rows
        else:
            start = case.q_start[b] if case.q_start is not None else case.seq_k - case.seq_q
            pos = start + rows
        pair = torch.gather(table[s[pos]], 1, s[None, :].expand(rows.numel(), -1))  # [R, Sk] pair types
        before = keys[None, :] <= pos[:, None]
        m = (pair == FULL) | ((pair == CAUSAL) & before)
        if case.packed:
            m &= doc[pos][:, None] == doc[None, :]
        return m & before if case.causal else m

    return allowed


def _boundaries(case: Case, b: int) -> torch.Tensor:
    """Absolute positions where a segment (or a packed sample) ends, and the ones before them."""
    lens = case.seg_lens if case.packed else [case.seg_lens[b if len(case.seg_lens) > 1 else 0]]
    ends = torch.tensor(lens, dtype=torch.int64).flatten().cumsum(0)
    return torch.cat([ends, ends - 1]).unique()


def _sample(n: int, offset: int, boundaries: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """SAMPLED_ROWS of range(n) (ascending, distinct): random ones and up to BOUNDARY_ROWS at boundaries - offset."""
    if n <= SAMPLED_ROWS:
        return torch.arange(n)
    near = boundaries - offset
    near = near[(near >= 0) & (near < n)]
    near = near[torch.randperm(near.numel(), generator=gen)[:BOUNDARY_ROWS]]
    spread = torch.randperm(n, generator=gen)[:SAMPLED_ROWS - near.numel()]
    return torch.cat([near, spread]).unique()


# ---------------------------------------------------------------------------------------------------------------
# One case


def _topology_arg(case: Case) -> Any:
    types = types_of(case)
    if case.topology_as == "list":
        return types.tolist()
    if case.topology_as == "tensor":
        return types.clone()
    return mmsparse.Topology(types.clone())  # (a Topology keeps the tensor it is given; types_of caches its own)


def _lens_dtype(case: Case) -> torch.dtype:
    """The dtype of a case's lengths given as a tensor (drawn from the seed, apart from the case's fields)."""
    return random.Random(case.seed).choice([torch.int32, torch.int64])


def run_case(case: Case, device: torch.device) -> list[str]:
    """The failures of one case (empty: it passed)."""
    dtype = DTYPES[case.dtype]
    gen = torch.Generator(device="cpu").manual_seed(case.seed & (2**63 - 1))
    shape_q = (case.batch, case.heads_q, case.seq_q, case.head_dim)
    shape_k = (case.batch, case.heads_kv, case.seq_k, case.head_dim)
    q = torch.randn(shape_q, generator=gen).to(device, dtype)
    k, v = (torch.randn(shape_k, generator=gen).to(device, dtype) for _ in "kv")
    do = torch.randn(shape_q, generator=gen).to(device, dtype)
    allowed = _allowed_rows(case, device)
    flat = case.layout == "thd"  # flash-attn's [total, H, D]; the checks below read [1, H, total, D] views

    def given(t: torch.Tensor) -> torch.Tensor:
        return t[0].transpose(0, 1).contiguous() if flat else t

    def as_bhsd(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1)[None] if flat else t

    leaves = [given(t).requires_grad_() for t in (q, k, v)]
    lens: Any = case.seg_lens if len(case.seg_lens) > 1 or case.packed else case.seg_lens[0]
    if case.lens_as == "tensor":
        lens = torch.tensor(lens, dtype=_lens_dtype(case), device=device)
    torch.manual_seed(case.seed & (2**63 - 1))
    with lists_layout(case.packed_lists):
        if case.packed:
            out = mmsparse.mbs_attention_varlen(*leaves, _topology_arg(case), lens, causal=case.causal,
                                                dropout_p=case.dropout_p)
        elif case.dense:  # the mask without causality, which the causal flag adds
            plain = _allowed_rows(replace(case, causal=False), device)
            with torch.no_grad():
                mask = torch.stack([torch.cat([plain(b, r) for r in torch.arange(case.seq_q, device=device)
                                              .split(1024)]) for b in range(len(case.seg_lens))])
            out = mmsparse.mbs_attention(*leaves, attn_mask=mask, causal=case.causal, dropout_p=case.dropout_p)
            del mask, plain
        else:
            out = mmsparse.mbs_attention(*leaves, _topology_arg(case), lens, causal=case.causal,
                                         dropout_p=case.dropout_p, q_start=case.q_start)
    out.backward(given(do))
    out = as_bhsd(out.detach())
    grads = [as_bhsd(t.grad) for t in leaves]
    # From here on nothing needs autograd. q, k and v are the leaves themselves in the [B, H, S, D] layout: with
    # autograd on, the reference's steps would each keep their [chunk, Sk] float32 tensors for a backward that never
    # comes (O(Hq * Sq * Sk): 77 GiB at S = 30k, B = 8, the OOMs of the first GPU runs).
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad():
        return _check(case, device, gen, q, k, v, do, out, grads, allowed, dtype)


def _check(case: Case, device: torch.device, gen: torch.Generator, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, do: torch.Tensor, out: torch.Tensor, grads: list[torch.Tensor], allowed: MaskRowsOf,
           dtype: torch.dtype) -> list[str]:
    """Compare out, dq, dk, dv with the reference on sampled rows (all rows on the CPU)."""
    keep_for = None
    if case.dropout_p:
        torch.manual_seed(case.seed & (2**63 - 1))
        seed = new_dropout_seed(device)
        starts = case.q_start or [case.seq_k - case.seq_q] * case.batch
        past = torch.tensor(starts, dtype=torch.int32, device=device)

        def keep_for(b: int, h: int, idx: torch.Tensor) -> torch.Tensor:
            return torch.cat([dropout_keep_rows(seed, b * case.heads_q + h, 1, case.heads_q, start, count,
                                                case.seq_k, case.dropout_p, past)[0] for start, count in _runs(idx)])

    failures = []
    group = case.heads_q // case.heads_kv
    gpu = device.type == "cuda"
    chunk = _ref_chunk(case.seq_k)
    for b in range(case.batch):
        edges = _boundaries(case, b)
        start = 0 if case.packed else (case.q_start[b] if case.q_start else case.seq_k - case.seq_q)
        rows = torch.arange(case.seq_q)
        cols = torch.arange(case.seq_k)
        for hk in range(case.heads_kv):
            heads = slice(hk * group, (hk + 1) * group)
            if gpu:
                rows = _sample(case.seq_q, start, edges, gen)
                # every key row of the first sample's first KV head: a wrong block list or a race corrupts whole
                # key blocks, which sampled rows can miss; the reference walks every query for dK/dV anyway
                cols = torch.arange(case.seq_k) if b == 0 and hk == 0 else _sample(case.seq_k, 0, edges, gen)
            rows_d, cols_d = rows.to(device), cols.to(device)
            keep = None if keep_for is None else (lambda g, idx, b=b, hk=hk: keep_for(b, hk * group + g, idx))
            args = (q[b, heads], k[b, hk], v[b, hk], do[b, heads], lambda idx, b=b: allowed(b, idx), rows_d, cols_d)
            ref = reference_group_rows(*args, keep=keep, dropout_p=case.dropout_p, chunk=chunk)
            # the error models: the reference in the input dtype, and (half precision) the float32 one with delta
            # from the output rounded to the input dtype, as the kernels compute it: where the exact gradient is 0
            # (a query that sees one key) that rounding is the kernels' whole error, and the input-dtype reference
            # rounds dP and delta alike, so it cancels there
            plains = [ref] if dtype == torch.float32 else [
                reference_group_rows(*args, dtype=dtype, keep=keep, dropout_p=case.dropout_p, chunk=chunk),
                reference_group_rows(*args, keep=keep, dropout_p=case.dropout_p, chunk=chunk, delta_from=dtype)]
            got = (out[b, heads][:, rows_d], grads[0][b, heads][:, rows_d], grads[1][b, hk][cols_d],
                   grads[2][b, hk][cols_d])
            for i, (name, a, e) in enumerate(zip(("out", "dq", "dk", "dv"), got, ref)):
                msg = _compare(a, e, [plain[i] for plain in plains], case.dtype,
                               group ** 0.5 if name in ("dk", "dv") else 1.0)
                if msg:
                    failures.append(f"{name}[b={b}, kv head {hk}]: {msg}")
    return failures


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive values in ascending ``idx``."""
    values = idx.tolist()
    runs: list[tuple[int, int]] = []
    for x in values:
        if runs and runs[-1][0] + runs[-1][1] == x:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((x, 1))
    return runs


def _compare(actual: torch.Tensor, expected: torch.Tensor, plains: list[torch.Tensor], dtype: str,
             widen: float = 1.0) -> str:
    """'' when ``actual`` is as close to ``expected`` (float32) as SLACK times the error of ``plains`` (the error
    models: the same reference computed as a plain implementation rounds; element by element the larger of their
    errors) plus a floor, in max and RMS error (the tests' calibrated check); else what is wrong."""
    a, e = actual.detach().double(), expected.detach().double()
    if torch.isnan(a).any():
        return f"{int(torch.isnan(a).sum())} NaN (an element never written, or a NaN computed)"
    if not a.numel():
        return ""
    scale = max(e.abs().max().item(), 1.0)
    err = (a - e).abs()
    err_plain = torch.stack([(p.detach().double() - e).abs() for p in plains]).amax(0)
    max_tol = SLACK * err_plain.max().item() + FLOOR[dtype] * widen * scale
    rms, rms_plain = err.pow(2).mean().sqrt().item(), err_plain.pow(2).mean().sqrt().item()
    rms_tol = SLACK * rms_plain + FLOOR[dtype] * widen * scale / 4
    if err.max().item() > max_tol or rms > rms_tol:
        rel = (a - e).norm().item() / max(e.norm().item(), 1e-30)
        return (f"max err {err.max().item():.2e} (tol {max_tol:.1e}), rms err {rms:.2e} (tol {rms_tol:.1e}; error "
                f"models' {dtype} {rms_plain:.1e}), rel L2 {rel:.2e}")
    return ""


# ---------------------------------------------------------------------------------------------------------------
# What compiles


def kernel_keys(case: Case, sms: int = H100_SMS) -> frozenset[tuple]:
    """The kernel variants a case compiles on a Hopper GPU of ``sms`` multiprocessors, as the fuzzer models them
    (for the warm-up and the run's tally; a model, not the kernels' own keys: a variant it merges compiles during
    the run, one it splits costs a warm-up case). Which kernel and tile each pass runs, and which block lists they
    read, is the plan's (:func:`mmsparse.attention.plan.plan_attention` over the tiles of
    :func:`mmsparse.attention.config.cuda_kernel_config`: that GPU's, asked for without one). The attention kernels
    specialise on the dtype, head dim, query heads, GQA group, mask path (bits, codes, dense), causal and dropout;
    the forward also on its tile, the GQA pack's rows, splitting the key lists (tl kernel and combine) and the
    Gluon kernel (the split count itself is a runtime argument); dQ on its tile. The list builders specialise on
    the tiles they build, causal and (bits) the segments rounded up to a power of two, the token-bit kernel on k
    and the lengths' dtype, the dropout keep mask on the query heads."""
    d, drop = case.head_dim, case.dropout_p > 0
    group = case.heads_q // case.heads_kv
    bits = case.k <= 32 and case.pair_types == "01" and not case.packed and not case.dense
    mode = "dense" if case.dense else "bits" if bits else "codes"
    attn = (case.dtype, d, case.heads_q, group, mode, case.causal, drop)
    # A pack runs as one sample of all its tokens, its mean sample length picking the forward's tile.
    batch, sample_len = (1, case.seq_k // len(case.seg_lens)) if case.packed else (case.batch, None)
    plan = plan_attention(cuda_kernel_config(d, DTYPES[case.dtype]), batch, case.heads_q, case.heads_kv,
                          case.seq_q, case.seq_k, GPU, sample_len, drop, sms=sms)
    fwd = plan.forward
    keys = {("fwd", *attn, fwd.tile, fwd.pack_rows, fwd.gluon), ("dkdv", *attn, case.heads_kv), ("delta", d)}
    # the one pass (a pack of short samples: the ordered dQ writer) has no dQ pass; its dK/dV kernel is its own
    keys.add(("dq", *attn, plan.dq.tile) if plan.dq is not None else ("one pass", *attn, plan.dkdv.tile))
    if fwd.n_splits > 1:
        keys.add(("combine", d))
    if drop:
        keys.add(("keep", case.heads_q))
    for tile in plan.list_tiles():
        if bits:
            keys.add(("bit lists", max(2, 1 << (case.k - 1).bit_length()), *tile, case.causal))
        elif mode == "codes":
            keys.add(("code lists", *tile, case.causal))
    if bits:
        keys.add(("token bits", case.k, "int32" if case.lens_as == "list" else str(_lens_dtype(case))))
    return frozenset(keys)


def warmup_seeds(device: torch.device, draws: int | None = None) -> list[int]:
    """The warm-up's cases: from WARMUP_DRAWS draws of the fixed WARMUP_SEED stream (those within
    WARMUP_MAX_BYTES and WARMUP_MAX_WORK), the cheapest first, each taken when it touches a kernel variant
    (:func:`kernel_keys`) that no case taken before it does; then ordered
    by how often the draws touch the variants each one brings, so that a warm-up cut short by its time limit has
    compiled the common ones."""
    draws = WARMUP_DRAWS[device.type] if draws is None else draws
    master = random.Random(WARMUP_SEED)
    candidates = []
    for _ in range(draws):
        seed = master.getrandbits(64)
        case = draw_case(seed, device)
        if estimate_bytes(case) <= WARMUP_MAX_BYTES and case_work(case) <= WARMUP_MAX_WORK:
            candidates.append((case_work(case) + case.k, seed, kernel_keys(case)))
    often: dict[tuple, int] = {}
    for _, _, keys in candidates:
        for key in keys:
            often[key] = often.get(key, 0) + 1
    covered: set[tuple] = set()
    chosen = []
    for _, seed, keys in sorted(candidates):
        if not keys <= covered:
            chosen.append((-sum(often[key] for key in keys - covered), len(chosen), seed))
            covered |= keys
    return [seed for _, _, seed in sorted(chosen)]


# ---------------------------------------------------------------------------------------------------------------
# The run


def repro_line(seed: int, device: torch.device) -> str:
    return f"python -m tests.stress.fuzz --repro {seed} --device {device.type}"


def _release(device: torch.device) -> None:
    """Between cases: mmsparse's caches (``mmsparse.clear_caches``: a cached mask keeps its token bits and block
    lists on the device) and, when it holds more than RESERVED_KEEP, the CUDA cache (memory the driver may need for a
    kernel's module or local memory, which a Triton launch cannot take back from torch's cache)."""
    mmsparse.clear_caches()
    if device.type == "cuda" and torch.cuda.memory_reserved(device) > RESERVED_KEEP:
        torch.cuda.empty_cache()


class _Memory:
    """Each case's peak device memory against its estimate and the budget, and what stays allocated after it."""

    def __init__(self, device: torch.device) -> None:
        self.gpu = device.type == "cuda"
        self.device = device
        self.budget = memory_budget(device)
        self.base = torch.cuda.memory_allocated(device) if self.gpu else 0
        self.max_peak = self.max_ratio = 0.0
        self.max_peak_seed = self.max_ratio_seed = None
        self.over_budget: list[dict[str, Any]] = []
        self.kept = 0

    def start(self) -> None:
        if self.gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self, case: Case) -> None:
        if not self.gpu:
            return
        peak = torch.cuda.max_memory_allocated(self.device) - self.base
        estimate = estimate_bytes(case)
        if peak > self.max_peak:
            self.max_peak, self.max_peak_seed = peak, case.seed
        if peak / estimate > self.max_ratio:
            self.max_ratio, self.max_ratio_seed = peak / estimate, case.seed
        if peak > self.budget:
            self.over_budget.append({"seed": case.seed, "peak_mib": peak >> 20, "estimate_mib": estimate >> 20})
        kept = torch.cuda.memory_allocated(self.device) - self.base
        if kept > 256 << 20:  # more than the caches' small tensors: a reference cycle, or a leak
            gc.collect()
            kept = torch.cuda.memory_allocated(self.device) - self.base
        self.kept = max(self.kept, kept)

    def record(self) -> dict[str, Any]:
        return {"budget_mib": self.budget >> 20, "max_peak_mib": int(self.max_peak) >> 20,
                "max_peak_seed": self.max_peak_seed, "max_peak_over_estimate": round(self.max_ratio, 3),
                "max_peak_over_estimate_seed": self.max_ratio_seed, "over_budget": self.over_budget,
                "max_kept_after_a_case_mib": int(self.kept) >> 20}


def run_one(seed: int, device: torch.device, memory: _Memory | None = None) -> tuple[Case, list[str]]:
    """Draw and run one case; a crash is a failure to report (strings only: no tensor outlives the case)."""
    case = draw_case(seed, device)
    if memory is not None:
        memory.start()
    try:
        with poisoned_empty():
            problems = run_case(case, device)
    except Exception as err:  # a crash is a failure to report, not the end of the run
        problems = [f"{type(err).__name__}: {err}".splitlines()[0]]
        traceback.print_exc()
        del err
    _release(device)
    if memory is not None:
        memory.end(case)
    return case, problems


def _failure(case: Case, problems: list[str], device: torch.device, warmup: bool = False) -> dict[str, Any]:
    print(f"FAIL case {case.seed}{' (warm-up)' if warmup else ''}: {problems[0]}\n  repro: "
          f"{repro_line(case.seed, device)}", flush=True)
    record = {"seed": case.seed, "problems": problems, "repro": repro_line(case.seed, device),
              "case": case_record(case)}
    return {**record, "warmup": True} if warmup else record


def fuzz(seed: int, device: torch.device, minutes: float | None, cases: int | None,
         warmed: frozenset[tuple] | None = None) -> dict[str, Any]:
    """Cases from the master ``seed`` for ``minutes`` or ``cases``. ``warmed``: the kernel variants the warm-up
    touched (the record counts the cases that touched others, whose compilation the run paid for)."""
    master = random.Random(seed)
    start = time.monotonic()
    deadline = start + 60 * minutes if minutes else None
    done, failed = 0, []
    coverage = dict.fromkeys(FEATURES, 0)
    memory = _Memory(device)
    variants: set[tuple] = set()
    cold, slowest = 0, []
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
    while (cases is None or done < cases) and (deadline is None or time.monotonic() < deadline):
        case_seed = master.getrandbits(64)
        t0 = time.monotonic()
        case, problems = run_one(case_seed, device, memory)
        seconds = time.monotonic() - t0
        done += 1
        keys = kernel_keys(case, sms)
        cold += warmed is not None and not keys <= warmed
        variants |= keys
        slowest = sorted([*slowest, (round(seconds, 2), case_seed)], reverse=True)[:5]
        for tag in features(case):
            coverage[tag] = coverage.get(tag, 0) + 1
        if problems:
            failed.append(_failure(case, problems, device))
    env = environment(device)
    coverage = {tag: n for tag, n in coverage.items() if n or not tag.startswith("D=")}  # this device's dims
    elapsed = time.monotonic() - start
    return {"seed": seed, "seeds": [seed], "cases": done, "minutes": elapsed / 60, "failures": failed,
            "coverage": coverage, "device": device.type, "gpu": env["gpu"] if device.type == "cuda" else None,
            "torch": env["torch"], "triton": env["triton"], "commit": env["commit"],
            "cases_per_second": round(done / max(elapsed, 1e-9), 3), "kernel_variants": len(variants),
            "cases_compiling_after_warmup": cold if warmed is not None else None,
            "slowest": [{"seed": s, "seconds": t} for t, s in slowest], "memory": memory.record()}


# ---------------------------------------------------------------------------------------------------------------
# The warm-up


def warmup(device: torch.device, jobs: int, minutes: float | None = None,
           seeds: list[int] | None = None) -> dict[str, Any]:
    """Run the warm-up cases (:func:`warmup_seeds`, or ``seeds``) in ``jobs`` worker processes (in this one when
    ``jobs`` is 1), each checked like any case, so that Triton's on-disk cache holds their kernels; stop starting
    cases after ``minutes``. Returns its record: seconds, cases run and chosen, jobs, failures, the cases stopped
    unfinished (a worker still busy a minute past the limit), and the kernel variants of the cases run."""
    start = time.monotonic()
    seeds = warmup_seeds(device) if seeds is None else seeds
    deadline = time.time() + 60 * minutes if minutes else None
    results: dict[int, list[str]] = {}
    unfinished: list[int] = []
    if jobs <= 1:
        for seed in seeds:
            if deadline is not None and time.time() > deadline:
                break
            results[seed] = run_one(seed, device)[1]
    else:
        results, unfinished = _run_workers(seeds, device, jobs, deadline)
    failures = [_failure(draw_case(seed, device), problems, device, warmup=True)
                for seed, problems in results.items() if problems]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
    warmed = frozenset().union(*(kernel_keys(draw_case(s, device), sms) for s in results))
    return {"seconds": round(time.monotonic() - start, 1), "cases": len(results), "chosen": len(seeds),
            "jobs": jobs, "failures": failures, "unfinished": unfinished, "kernel_variants": len(warmed),
            "warmed": warmed}


def _run_workers(seeds: list[int], device: torch.device, jobs: int,
                 deadline: float | None) -> tuple[dict[int, list[str]], list[int]]:
    """Each of ``jobs`` child processes (``--worker``) runs every jobs-th seed and writes a JSON line per case; a
    child that dies mid-case (a crash the process cannot survive) leaves that case failed, with its exit status.
    Returns the problems of each case run, and the cases still running a minute past the deadline (stopped)."""
    shards = [seeds[i::jobs] for i in range(jobs)]
    results: dict[int, list[str]] = {}
    unfinished: list[int] = []
    with tempfile.TemporaryDirectory(prefix="mmsparse-fuzz-") as tmp:
        procs = []
        for i, shard in enumerate(shards):
            if not shard:
                continue
            path = Path(tmp) / f"worker{i}.jsonl"
            cmd = [sys.executable, "-m", "tests.stress.fuzz", "--worker", ",".join(map(str, shard)),
                   "--worker-out", str(path), "--device", str(device)]
            if deadline is not None:
                cmd += ["--deadline", str(deadline)]
            procs.append((subprocess.Popen(cmd, cwd=REPO_DIR), shard, path))
        stop = None if deadline is None else deadline + 60  # a case may finish after the deadline, not much later
        for proc, shard, path in procs:
            killed = False
            try:
                rc = proc.wait(timeout=None if stop is None else max(1.0, stop - time.time()))
            except subprocess.TimeoutExpired:  # a case still running long after the deadline: stop this child
                proc.kill()  # (ours, by its handle)
                rc, killed = proc.wait(), True
            done = {}
            if path.exists():
                for line in path.read_text().splitlines():
                    entry = json.loads(line)
                    done[entry["seed"]] = entry["problems"]
            results.update(done)
            missing = [s for s in shard if s not in done]
            if killed and missing:
                unfinished.append(missing[0])
            elif rc != 0 and missing:
                results[missing[0]] = [f"the warm-up worker running this case exited with status {rc}"]
    return results, unfinished


def _worker(seeds: list[int], device: torch.device, out: Path, deadline: float | None) -> int:
    torch.set_num_threads(1)  # the workers share the cores, which compiling keeps busy
    with out.open("a") as f:
        for seed in seeds:
            if deadline is not None and time.time() > deadline:
                break
            problems = run_one(seed, device)[1]
            f.write(json.dumps({"seed": seed, "problems": problems}) + "\n")
            f.flush()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The record


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Two runs' records as one: cases, minutes and coverage summed, failures and warm-ups listed, seeds listed,
    memory at its worst; versions and commit the new run's (``commits`` lists both when they differ)."""
    merged = dict(new)
    merged["seeds"] = [*old.get("seeds", [old["seed"]]), *new["seeds"]]
    merged["seed"] = merged["seeds"][0]
    merged["cases"] = old["cases"] + new["cases"]
    merged["minutes"] = old["minutes"] + new["minutes"]
    merged["cases_per_second"] = round(merged["cases"] / max(60 * merged["minutes"], 1e-9), 3)
    merged["failures"] = [*old["failures"], *new["failures"]]
    merged["coverage"] = {tag: old["coverage"].get(tag, 0) + new["coverage"].get(tag, 0)
                          for tag in dict.fromkeys([*old["coverage"], *new["coverage"]])}
    merged["warmups"] = [*old.get("warmups", []), *new.get("warmups", [])]
    merged["runs"] = [*old.get("runs", [_run_summary(old)]), _run_summary(new)]
    commits = dict.fromkeys([*old.get("commits", [old["commit"]]), new["commit"]])
    if len(commits) > 1:
        merged["commits"] = list(commits)
    mem_old, mem_new = old.get("memory") or {}, new.get("memory") or {}
    if mem_old and mem_new:
        worst = dict(mem_new)
        for key, seed_key in (("max_peak_mib", "max_peak_seed"),
                              ("max_peak_over_estimate", "max_peak_over_estimate_seed"),
                              ("max_kept_after_a_case_mib", None)):
            if (mem_old.get(key) or 0) > (mem_new.get(key) or 0):
                worst[key] = mem_old[key]
                if seed_key:
                    worst[seed_key] = mem_old.get(seed_key)
        worst["over_budget"] = [*mem_old.get("over_budget", []), *mem_new.get("over_budget", [])]
        merged["memory"] = worst
    colds = [r.get("cases_compiling_after_warmup") for r in (old, new)]
    merged["cases_compiling_after_warmup"] = None if colds == [None, None] else sum(c or 0 for c in colds)
    merged["kernel_variants"] = max(old.get("kernel_variants", 0), new.get("kernel_variants", 0))
    merged["slowest"] = sorted([*old.get("slowest", []), *new.get("slowest", [])],
                               key=lambda r: -r["seconds"])[:5]
    return merged


def _run_summary(result: dict[str, Any]) -> dict[str, Any]:
    return {"seed": result["seeds"][0] if "seeds" in result else result["seed"], "cases": result["cases"],
            "minutes": round(result["minutes"], 2), "failures": len(result["failures"]), "commit": result["commit"]}


def markdown(result: dict[str, Any]) -> str:
    """fuzz.md: the run in a few lines, each failure with its repro, and what the cases covered."""
    where = result["gpu"] or f"{result['device']} (Triton interpreter)"
    seeds = result.get("seeds", [result["seed"]])
    runs = f"{len(seeds)} runs, master seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else (
        f"master seed {seeds[0]}")
    lines = [
        "# Fuzz: random cases against the float32 reference",
        "",
        f"**{result['cases']} cases in {result['minutes']:.1f} min, {len(result['failures'])} failed.** "
        f"{runs[0].upper()}{runs[1:]}; {where}; torch {result['torch']}, triton {result['triton']}; "
        f"commit {result['commit']}.",
        "",
    ]
    for w in result.get("warmups", []):
        stopped = f"; stopped unfinished: {', '.join(map(str, w['unfinished']))}" if w.get("unfinished") else ""
        lines.append(f"Warm-up (not counted above): {w['cases']} of {w['chosen']} cases in {w['seconds']:.0f} s on "
                     f"{w['jobs']} processes, {w['kernel_variants']} kernel variants, {len(w['failures'])} "
                     f"failed{stopped}.")
    if result.get("cases_compiling_after_warmup") is not None:
        lines.append(f"{result['cases_compiling_after_warmup']} cases touched a kernel variant the warm-up did not.")
    mem = result.get("memory") or {}
    if result["device"] == "cuda" and mem:
        lines.append(f"Memory: budget {mem['budget_mib']} MiB a case; largest peak {mem['max_peak_mib']} MiB "
                     f"(case {mem['max_peak_seed']}); peak/estimate at most {mem['max_peak_over_estimate']}; "
                     f"{len(mem['over_budget'])} cases over budget; at most {mem['max_kept_after_a_case_mib']} MiB "
                     "kept after a case.")
    lines.append(f"{result.get('cases_per_second', 0)} cases/s; {result.get('kernel_variants', 0)} kernel "
                 "variants (the fuzzer's model).")
    lines.append("")
    if result["failures"]:
        lines += ["## Failures", ""]
        for f in result["failures"]:
            lines.append(f"- `{f['repro']}`{' (warm-up)' if f.get('warmup') else ''}: {f['problems'][0]}"
                         + (f" (+{len(f['problems']) - 1} more)" if len(f["problems"]) > 1 else ""))
        lines.append("")
    lines += ["## Coverage", "", "| cases with | count |", "|---|---:|"]
    lines += [f"| {tag} | {count} |" for tag, count in result["coverage"].items()]
    return "\n".join(lines) + "\n"


def _default_jobs(device: torch.device) -> int:
    """Warm-up processes: on the GPU one per core but two (compiling is CPU work), at most 14; on the CPU one."""
    return max(1, min(14, (os.cpu_count() or 2) - 2)) if device.type == "cuda" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="run for this long (after any warm-up)")
    parser.add_argument("--cases", type=int, default=None, help="or this many cases")
    parser.add_argument("--seed", type=int, default=0, help="master seed (each case gets its own 64-bit seed)")
    parser.add_argument("--repro", type=int, default=None, help="run the one case with this seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", action="store_true",
                        help="first run the warm-up cases (one per kernel variant) in --jobs processes")
    parser.add_argument("--jobs", type=int, default=None,
                        help="warm-up processes (default: the cores but two, at most 14, on the GPU; 1 on the CPU)")
    parser.add_argument("--warmup-minutes", type=float, default=3.0,
                        help="start no warm-up case after this long (default 3; a worker still running a case a "
                             "minute later is stopped)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for fuzz.json and fuzz.md (default benchmarks/results/<gpu>/ on the GPU; "
                             "none on the CPU)")
    parser.add_argument("--merge", action="store_true",
                        help="add this run to the fuzz.json already in the folder (cases, minutes, seeds)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # seeds of a warm-up worker
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.worker is not None:
        return _worker([int(s) for s in args.worker.split(",")], device, args.worker_out, args.deadline)
    if args.repro is not None:
        case = draw_case(args.repro, device)
        print(json.dumps(case_record(case)))
        print(f"estimated peak {estimate_bytes(case) >> 20} MiB of a {memory_budget(device) >> 20} MiB budget; "
              f"{case_work(case):.3g} reference pairs")
        with poisoned_empty():
            problems = run_case(case, device)
        print("\n".join(problems) or "ok")
        return 1 if problems else 0
    if args.minutes is None and args.cases is None:
        parser.error("give --minutes or --cases")
    warm = None
    if args.warmup:
        jobs = args.jobs if args.jobs is not None else _default_jobs(device)
        warm = warmup(device, jobs, args.warmup_minutes)
        print(f"warm-up: {warm['cases']} of {warm['chosen']} cases in {warm['seconds']:.0f} s on {jobs} processes, "
              f"{len(warm['failures'])} failed", flush=True)
    result = fuzz(args.seed, device, args.minutes, args.cases, warm["warmed"] if warm else None)
    result["warmups"] = []
    if warm is not None:
        result["warmups"] = [{k: v for k, v in warm.items() if k != "warmed"}]
        result["failures"] = [*warm["failures"], *result["failures"]]
    print(f"{result['cases']} cases in {result['minutes']:.1f} min, {len(result['failures'])} failed "
          f"({result['cases_per_second']} cases/s)")
    out = args.out or (results_dir(result["gpu"]) if device.type == "cuda" else None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if args.merge and (out / "fuzz.json").exists():
            result = merge(json.loads((out / "fuzz.json").read_text()), result)
        path = write_record(out, "fuzz", result, markdown(result))
        print(f"wrote {path} and its .md")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
