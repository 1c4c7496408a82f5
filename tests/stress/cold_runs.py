"""The production flow, one fresh process a run: ``python -m tests.stress.cold_runs --runs N --out DIR``.

A user's first call in a new process is what a warm test process never sees: every cache of the package is empty,
the mask is built inside the call from lengths the process has not seen, and the backward runs at the sizes where
it takes its other paths (above ``SHORT_KEYS`` its dQ pass runs on a side stream beside dK/dV). Each run here is a
new Python process that draws its lengths from its own seed (each segment within 10% of the config's), makes
NaN-poisoned outputs, runs forward and backward once, and checks out, dq on sampled rows and dK/dV on every key
row of the first KV head against the float32 reference (:func:`tests.stress.fuzz.run_case`, whose reference reads
neither the kernels' bits nor their block lists).

The configs cover segment codes (pair types, more than 32 segments, a pack), bit masks, a dense mask, GQA,
causal, per-sample lengths, three head dims (64, 128, 256), and both dialects (``MMSPARSE_GLUON=0`` runs the tl
kernels where the Gluon ones would). Runs cycle through them. ``--parallel P`` keeps P processes on the GPU at once.

The record, ``DIR/cold_runs.json`` and ``.md`` (default ``benchmarks/results/<gpu>/``), adds each invocation's
runs to those already there at the same commit and GPU, since a few hundred processes do not fit one command of
a GPU lease; a record from another commit is replaced. Set ``MMSPARSE_COMMIT`` where the tree has no ``.git``.
Seeds continue after the record's, so each invocation draws new lengths. Exits 1 when any run was wrong.

Without CUDA the children run tiny versions of the configs through Triton's interpreter: a check of the tool.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.arguments import at_least_one
from benchmarks.env import REPO_DIR, environment, results_dir

CODES5 = ((2, 0, 0, 0, 0), (1, 1, 0, 0, 0), (2, 1, 2, 0, 0), (1, 1, 1, 1, 0), (2, 0, 2, 0, 2))
CYCLIC = ((0, 1, 0), (0, 0, 1), (1, 0, 0))
HUB = ((1, 1, 1), (1, 1, 0), (1, 0, 1))
TRANSFUSION = ((2, 0, 0, 0), (2, 1, 0, 0), (2, 2, 2, 0), (2, 2, 2, 1))  # text, image, text, image
STDERR_LINES = 8  # lines of a crashed child's stderr kept in the record


@dataclass(frozen=True)
class ColdConfig:
    name: str
    types: tuple[tuple[int, ...], ...]
    seg_lens: tuple[tuple[int, ...], ...]  # one row (shared), a row per sample, or the samples of a pack
    shape: tuple[int, int, int, int]  # head dim, query heads, key/value heads, batch
    dtype: str = "bf16"
    causal: bool = False
    packed: bool = False
    dense: bool = False
    gluon: bool = True  # False: MMSPARSE_GLUON=0, the tl kernels only


def _many_segments(k: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """k segments of NONE/FULL/CAUSAL pairs (a fixed draw), each seeing itself."""
    rng = random.Random(seed)
    return tuple(tuple(2 if r == c else rng.choice((0, 0, 1, 2)) for c in range(k)) for r in range(k))


def _pack(samples: int, seed: int) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(seed)
    return tuple((rng.randint(16, 160), rng.randint(200, 900), rng.randint(0, 300)) for _ in range(samples))


GPU_CONFIGS = [
    ColdConfig("codes5", CODES5, ((1500, 8192, 600, 8192, 2000),), (128, 16, 4, 1)),
    ColdConfig("codes5_tl", CODES5, ((1500, 8192, 600, 8192, 2000),), (128, 16, 4, 1), gluon=False),
    ColdConfig("cyclic_bits", CYCLIC, ((1500, 12288, 6000),), (128, 16, 4, 1)),
    ColdConfig("cyclic_bits_tl", CYCLIC, ((1500, 12288, 6000),), (128, 16, 4, 1), gluon=False),
    ColdConfig("hub_causal_d64_per_sample", HUB, ((1024, 7168, 2048), (512, 4096, 1536)), (64, 8, 2, 2),
               dtype="fp16", causal=True),
    ColdConfig("segments48", _many_segments(48, 1), ((260,) * 48,), (128, 8, 2, 1)),
    ColdConfig("transfusion_tl_d64", TRANSFUSION, ((900, 4096, 700, 4096),), (64, 8, 8, 1), gluon=False),
    ColdConfig("pack24_causal", HUB, _pack(24, 2), (128, 8, 2, 1), causal=True, packed=True),
    ColdConfig("dense_mask", TRANSFUSION, ((700, 3000, 500, 3000),), (128, 8, 4, 1), dtype="fp16", dense=True),
    ColdConfig("transfusion_d256", TRANSFUSION, ((1500, 4096, 900, 4096),), (256, 16, 4, 1)),  # Gemma's head dim
]
CPU_CONFIGS = [  # through the interpreter: a check of the tool, not a measurement
    ColdConfig("codes5_tiny", CODES5, ((9, 20, 5, 17, 11),), (16, 2, 1, 1)),
    ColdConfig("cyclic_bits_tiny", CYCLIC, ((9, 30, 21),), (16, 2, 2, 1), dtype="fp32", causal=True),
]


def configs_for(device: torch.device) -> list[ColdConfig]:
    return GPU_CONFIGS if device.type == "cuda" else CPU_CONFIGS


def jittered(seg_lens: tuple[tuple[int, ...], ...], seed: int) -> list[list[int]]:
    """The config's lengths, each moved by up to 10% (at least 1 token) by ``seed``: lengths no process has
    built a mask for."""
    rng = random.Random(seed)
    return [[max(0, n + rng.randint(-max(1, n // 10), max(1, n // 10))) if n else 0 for n in row] for row in seg_lens]


def make_case(cfg: ColdConfig, seed: int) -> Any:
    """The :class:`tests.stress.fuzz.Case` of one run: the config with jittered lengths, given as a host list or a
    device tensor by the seed."""
    from .fuzz import Case

    rows = jittered(cfg.seg_lens, seed)
    head_dim, heads_q, heads_kv, batch = cfg.shape
    if cfg.packed or len(rows) == 1:
        seq_k = sum(map(sum, rows))
    else:
        seq_k = max(map(sum, rows))
    pair_types = "012" if any(2 in row for row in cfg.types) else "01"
    lens_as = "tensor" if seed % 2 and not cfg.dense else "list"
    return Case(seed, cfg.dtype, head_dim, heads_q, heads_kv, batch, len(cfg.types), "given", pair_types, 0, rows,
                seq_k, seq_k, None, cfg.causal, cfg.dense, cfg.packed, 0.0, lens_as=lens_as, types=cfg.types)


def child(name: str, seed: int, device_name: str) -> int:
    """One run in this (fresh) process: print one JSON line ``{"problems": [...], "seconds": ...}``."""
    from tests.poison import poisoned_empty

    from .fuzz import run_case

    device = torch.device(device_name)
    cfg = {c.name: c for c in configs_for(device)}[name]
    case = make_case(cfg, seed)
    start = time.monotonic()
    with poisoned_empty():
        problems = run_case(case, device)
    print(json.dumps({"problems": problems, "seconds": round(time.monotonic() - start, 2), "seq": case.seq_k}))
    return 0


@dataclass
class RunResult:
    config: str
    seed: int
    wrong: bool
    detail: str  # the first problem, or the end of a crashed child's stderr
    seconds: float


def run_child(cfg: ColdConfig, seed: int, device_name: str, timeout: float) -> Callable[[], RunResult]:
    """Start one run; the returned function waits for it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cfg.gluon:
        env["MMSPARSE_GLUON"] = "0"
    cmd = [sys.executable, "-m", "tests.stress.cold_runs", "--child", cfg.name, "--seed", str(seed),
           "--device", device_name]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_DIR)
    start = time.monotonic()

    def wait() -> RunResult:
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return RunResult(cfg.name, seed, True, f"timed out after {timeout:.0f} s", time.monotonic() - start)
        line = out.strip().splitlines()[-1] if out.strip() else ""
        try:
            report = json.loads(line)
        except json.JSONDecodeError:
            tail = " | ".join(err.strip().splitlines()[-STDERR_LINES:])
            return RunResult(cfg.name, seed, True, f"exit {proc.returncode}: {tail}", time.monotonic() - start)
        problems = report["problems"]
        return RunResult(cfg.name, seed, bool(problems), problems[0] if problems else "", report["seconds"])

    return wait


def run_all(configs: list[ColdConfig], runs: int, first_seed: int, parallel: int, device_name: str,
            timeout: float) -> list[RunResult]:
    """``runs`` fresh processes cycling through ``configs``, ``parallel`` at a time, seeds from ``first_seed``."""
    pending = [(configs[i % len(configs)], first_seed + i) for i in range(runs)]
    running: list[Callable[[], RunResult]] = []
    results: list[RunResult] = []
    while pending or running:
        while pending and len(running) < parallel:
            running.append(run_child(*pending.pop(0), device_name, timeout))
        result = running.pop(0)()
        results.append(result)
        mark = "WRONG" if result.wrong else "ok"
        print(f"{len(results):4d}/{runs} {result.config:28s} seed {result.seed:6d} {mark:5s} {result.seconds:6.1f} s"
              + (f"  {result.detail}" if result.wrong else ""), flush=True)
    return results


def merge(old: dict[str, Any] | None, results: list[RunResult], env: dict[str, str], parallel: int) -> dict[str, Any]:
    """The record with this invocation's runs added (``old`` counts only at the same commit and GPU)."""
    same = old is not None and old.get("commit") == env["commit"] and old.get("gpu") == env["gpu"]
    record: dict[str, Any] = old if same else {"runs": 0, "wrong": 0, "configs": {}, "failures": [],
                                              "invocations": [], "next_seed": 0}
    record.update(env)
    for r in results:
        row = record["configs"].setdefault(r.config, {"runs": 0, "wrong": 0})
        row["runs"] += 1
        row["wrong"] += r.wrong
        if r.wrong:
            record["failures"].append({"config": r.config, "seed": r.seed, "detail": r.detail})
    record["runs"] += len(results)
    record["wrong"] += sum(r.wrong for r in results)
    record["next_seed"] = max([record["next_seed"], *(r.seed + 1 for r in results)])
    record["invocations"].append({"runs": len(results), "wrong": sum(r.wrong for r in results),
                                  "parallel": parallel, "seconds": round(sum(r.seconds for r in results), 1)})
    return record


def markdown(record: dict[str, Any]) -> str:
    lines = [
        "# Cold runs: one fresh process a run, the mask built in the call",
        "",
        f"**{record['runs']} runs, {record['wrong']} wrong.** {record['gpu']}; torch {record['torch']}, triton "
        f"{record['triton']}; commit {record['commit']}; {len(record['invocations'])} invocations "
        f"(processes at once: {', '.join(str(i['parallel']) for i in record['invocations'])}).",
        "",
        "Each run checks out and dq on sampled rows and dK/dV on every key row of the first KV head against the "
        "float32 reference (`python -m tests.stress.cold_runs`).",
        "",
        "| config | runs | wrong |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {row['runs']} | {row['wrong']} |" for name, row in record["configs"].items()]
    if record["failures"]:
        lines += ["", "## Wrong runs", ""]
        lines += [f"- {f['config']} seed {f['seed']}: {f['detail']}" for f in record["failures"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress.cold_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=at_least_one, default=20, help="fresh processes to run")
    parser.add_argument("--parallel", type=at_least_one, default=1, help="processes at once")
    parser.add_argument("--configs", default=None, help="comma-separated config names (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="record folder (default benchmarks/results/<gpu>)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the children, before they import triton
    if args.child is not None:
        return child(args.child, args.seed, device_name)
    device = torch.device(device_name)
    configs = configs_for(device)
    if args.configs:
        by_name = {c.name: c for c in configs}
        unknown = [n for n in args.configs.split(",") if n not in by_name]
        if unknown:
            parser.error(f"unknown configs {unknown}; known: {', '.join(by_name)}")
        configs = [by_name[n] for n in args.configs.split(",")]
    env = environment(device)
    out = args.out or results_dir(env["gpu"])
    path = out / "cold_runs.json"
    old = json.loads(path.read_text()) if path.exists() else None
    first_seed = old["next_seed"] if old and old.get("commit") == env["commit"] else 0
    results = run_all(configs, args.runs, first_seed, args.parallel, device_name, args.timeout)
    record = merge(old, results, env, args.parallel)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    (out / "cold_runs.md").write_text(markdown(record))
    wrong = sum(r.wrong for r in results)
    print(f"{len(results)} runs, {wrong} wrong; record: {record['runs']} runs, {record['wrong']} wrong ({path})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
