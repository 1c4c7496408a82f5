"""Each rank's local attention under the context-parallel plan, timed on one GPU: ``python -m tools.cp_local``.

For each long-sequence layout (``benchmarks.cp_cases.LONG_LAYOUTS``) and world size P, every rank's problem in turn,
in one process (no process group): its queries, the K/V it gathers, and the forward (pieces and merge) and backward that
``ContextParallel.attention`` runs (:mod:`mmsparse.distributed.local`), without the exchange. The plan balances
live pairs; this measures whether the time follows. Per (config, P): max/mean over the ranks of the live pairs
(target <= 1.05) and of the forward + backward time (target <= 1.10). B=1, Hq=16, Hkv=4, D=128, bf16. Each pass is
timed by the wall clock with a device sync around each call, median of a few calls after warm-up (calls of up to
seconds: ``do_bench``'s five estimating calls would cost minutes on long_1m).

    python -m tools.cp_local --out DIR                           # DIR/cp_local.{json,md}
    python -m tools.cp_local --configs tiny_hub_causal --worlds 2,3   # smoke test (times mean nothing)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.arguments import names_in
from benchmarks.configs import CYCLIC, HUB
from benchmarks.cp_cases import LONG_LAYOUTS
from benchmarks.cp_rank import RankInputs, local_backward, local_forward
from benchmarks.devices import free_memory, sync
from benchmarks.env import environment
from benchmarks.report import log, write_record
from benchmarks.timing import host_ms
from mmsparse.distributed import RankProblem

TOPIC = "cp_local"
PAIRS_TARGET, TIME_TARGET = 1.05, 1.10  # max/mean over the ranks
WORLD_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class Shape:
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int


@dataclass(frozen=True)
class LocalConfig:
    """One sequence layout, its shape, how many untimed (``warmup``, at least 1: the first call compiles and
    builds the pieces' block lists) and timed calls (``reps``) each pass gets per rank, and the tile its chunks are
    multiples of (``tile``; None: ``RankProblem``'s, 128 rows on a GPU and 16 in the interpreter)."""

    name: str
    topology: Any
    seg_lens: tuple[int, ...]
    causal: bool
    shape: Shape
    warmup: int
    reps: int
    tile: int | None = None


GPU_SHAPE = Shape(1, 16, 4, 128)
TINY_SHAPE = Shape(1, 2, 1, 16)
# long_1m: all ranks of one P together take about as long as the whole sequence (~20 s a fwd + bwd on an H100)
_COUNTS = {"cyclic_43k": (3, 10), "hub_causal_256k": (1, 5), "long_1m": (1, 2)}
CONFIGS: dict[str, LocalConfig] = {
    name: LocalConfig(name, topology, seg_lens, causal, GPU_SHAPE, *_COUNTS[name])
    for name, (topology, seg_lens, causal) in LONG_LAYOUTS.items()
}
# Smoke tests (through the interpreter on a CPU): ragged lengths, several chunks a rank, in 16-token chunks on any
# device (a GPU's 128-row tile would put each of these sequences on rank 0 alone)
TINY: dict[str, LocalConfig] = {
    c.name: c
    for c in (
        LocalConfig("tiny_cyclic", CYCLIC, (13, 50, 37), False, TINY_SHAPE, 1, 1, tile=16),
        LocalConfig("tiny_hub_causal", HUB, (20, 70, 41), True, TINY_SHAPE, 1, 1, tile=16),
        LocalConfig("tiny_pair_types", ((2, 0, 0), (1, 1, 0), (1, 2, 2)), (30, 40, 27), False, TINY_SHAPE, 1, 1,
                    tile=16),
    )
}
ALL_CONFIGS = {**CONFIGS, **TINY}


def rank_inputs(problem: RankProblem, shape: Shape, dtype: torch.dtype, device: torch.device,
                seed: int = 0, full: Sequence[torch.Tensor] | None = None) -> RankInputs:
    """Random inputs of ``problem``, or with ``full`` (q, k, v, dout of the whole sequence) the rank's share of
    them: its tokens' q, k, v, dout and the K/V of the keys it gathers."""
    index = problem.token_index.to(device)
    gathered = problem.gathered_positions().to(device)
    if full is None:
        gen = torch.Generator(device=device).manual_seed(seed)

        def rnd(heads: int, n: int) -> torch.Tensor:
            return torch.randn(shape.batch, heads, n, shape.head_dim, generator=gen, device=device, dtype=dtype)

        q, k, v, dout = (rnd(h, problem.local_len) for h in (shape.heads_q, shape.heads_kv, shape.heads_kv,
                                                             shape.heads_q))
        kv_g = rnd(2 * shape.heads_kv, gathered.numel())
    else:
        q, k, v, dout = (t.to(device=device, dtype=dtype).index_select(2, index) for t in full)
        kv_g = torch.cat([full[1], full[2]], dim=1).to(device=device, dtype=dtype).index_select(2, gathered)
    hkv = k.shape[1]
    return RankInputs(q, k, v, dout, kv_g[:, :hkv], kv_g[:, hkv:])


def time_rank(cfg: LocalConfig, world: int, rank: int, device: torch.device, warmup: int, reps: int) -> dict:
    """One rank's row: its sizes, live pairs, and the median fwd and bwd ms over ``reps`` calls each."""
    problem = RankProblem(cfg.topology, cfg.seg_lens, rank, world, causal=cfg.causal, tile=cfg.tile)
    shape = cfg.shape
    x = rank_inputs(problem, shape, torch.bfloat16, device, seed=rank)
    scale = shape.head_dim**-0.5
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out, lse = local_forward(problem, x, scale)  # the first calls compile and build the pieces' block lists
    local_backward(problem, x, out, lse, scale)
    sync(device)
    first_s = time.perf_counter() - t0
    fwd = host_ms(lambda: local_forward(problem, x, scale), device, reps, reps, warmup_calls=warmup - 1)
    bwd = host_ms(lambda: local_backward(problem, x, out, lse, scale), device, reps, reps, warmup_calls=warmup - 1)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    pairs = problem.live_pairs * shape.batch
    flops = 4.0 * shape.heads_q * shape.head_dim * pairs
    row = {"config": cfg.name, "world_size": world, "rank": rank, "chunk": problem.plan.chunk,
           "tokens": problem.local_len, "gathered": int(problem.gathered_positions().numel()),
           "pieces": len(problem.pieces(device)), "live_pairs": pairs, "fwd_ms": fwd, "bwd_ms": bwd,
           "fwdbwd_ms": fwd + bwd, "fwd_tflops": flops / fwd / 1e9 if fwd > 0 else None,
           "bwd_tflops": 2.5 * flops / bwd / 1e9 if bwd > 0 else None, "peak_mib": peak, "first_call_s": first_s}
    return row


def ratio(values: Sequence[float]) -> float:
    """max / mean (1.0 when all are 0)."""
    mean = statistics.fmean(values)
    return max(values) / mean if mean else 1.0


def summarize(ranks: list[dict]) -> dict:
    """The (config, P) row from its ranks' rows: max/mean of pairs and times, against the targets."""
    first = ranks[0]
    row: dict[str, Any] = {"config": first["config"], "world_size": first["world_size"], "chunk": first["chunk"]}
    for key in ("live_pairs", "fwd_ms", "bwd_ms", "fwdbwd_ms"):
        row[f"{key}_ratio"] = ratio([r[key] for r in ranks])
    row["max_fwdbwd_ms"] = max(r["fwdbwd_ms"] for r in ranks)
    row["sum_fwdbwd_ms"] = sum(r["fwdbwd_ms"] for r in ranks)
    row["pairs_ok"] = row["live_pairs_ratio"] <= PAIRS_TARGET
    row["time_ok"] = row["fwdbwd_ms_ratio"] <= TIME_TARGET
    return row


def run(configs: Sequence[LocalConfig], worlds: Sequence[int], device: torch.device, warmup: int | None = None,
        reps: int | None = None) -> tuple[list[dict], list[dict]]:
    """(summary rows, rank rows) of every config and world size; ``warmup``/``reps`` override the configs'."""
    summary, ranks = [], []
    for cfg in configs:
        w, n = max(1, warmup or cfg.warmup), reps or cfg.reps
        for world in worlds:
            log(f"== {cfg.name} P={world}: warm-up {w}, {n} timed calls a pass, per rank")
            rows = []
            for rank in range(world):
                row = time_rank(cfg, world, rank, device, w, n)
                free_memory(device)  # the rank's tensors went with time_rank's frame
                log(f"   rank {rank}: {row['tokens']} tokens, {row['gathered']} gathered keys, {row['pieces']} "
                    f"pieces, {row['live_pairs']:,} live pairs; fwd {row['fwd_ms']:.2f} ms, bwd "
                    f"{row['bwd_ms']:.2f} ms (first calls {row['first_call_s']:.1f} s)")
                rows.append(row)
            ranks += rows
            summary.append(summarize(rows))
            s = summary[-1]
            log(f"   max/mean: pairs {s['live_pairs_ratio']:.3f}, fwd {s['fwd_ms_ratio']:.3f}, bwd "
                f"{s['bwd_ms_ratio']:.3f}, fwd+bwd {s['fwdbwd_ms_ratio']:.3f}")
    return summary, ranks


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _shape_text(shape: dict) -> str:
    return f"B={shape['batch']}, Hq={shape['heads_q']}, Hkv={shape['heads_kv']}, D={shape['head_dim']}"


def markdown(record: dict) -> str:
    env = record["env"]
    shapes = sorted({_shape_text(c["shape"]) for c in record["configs"].values()})
    lines = [f"Run: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. "
             f"{'; '.join(shapes)}, {record['dtype']}. Each rank's local attention alone (no exchange); "
             f"{record['timer']}.", "",
             f"Targets (max/mean over the ranks): live pairs <= {PAIRS_TARGET}, fwd+bwd time <= {TIME_TARGET}.", "",
             "| config | ranks | chunk | live pairs max/mean | fwd max/mean | bwd max/mean | fwd+bwd max/mean | "
             "slowest rank fwd+bwd ms | all ranks fwd+bwd ms | pairs target | time target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in record["summary"]:
        lines.append(f"| {s['config']} | {s['world_size']} | {s['chunk']} | {s['live_pairs_ratio']:.3f} | "
                     f"{s['fwd_ms_ratio']:.3f} | {s['bwd_ms_ratio']:.3f} | {s['fwdbwd_ms_ratio']:.3f} | "
                     f"{s['max_fwdbwd_ms']:.1f} | {s['sum_fwdbwd_ms']:.1f} | {_mark(s['pairs_ok'])} | "
                     f"{_mark(s['time_ok'])} |")
    lines += ["", "| config | ranks | rank | tokens | gathered keys | pieces | live pairs | fwd ms | bwd ms | "
              "fwd TF/s | bwd TF/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["ranks"]:
        tf = [f"{r[k]:.0f}" if r[k] is not None else "-" for k in ("fwd_tflops", "bwd_tflops")]
        lines.append(f"| {r['config']} | {r['world_size']} | {r['rank']} | {r['tokens']} | {r['gathered']} | "
                     f"{r['pieces']} | {r['live_pairs']:,} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
                     f"{tf[0]} | {tf[1]} |")
    return "\n".join(lines) + "\n"


def _worlds(text: str) -> list[int]:
    worlds = [int(w) for w in text.split(",") if w]
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be positive ints; got {text!r}")
    return worlds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cp_local", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=names_in(ALL_CONFIGS), default=list(CONFIGS),
                        help=f"comma-separated, from: {', '.join(ALL_CONFIGS)} (default: {', '.join(CONFIGS)})")
    parser.add_argument("--worlds", type=_worlds, default=list(WORLD_SIZES), help="comma-separated (default 2,4,8)")
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {TOPIC}.json and {TOPIC}.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls a pass and rank (default: per config)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls a pass and rank (default: per config)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    configs = [ALL_CONFIGS[n] for n in args.configs]
    env = environment(device)
    log(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    start = time.perf_counter()
    summary, ranks = run(configs, args.worlds, device, args.warmup, args.reps)
    record = {"env": env, "dtype": "bf16",
              "timer": "wall clock with a device sync around each call, median of the timed calls",
              "targets": {"live_pairs": PAIRS_TARGET, "fwdbwd_ms": TIME_TARGET},
              "configs": {c.name: asdict(c) for c in configs},
              "summary": summary, "ranks": ranks, "total_s": time.perf_counter() - start}
    table = markdown(record)
    print(table, end="", flush=True)
    if args.out is not None:
        path = write_record(args.out, TOPIC, record, table)
        log(f"wrote {path} and its .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
