"""Random cases against an independent reference: ``python -m benchmarks.fuzz --minutes N --seed S``.

Each case draws, from its own 64-bit seed:
  - a topology of pair types: 0/1 only, or NONE/FULL/CAUSAL (0/1/2), drawn i.i.d. or with structure
    (Transfusion-like, banded, diagonal, global segments); k mostly small (1 to 32: the bit path for 0/1), sometimes
    33 to 600, rarely up to :data:`mmsparse.topology.MAX_SEGMENTS` (4095 on the GPU, 1024 on the CPU), with
    segment lengths that shrink as k grows (many of 0 and 1), so that S stays bounded;
  - segment lengths with zeros, ones and ragged ends, B, causal, a GQA ratio, fewer queries than keys (decoding,
    or a chunk of queries) with per-sample ``q_start``, per-sample lengths with padding, a dense ``attn_mask``
    (instead of the topology), dropout;
  - packed batches through ``mbs_attention_varlen``: up to thousands of samples on the GPU (a few dozen on the
    CPU), empty segments and empty samples, causal per sample, q/k/v as ``[1, H, total, D]`` or ``[total, H, D]``;
  - how the arguments are given: lengths as lists or device tensors, the topology as a list, a tensor or a
    :class:`mmsparse.Topology`.
What compiles stays on a small menu (head dims, three dtypes, a few head counts), so only lengths, topology, S, B
and seeds vary freely. Outputs are NaN-poisoned; out, dq, dk and dv are checked against the float32 reference on
sampled rows (every row on the CPU, where S is small; on the GPU random rows plus rows at segment boundaries),
within a few times the error of the same reference in the input dtype. The reference's mask rows come from the
dense ``reference_mask``/``reference_packed_mask`` when S is small, else straight from per-token segment and
sample ids and the pair types (no S x S); neither uses the kernels' bits, codes or block lists. It prints the case
count, the failures and a one-line repro for each, writes ``fuzz.json`` and ``fuzz.md`` (on the GPU by default to
``benchmarks/results/<gpu>/``; ``--out DIR`` elsewhere), and exits 1 on any failure.

    python -m benchmarks.fuzz --minutes 10 --seed 1                 # GPU: S up to 64k, writes results/<gpu>/
    python -m benchmarks.fuzz --cases 4 --seed 1 --device cpu       # the interpreter, small S
    python -m benchmarks.fuzz --repro 1234567890123                 # one case again
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import mmsparse
from mmsparse.functional import new_dropout_seed
from mmsparse.ops.dropout import dropout_keep_rows
from mmsparse.reference import reference_group_rows, reference_mask, reference_packed_mask
from mmsparse.topology import MAX_SEGMENTS

from .env import environment, results_dir
from .report import write_record

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
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


def draw_case(seed: int, device: torch.device) -> Case:
    rng = random.Random(seed)
    gpu = device.type == "cuda"
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
    head_dim = rng.choice([64, 128] if gpu else [16, 32, 40])
    heads_kv = rng.choice([1, 2])
    heads_q = heads_kv * rng.choice([1, 2, 4])
    packed = rng.random() < 0.25
    batch = 1 if packed else rng.choice([1, 2, 3] if not gpu else [1, 2, 4, 8])
    if gpu:
        max_seq = rng.choice([512, 4096, 65536]) if k <= 600 else rng.choice([512, 4096])
    else:
        max_seq = rng.choice([40, 96])
    if k > 32 and gpu:  # many segments, short ones: about 1, 4, 16 or 64 tokens each
        max_seq = min(max_seq, k * rng.choice([1, 4, 16, 64]))
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
        rows = [lengths(0 if rng.random() < 0.05 else rng.randint(0, 2 * mean)) for _ in range(samples)]
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
    dense = (not packed and q_start is None and batch * seq_q * seq_k <= 1 << 30 and rng.random() < 0.12)
    dropout_p = rng.choice([0.1, 0.3]) if rng.random() < (0.1 if packed else 0.15) else 0.0
    causal = rng.random() < 0.4
    layout = rng.choice(["bhsd", "thd"]) if packed else "bhsd"
    lens_as = "tensor" if not dense and rng.random() < 0.3 else "list"
    topology_as = rng.choice(["list", "tensor", "Topology"]) if k <= 64 else "Topology"
    return Case(seed, dtype, head_dim, heads_q, heads_kv, batch, k, style, pair_types, topo_seed, rows, seq_k,
                seq_q, q_start, causal, dense, packed, dropout_p, layout, lens_as, topology_as)


def types_of(case: Case) -> torch.Tensor:
    """The case's topology: int8 ``[k, k]`` pair types (CPU), drawn from its topo_seed."""
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
    "causal", "dense attn_mask", "dropout", "GQA", "lengths as a tensor", *DTYPES, "D=16", "D=32", "D=40", "D=64",
    "D=128",
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
        lens = torch.tensor(lens, dtype=random.Random(case.seed).choice([torch.int32, torch.int64]), device=device)
    torch.manual_seed(case.seed & (2**63 - 1))
    if case.packed:
        out = mmsparse.mbs_attention_varlen(*leaves, _topology_arg(case), lens, causal=case.causal,
                                            dropout_p=case.dropout_p)
    elif case.dense:  # the mask without causality, which the causal flag adds
        plain = _allowed_rows(replace(case, causal=False), device)
        mask = torch.stack([torch.cat([plain(b, r) for r in torch.arange(case.seq_q, device=device).split(1024)])
                            for b in range(len(case.seg_lens))])
        out = mmsparse.mbs_attention(*leaves, attn_mask=mask, causal=case.causal, dropout_p=case.dropout_p)
        del mask
    else:
        out = mmsparse.mbs_attention(*leaves, _topology_arg(case), lens, causal=case.causal,
                                     dropout_p=case.dropout_p, q_start=case.q_start)
    out.backward(given(do))
    out = as_bhsd(out)
    grads = [as_bhsd(t.grad) for t in leaves]
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
    for b in range(case.batch):
        edges = _boundaries(case, b)
        start = 0 if case.packed else (case.q_start[b] if case.q_start else case.seq_k - case.seq_q)
        rows = torch.arange(case.seq_q)
        cols = torch.arange(case.seq_k)
        for hk in range(case.heads_kv):
            heads = slice(hk * group, (hk + 1) * group)
            if gpu:
                rows = _sample(case.seq_q, start, edges, gen)
                cols = _sample(case.seq_k, 0, edges, gen)
            rows_d, cols_d = rows.to(device), cols.to(device)
            keep = None if keep_for is None else (lambda g, idx, b=b, hk=hk: keep_for(b, hk * group + g, idx))
            args = (q[b, heads], k[b, hk], v[b, hk], do[b, heads], lambda idx, b=b: allowed(b, idx), rows_d, cols_d)
            ref = reference_group_rows(*args, keep=keep, dropout_p=case.dropout_p, chunk=1024)
            plain_ref = ref if dtype == torch.float32 else reference_group_rows(
                *args, dtype=dtype, keep=keep, dropout_p=case.dropout_p, chunk=1024)
            got = (out[b, heads][:, rows_d], grads[0][b, heads][:, rows_d], grads[1][b, hk][cols_d],
                   grads[2][b, hk][cols_d])
            for name, a, e, p in zip(("out", "dq", "dk", "dv"), got, ref, plain_ref):
                msg = _compare(a, e, p, case.dtype, group ** 0.5 if name in ("dk", "dv") else 1.0)
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


def _compare(actual: torch.Tensor, expected: torch.Tensor, plain: torch.Tensor, dtype: str, widen: float = 1.0) -> str:
    """'' when ``actual`` is as close to ``expected`` (float32) as SLACK times ``plain`` (the same reference in
    the input dtype) plus a floor, in max and RMS error (the tests' calibrated check); else what is wrong."""
    a, e, p = actual.detach().double(), expected.detach().double(), plain.detach().double()
    if torch.isnan(a).any():
        return f"{int(torch.isnan(a).sum())} NaN (an element never written, or a NaN computed)"
    if not a.numel():
        return ""
    scale = max(e.abs().max().item(), 1.0)
    err, err_plain = (a - e).abs(), (p - e).abs()
    max_tol = SLACK * err_plain.max().item() + FLOOR[dtype] * widen * scale
    rms, rms_plain = err.pow(2).mean().sqrt().item(), err_plain.pow(2).mean().sqrt().item()
    rms_tol = SLACK * rms_plain + FLOOR[dtype] * widen * scale / 4
    if err.max().item() > max_tol or rms > rms_tol:
        rel = (a - e).norm().item() / max(e.norm().item(), 1e-30)
        return (f"max err {err.max().item():.2e} (tol {max_tol:.1e}), rms err {rms:.2e} (tol {rms_tol:.1e}; plain "
                f"{dtype} {rms_plain:.1e}), rel L2 {rel:.2e}")
    return ""


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within it ``torch.empty`` fills its result, floats with NaN and integers with -1, so that an output element
    a kernel leaves unwritten shows up in the comparison instead of passing as leftover memory."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        elif out.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            out.fill_(-1)
        return out

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


# ---------------------------------------------------------------------------------------------------------------
# The run


def repro_line(seed: int, device: torch.device) -> str:
    return f"python -m benchmarks.fuzz --repro {seed} --device {device.type}"


def fuzz(seed: int, device: torch.device, minutes: float | None, cases: int | None) -> dict[str, Any]:
    master = random.Random(seed)
    deadline = time.monotonic() + 60 * minutes if minutes else None
    done, failed = 0, []
    coverage = dict.fromkeys(FEATURES, 0)
    while (cases is None or done < cases) and (deadline is None or time.monotonic() < deadline):
        case_seed = master.getrandbits(64)
        case = draw_case(case_seed, device)
        try:
            with poisoned_outputs():
                problems = run_case(case, device)
        except Exception as err:  # a crash is a failure to report, not the end of the run
            problems = [f"{type(err).__name__}: {err}".splitlines()[0]]
            traceback.print_exc()
        done += 1
        for tag in features(case):
            coverage[tag] = coverage.get(tag, 0) + 1
        if problems:
            failed.append({"seed": case_seed, "problems": problems, "repro": repro_line(case_seed, device),
                           "case": case_record(case)})
            print(f"FAIL case {case_seed}: {problems[0]}\n  repro: {repro_line(case_seed, device)}", flush=True)
    env = environment(device)
    coverage = {tag: n for tag, n in coverage.items() if n or not tag.startswith("D=")}  # this device's dims
    return {"seed": seed, "cases": done, "failures": failed, "coverage": coverage,
            "device": device.type, "gpu": env["gpu"] if device.type == "cuda" else None, "torch": env["torch"],
            "triton": env["triton"], "commit": env["commit"]}


def markdown(result: dict[str, Any]) -> str:
    """fuzz.md: the run in a few lines, each failure with its repro, and what the cases covered."""
    where = result["gpu"] or f"{result['device']} (Triton interpreter)"
    lines = [
        "# Fuzz: random cases against the float32 reference",
        "",
        f"**{result['cases']} cases in {result['minutes']:.1f} min, {len(result['failures'])} failed.** "
        f"Master seed {result['seed']}; {where}; torch {result['torch']}, triton {result['triton']}; "
        f"commit {result['commit']}.",
        "",
    ]
    if result["failures"]:
        lines += ["## Failures", ""]
        for f in result["failures"]:
            lines.append(f"- `{f['repro']}`: {f['problems'][0]}"
                         + (f" (+{len(f['problems']) - 1} more)" if len(f["problems"]) > 1 else ""))
        lines.append("")
    lines += ["## Coverage", "", "| cases with | count |", "|---|---:|"]
    lines += [f"| {tag} | {count} |" for tag, count in result["coverage"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="run for this long")
    parser.add_argument("--cases", type=int, default=None, help="or this many cases")
    parser.add_argument("--seed", type=int, default=0, help="master seed (each case gets its own 64-bit seed)")
    parser.add_argument("--repro", type=int, default=None, help="run the one case with this seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for fuzz.json and fuzz.md (default benchmarks/results/<gpu>/ on the GPU; "
                             "none on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.repro is not None:
        case = draw_case(args.repro, device)
        print(json.dumps(case_record(case)))
        with poisoned_outputs():
            problems = run_case(case, device)
        print("\n".join(problems) or "ok")
        return 1 if problems else 0
    if args.minutes is None and args.cases is None:
        parser.error("give --minutes or --cases")
    start = time.monotonic()
    result = fuzz(args.seed, device, args.minutes, args.cases)
    result["minutes"] = (time.monotonic() - start) / 60
    print(f"{result['cases']} cases in {result['minutes']:.1f} min, {len(result['failures'])} failed")
    out = args.out or (results_dir(result["gpu"]) if device.type == "cuda" else None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = write_record(out, "fuzz", result, markdown(result))
        print(f"wrote {path} and its .md")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
