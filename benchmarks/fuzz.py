"""Random cases against an independent reference: ``python -m benchmarks.fuzz --minutes N --seed S``.

Each case draws, from its own 64-bit seed: a topology (k from 1 to 32), segment lengths with zeros, ones and
ragged ends, B, causal, a GQA ratio, fewer queries than keys with per-sample ``q_start``, per-sample lengths,
packed samples (``mbs_attention_varlen``), a dense ``attn_mask``, and dropout. What compiles stays on a small
menu (head dims, three dtypes, a few head counts), so only lengths, topology, S, B and seeds vary freely.
Outputs are NaN-poisoned; out, dq, dk and dv are checked against the float32 reference on sampled rows (every
row on the CPU, where S is small), within a few times the error of the same reference in the input dtype. It
prints the case count, the failures and a one-line repro for each, and exits 1 on any failure.

    python -m benchmarks.fuzz --minutes 10 --seed 1 --out benchmarks/results/h100   # GPU: S up to 64k
    python -m benchmarks.fuzz --cases 4 --seed 1 --device cpu                       # the interpreter, small S
    python -m benchmarks.fuzz --repro 1234567890123                                 # one case again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import mmsparse
from mmsparse.functional import new_dropout_seed
from mmsparse.ops.dropout import dropout_keep_rows
from mmsparse.reference import reference_group_rows
from mmsparse.topology import segment_ids

from .env import git_commit

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# A case passes when the kernel is within SLACK times the error of the same reference computed in the input
# dtype (FlashAttention's calibrated check), plus a floor.
SLACK = 3.0
# The floor, absolute for unit-scale inputs (times the output's max): 8 units in the last place of the input
# dtype. The backward reads the output rounded to that dtype (delta = rowsum(dO * O)), which the reference does
# not, so a gradient that is 0 in exact arithmetic (a query that sees one key) comes out at a few ulps; dK and dV
# sum that over the query heads of a GQA group (times sqrt(group)).
FLOOR = {"fp16": 8 * 2.0**-11, "bf16": 8 * 2.0**-8, "fp32": 1e-4}
SAMPLED_ROWS = 24


@dataclass
class Case:
    seed: int
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int
    topology: list[list[int]]
    seg_lens: list[list[int]]  # one row per sample, or a single row shared by the batch
    seq_k: int
    seq_q: int
    q_start: list[int] | None
    causal: bool
    dense: bool
    packed: bool
    dropout_p: float


def draw_case(seed: int, device: torch.device) -> Case:
    rng = random.Random(seed)
    gpu = device.type == "cuda"
    k = rng.choice([1, 2, 3, 3, 3, 4, 5, 8, 13, 32])
    topology = [[int(rng.random() < rng.choice([0.3, 0.6, 0.9])) for _ in range(k)] for _ in range(k)]
    dtype = rng.choice(list(DTYPES))
    head_dim = rng.choice([64, 128] if gpu else [16, 32, 40])
    heads_kv = rng.choice([1, 2])
    heads_q = heads_kv * rng.choice([1, 2, 4])
    packed = rng.random() < 0.15 and k <= 8
    batch = 1 if packed else rng.choice([1, 2, 3] if not gpu else [1, 2, 4, 8])
    max_seq = rng.choice([512, 4096, 65536]) if gpu else rng.choice([40, 96])
    samples = rng.randint(1, max(1, 32 // k)) if packed else batch
    per_sample = packed or (batch > 1 and rng.random() < 0.5)

    def lengths(budget: int) -> list[int]:
        cuts = sorted(rng.randint(0, budget) for _ in range(k - 1))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, budget])]
        for i in range(k):
            if rng.random() < 0.15:
                lens[i] = rng.choice([0, 1])
        return lens

    if packed:
        rows = [lengths(rng.randint(1, max(1, max_seq // samples))) for _ in range(samples)]
        seq_k = sum(sum(r) for r in rows)
    elif per_sample:
        seq_k = rng.randint(1, max_seq)
        rows = [lengths(rng.randint(0, seq_k)) for _ in range(batch)]
        rows[0] = lengths(seq_k)  # one sample fills the sequence
    else:
        rows = [lengths(rng.randint(1, max_seq))]
        rows[0][-1] += sum(rows[0]) == 0  # shared lengths cover the sequence, which has a token at least
        seq_k = sum(rows[0])
    seq_k = max(seq_k, 1, *(sum(r) for r in rows))  # the zeros and ones drawn above may lengthen a row
    decode = not packed and rng.random() < 0.25
    seq_q = rng.randint(1, min(16, seq_k)) if decode else seq_k
    q_start = [rng.randint(0, seq_k - seq_q) for _ in range(batch)] if decode and per_sample else None
    dense = not packed and not per_sample and rng.random() < 0.15
    dropout_p = rng.choice([0.1, 0.3]) if not packed and rng.random() < 0.15 else 0.0
    return Case(seed, dtype, head_dim, heads_q, heads_kv, batch, topology, rows, seq_k, seq_q, q_start,
                rng.random() < 0.4, dense, packed, dropout_p)


def _allowed_rows(case: Case, device: torch.device):
    """allowed(b, rows) -> bool [R, Sk]: the token mask of sample b by direct lookup (independent of the kernels'
    bits and block lists)."""
    k = len(case.topology)
    table = torch.zeros(k + 1, k + 1, dtype=torch.bool, device=device)
    table[:k, :k] = torch.tensor(case.topology, dtype=torch.bool, device=device)
    keys = torch.arange(case.seq_k, device=device)
    if case.packed:  # one sequence, block-diagonal over the samples
        seg = torch.cat([segment_ids(torch.tensor([r]), sum(r))[0] for r in case.seg_lens]).to(device)
        sample = torch.cat([torch.full((sum(r),), n) for n, r in enumerate(case.seg_lens)]).to(device)
    else:
        seg = segment_ids(torch.tensor(case.seg_lens), case.seq_k).to(device)  # [rows, Sk]

    def allowed(b: int, rows: torch.Tensor) -> torch.Tensor:
        if case.packed:
            m = table[seg[rows][:, None], seg[None, :]] & (sample[rows][:, None] == sample[None, :])
            pos = rows
        else:
            s = seg[b if seg.shape[0] > 1 else 0]
            start = case.q_start[b] if case.q_start is not None else case.seq_k - case.seq_q
            pos = start + rows
            m = table[s[pos][:, None], s[None, :]]
        return m & (keys[None, :] <= pos[:, None]) if case.causal else m

    return allowed


def run_case(case: Case, device: torch.device) -> list[str]:
    """The failures of one case (empty: it passed)."""
    dtype = DTYPES[case.dtype]
    gen = torch.Generator(device="cpu").manual_seed(case.seed & (2**63 - 1))
    shape_q = (case.batch, case.heads_q, case.seq_q, case.head_dim)
    shape_k = (case.batch, case.heads_kv, case.seq_k, case.head_dim)
    q = torch.randn(shape_q, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(shape_k, generator=gen).to(device, dtype).requires_grad_() for _ in "kv")
    do = torch.randn(shape_q, generator=gen).to(device, dtype)
    allowed = _allowed_rows(case, device)
    lens = case.seg_lens if len(case.seg_lens) > 1 or case.packed else case.seg_lens[0]
    torch.manual_seed(case.seed & (2**63 - 1))
    if case.packed:
        out = mmsparse.mbs_attention_varlen(q, k, v, case.topology, case.seg_lens, causal=case.causal)
    elif case.dense:
        mask = torch.cat([allowed(0, r) for r in torch.arange(case.seq_q, device=device).split(1024)])
        out = mmsparse.mbs_attention(q, k, v, attn_mask=mask, dropout_p=case.dropout_p)
    else:
        out = mmsparse.mbs_attention(q, k, v, case.topology, lens, causal=case.causal, dropout_p=case.dropout_p,
                                     q_start=case.q_start)
    out.backward(do)
    keep_for = None
    if case.dropout_p:
        torch.manual_seed(case.seed & (2**63 - 1))
        seed = new_dropout_seed(device)
        starts = case.q_start or [case.seq_k - case.seq_q] * case.batch
        past = torch.tensor(starts, dtype=torch.int32, device=device)

        def keep_for(b, h, idx):
            return torch.cat([dropout_keep_rows(seed, b * case.heads_q + h, 1, case.heads_q, int(r), 1, case.seq_k,
                                                case.dropout_p, past)[0] for r in idx.tolist()])

    failures = []
    group = case.heads_q // case.heads_kv
    gpu = device.type == "cuda"
    for b in range(case.batch):
        for hk in range(case.heads_kv):
            heads = slice(hk * group, (hk + 1) * group)
            rows = torch.arange(case.seq_q, device=device)
            if gpu and case.seq_q > SAMPLED_ROWS:
                rows = torch.randperm(case.seq_q, generator=gen)[:SAMPLED_ROWS].sort().values.to(device)
            cols = torch.arange(case.seq_k, device=device)
            if gpu and case.seq_k > SAMPLED_ROWS:
                cols = torch.randperm(case.seq_k, generator=gen)[:SAMPLED_ROWS].sort().values.to(device)
            keep = None if keep_for is None else (lambda g, idx, b=b, hk=hk: keep_for(b, hk * group + g, idx))
            args = (q[b, heads].detach(), k[b, hk].detach(), v[b, hk].detach(), do[b, heads],
                    lambda idx, b=b: allowed(b, idx), rows, cols)
            ref = reference_group_rows(*args, keep=keep, dropout_p=case.dropout_p, chunk=1024)
            plain = ref if dtype == torch.float32 else reference_group_rows(
                *args, dtype=dtype, keep=keep, dropout_p=case.dropout_p, chunk=1024)
            got = (out[b, heads][:, rows], q.grad[b, heads][:, rows], k.grad[b, hk][cols], v.grad[b, hk][cols])
            for name, a, e, p in zip(("out", "dq", "dk", "dv"), got, ref, plain):
                msg = _compare(a, e, p, case.dtype, group ** 0.5 if name in ("dk", "dv") else 1.0)
                if msg:
                    failures.append(f"{name}[b={b}, kv head {hk}]: {msg}")
    return failures


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


def fuzz(seed: int, device: torch.device, minutes: float | None, cases: int | None) -> dict[str, Any]:
    master = random.Random(seed)
    deadline = time.monotonic() + 60 * minutes if minutes else None
    done, failed = 0, []
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
        if problems:
            failed.append({"seed": case_seed, "problems": problems, "case": asdict(case)})
            print(f"FAIL case {case_seed}: {problems[0]}\n  repro: python -m benchmarks.fuzz --repro {case_seed} "
                  f"--device {device.type}", flush=True)
    return {"seed": seed, "cases": done, "failures": failed, "device": device.type,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "torch": torch.__version__, "commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="run for this long")
    parser.add_argument("--cases", type=int, default=None, help="or this many cases")
    parser.add_argument("--seed", type=int, default=0, help="master seed (each case gets its own 64-bit seed)")
    parser.add_argument("--repro", type=int, default=None, help="run the one case with this seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="folder for fuzz.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.repro is not None:
        case = draw_case(args.repro, device)
        print(json.dumps(asdict(case)))
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
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fuzz.json").write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
