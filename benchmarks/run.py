"""mmsparse against the attention a user would otherwise reach for, side by side in one process, on the same inputs.

Implementations (``--impls``), see :mod:`benchmarks.baselines`: ``mmsparse``, ``flex`` (FlexAttention with the
same topology as a ``mask_mod``), ``sdpa_mask`` (SDPA with a dense bool mask), ``dense_flash`` (FlashAttention-2,
no mask).
``flex_flash``: ``flex`` on FLASH (FA-4; torch >= 2.11, sm_90; to install it: benchmarks/README.md, "Installing the
FLASH backend").

Method:
  - bf16 inputs ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, S, D]`` with requires_grad; one ``dout``.
  - Before timing a config, every implementation's output and its dq/dk/dv are compared with a float32 dense
    reference (``mmsparse.reference_attention``) on one (batch, kv-head) slice, in row chunks so that no
    S x S float tensor is made. A mismatch prints a loud FAIL and is recorded in the row (``correct``).
  - ``fwd_ms``: median of ``triton.testing.do_bench`` over the forward with autograd on (the forward of training);
    ``fwdbwd_ms``: forward + backward; ``bwd_ms`` = the difference. ``--rounds`` (default 3) times every
    implementation of a config that many times, interleaved, and each row keeps its best round.
  - TFLOP/s count live (allowed) pairs only: fwd 4·B·Hq·D·live, bwd 2.5x that.
  - ``peak_mib``: peak CUDA memory of one forward + backward above what was allocated before it.
    ``state_mib``: memory held by the mask state. ``build_ms``: host wall time (with syncs) to build the mask
    metadata from scratch.

Usage::

    python -m benchmarks                          # all configs, all implementations
    python -m benchmarks --quick                  # seed, mm13k_cyclic, mm13k_hub, fewer reps
    python -m benchmarks --configs mm13k_hub,mm43k_cyclic --impls mmsparse,flex
    python -m benchmarks --configs masks,mm13k_hub_causal --impls mmsparse,flex,dense_flash   # a group + a config
    python -m benchmarks --isolate                # one subprocess per (config, impl)
    python -m benchmarks --configs video_64k --update   # replace these configs' rows in the record at --out
    python -m benchmarks --device cpu --tiny      # CPU smoke test of the whole flow (times mean nothing; no Flex,
                                                  # which has no CPU backward, and no TF/s)

Writes ``latest.json``, ``latest.md`` and, when matplotlib imports, ``latest.png`` under ``--out`` (default
``benchmarks/results/<gpu>/``, e.g. ``h100``; a new temporary folder on a CPU or with ``--tiny``): the current run only,
or with ``--update`` merged into the record already there (:mod:`benchmarks.record_merge`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mmsparse  # before triton: on a machine without CUDA it turns on Triton's interpreter

from .arguments import at_least_one
from .baselines import DEFAULT_IMPLS, IMPLS, NOT_ON_CPU
from .configs import ALL_CONFIGS, GPU_CONFIGS, GROUPS, QUICK, TINY, BenchConfig, expand_names
from .env import environment, record_dir
from .errors import DeviceLost
from .record_merge import merged, rows_kept
from .report import log, write_final, write_json
from .runner import Runner, base_row, run_isolated
from .timing import Timing

TOPIC = "latest"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"configs {', '.join(QUICK)} and shorter timing")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated config or group names; groups: {', '.join(GROUPS)}; configs: "
                        f"{', '.join(ALL_CONFIGS)}")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated, from: {', '.join(IMPLS)} (default: all but mmsparse_nondet; on a CPU also "
                        f"without {', '.join(NOT_ON_CPU)}, which cannot be timed there)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default benchmarks/results/<gpu>; a temporary folder on a CPU or with --tiny)")
    p.add_argument("--device", default="cuda", help="default cuda")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warmup in ms (default 25, quick 10)")
    p.add_argument("--rep", type=int, default=None, help="do_bench measuring time in ms (default 200, quick 50)")
    p.add_argument("--rounds", type=at_least_one, default=None,
                   help="timing rounds over the implementations of a config, interleaved; each row keeps its best "
                        "(default 3, quick 1)")
    p.add_argument("--no-grad-check", dest="grad_check", action="store_false",
                   help="check only the outputs, not dq/dk/dv")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    p.add_argument("--isolate", action="store_true",
                   help="run each (config, impl) in its own subprocess, so a CUDA crash costs one row")
    p.add_argument("--update", action="store_true",
                   help="merge into the record already in the output folder: its rows of other configs stay, so that "
                        "one record can be measured in several runs (each config's rows still in one process) at one "
                        "commit, GPU and versions; refused otherwise")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of recorded errors")
    p.add_argument("--tiny", action="store_true", help="the tiny configs (CPU smoke test; writes to a temp folder)")
    p.add_argument("--cpu-reps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--cpu-warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one --isolate subprocess
    return p.parse_args(argv)


def select(args: argparse.Namespace) -> tuple[list[BenchConfig], list[str]]:
    if args.configs:
        names = expand_names(n.strip() for n in args.configs.split(",") if n.strip())
    else:
        names = list(TINY if args.tiny else QUICK if args.quick else GPU_CONFIGS)
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if args.impls is None:
        impls = [n for n in DEFAULT_IMPLS if n not in left_out_on_cpu(args)]
    else:
        impls = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown += [n for n in impls if n not in IMPLS]
    if unknown:
        raise SystemExit(f"unknown config/impl: {', '.join(unknown)}; groups: {', '.join(GROUPS)}; configs: "
                         f"{', '.join(ALL_CONFIGS)}; impls: {', '.join(IMPLS)}")
    return [ALL_CONFIGS[n] for n in names], impls


def left_out_on_cpu(args: argparse.Namespace) -> list[str]:
    """The default implementations a CPU run leaves out (:data:`benchmarks.baselines.NOT_ON_CPU`); none when
    ``--impls`` names the implementations or the device is not a CPU."""
    if args.impls is not None or torch.device(args.device).type != "cpu":
        return []
    return [n for n in DEFAULT_IMPLS if n in NOT_ON_CPU]


def _run_here(args: argparse.Namespace, configs: list[BenchConfig], impls: list[str], device: torch.device,
              timing: Timing, env: dict[str, str], save: Any) -> tuple[list[dict[str, Any]], int]:
    runner = Runner(device, timing, env, len(configs) * len(impls), save, grad_check=args.grad_check)
    remaining = list(configs)
    status = 0
    try:
        while remaining:
            runner.run_config(remaining[0], impls)
            remaining.pop(0)
    except DeviceLost as e:
        log(f"CUDA context lost ({e}); the remaining rows were not run. Rerun them with --isolate.")
        for cfg in remaining[1:]:
            for name in impls:
                row = base_row(cfg, name, env, timing)
                row["error"] = "not run: CUDA context lost earlier in this process"
                runner.emit(row)
        status = 3
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
        status = 130
    return runner.rows, status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verbose:
        os.environ["BENCH_VERBOSE"] = "1"
    configs, impls = select(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device here; for a CPU smoke test of the harness: --device cpu --tiny")
        return 2
    torch.set_float32_matmul_precision("highest")  # the float32 reference must not run in TF32
    if device.type == "cpu":  # smoke test: tiny ops, where OpenMP threads mostly spin against each other
        torch.set_num_threads(1)
    if device.type == "cpu" and not mmsparse.interpreter_active():
        log("warning: Triton's interpreter is off, so mmsparse cannot run on CPU tensors (set TRITON_INTERPRET=1)")
    env = environment(device)
    out_dir = args.out
    if out_dir is None:
        out_dir = record_dir(env["gpu"], TOPIC, smoke=args.tiny)
    timing = Timing(device, args.warmup or (10 if args.quick else 25), args.rep or (50 if args.quick else 200),
                    cpu_warmup=args.cpu_warmup, cpu_reps=args.cpu_reps,
                    rounds=args.rounds or (1 if args.quick or args.tiny else 3))
    for name in ("recompile_limit", "cache_size_limit"):  # one Flex compile per config and grad mode
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    log(f"mmsparse benchmark: {env}; {timing.method}; out {out_dir}")
    log(f"configs {', '.join(c.name for c in configs)}; impls {', '.join(impls)}")
    left_out = left_out_on_cpu(args)
    if left_out:
        log(f"not run on a CPU: {'; '.join(f'{n} ({NOT_ON_CPU[n]})' for n in left_out)}; name them in --impls to "
            "run them anyway; no TF/s either (the interpreter's rate says nothing of the kernels)")

    # --update: the record's rows of the configs this run does not measure
    kept = rows_kept(out_dir / f"{TOPIC}.json", env, {c.name for c in configs}) if args.update else []

    def save(rows: list[dict[str, Any]]) -> None:  # after every row: a crash keeps what was measured
        write_json(merged(kept, rows), out_dir / f"{TOPIC}.json")

    start = time.perf_counter()
    if args.isolate:
        rows, status = run_isolated(args, configs, impls, env, timing, save), 0
    else:
        rows, status = _run_here(args, configs, impls, device, timing, env, save)
    if args.child:
        save(rows)
        return status
    table = write_final(merged(kept, rows), out_dir, timing.method, args.plot, TOPIC)
    log("")
    log(table)
    failed = [f"{r['config']}/{r['impl']}" for r in rows if r.get("check") == "FAIL"]
    if failed:
        log(f"!!! FAIL: {', '.join(failed)} do not match the reference")
    log(f"wrote {out_dir}/{TOPIC}.{{json,md}} in {time.perf_counter() - start:.0f} s")
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
