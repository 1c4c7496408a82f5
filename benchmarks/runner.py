"""Run configs: set up and check every implementation, time them in interleaved rounds, fill one row each."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from .baselines import SETUPS
from .cases import Case
from .check import check
from .configs import BenchConfig, live_pairs
from .devices import device_alive, free_memory, sync
from .env import REPO_DIR
from .errors import DeviceLost, Skip, short_error
from .impl import Impl, TensorFn
from .report import check_line, log, loud_fail, progress_line
from .timing import Timing

ROW_KEYS = (
    "config", "impl", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "peak_mib", "build_ms",
    "gpu", "torch", "triton", "commit",
)
Rows = list[dict[str, Any]]


def base_row(cfg: BenchConfig, impl: str, env: dict[str, str], timing: Timing) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(config=cfg.name, impl=impl, **env)
    row.update(
        fwdbwd_ms=None, state_mib=None, correct=None, max_err=None, rel_err=None, check=None, backend=None,
        error=None, reference=None, batch=cfg.batch, heads_q=cfg.heads_q, heads_kv=cfg.heads_kv,
        head_dim=cfg.head_dim, seq_len=cfg.seq_k, seq_q=cfg.q_len, seg_lens=_json_lens(cfg.seg_lens),
        topology=cfg.topology_name, segments=cfg.num_segments, packed=cfg.packed, causal=cfg.causal,
        window=cfg.window, density=round(cfg.density, 4), live_pairs=cfg.live_pairs, dtype="bf16", timer=timing.method,
    )
    if cfg.packed:
        row["samples"] = len(cfg.rows)
    return row


def _json_lens(seg_lens: Any) -> list[Any]:
    return [list(x) if isinstance(x, tuple) else x for x in seg_lens]


def add_error(row: dict[str, Any], stage: str, exc: BaseException, device: torch.device) -> None:
    """Record a stage's failure in the row; raise DeviceLost if it took the CUDA context with it."""
    message = f"{stage}: {short_error(exc)}"
    row["error"] = f"{row['error']} | {message}" if row.get("error") else message
    if os.environ.get("BENCH_VERBOSE"):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    if not device_alive(device):
        raise DeviceLost(message) from exc


def peak_mib(case: Case, impl: Impl | TensorFn) -> float | None:
    """Peak CUDA memory of one forward + backward of ``impl`` (or a bare call) above what was allocated before it;
    None off the GPU."""
    fn = impl.fn if isinstance(impl, Impl) else impl
    if case.device.type != "cuda":
        return None
    case.clear_grads()
    free_memory(case.device)
    sync(case.device)
    base = torch.cuda.memory_allocated(case.device)
    torch.cuda.reset_peak_memory_stats(case.device)
    fn(case.q, case.k, case.v).backward(case.dout)
    sync(case.device)
    peak = torch.cuda.max_memory_allocated(case.device) - base
    case.clear_grads()
    return peak / 2**20


def time_round(case: Case, impl: Impl, timing: Timing, row: dict[str, Any]) -> None:
    """One timing round: append this round's fwd and fwd+bwd medians to the row's ``*_rounds`` lists. A stage that
    fails is recorded and not timed again."""
    q, k, v, dout = case.q, case.k, case.v, case.dout

    def fwd() -> torch.Tensor:
        return impl.fn(q, k, v)

    def fwd_bwd() -> None:
        impl.fn(q, k, v).backward(dout)

    for key, fn, grad_to_none in (("fwd_ms", fwd, None), ("fwdbwd_ms", fwd_bwd, [q, k, v])):
        rounds = row.setdefault(f"{key}_rounds", [])
        if rounds is None:  # failed in an earlier round
            continue
        try:
            rounds.append(timing.kernel_ms(fn, grad_to_none))
        except Exception as e:
            row[f"{key}_rounds"] = None
            add_error(row, key.removesuffix("_ms"), e, case.device)
            free_memory(case.device)
        finally:
            case.clear_grads()


def finish_row(case: Case, impl: Impl, row: dict[str, Any]) -> None:
    """Times from the rounds (the best of each stage: every implementation gets the same rounds, interleaved, so a
    slow spell of the machine does not land on one of them), peak memory and, on a GPU, TFLOP/s."""
    for key in ("fwd_ms", "fwdbwd_ms"):
        rounds = row.get(f"{key}_rounds")
        row[key] = min(rounds) if rounds else None
    if row.get("fwd_ms") is not None and row.get("fwdbwd_ms") is not None:
        row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    try:
        row["peak_mib"] = peak_mib(case, impl)
    except Exception as e:
        add_error(row, "peak", e, case.device)
    cfg = case.cfg
    if case.device.type != "cuda":
        return  # no TFLOP/s: a CPU run goes through Triton's interpreter, whose rate says nothing of the kernels
    fwd_flops = 4.0 * cfg.batch * cfg.heads_q * cfg.head_dim * cfg.live_pairs
    for key, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
        ms = row.get(f"{key}_ms")
        if ms is not None and ms > 0:
            row[f"{key}_tflops"] = flops / ms / 1e9
            if impl.reference == "dense":  # the pairs dense_flash really computes
                row[f"{key}_tflops_computed"] = row[f"{key}_tflops"] / cfg.density * _dense_density(cfg)


def _dense_density(cfg: BenchConfig) -> float:
    return live_pairs([[1]], (cfg.seq_k,), cfg.q_len, cfg.dense_causal) / (cfg.q_len * cfg.seq_k)


class Runner:
    """Runs configs in this process, appending finished rows to ``rows`` and saving after each one."""

    def __init__(self, device: torch.device, timing: Timing, env: dict[str, str], total: int,
                 save: Callable[[Rows], None], grad_check: bool = True) -> None:
        self.device, self.timing, self.env, self.grad_check = device, timing, env, grad_check
        self.rows: Rows = []
        self.emitted: set[int] = set()
        self.total, self.save = total, save

    def emit(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.emitted.add(id(row))
        log(progress_line(len(self.rows), self.total, row))
        self.save(self.rows)

    def run_config(self, cfg: BenchConfig, impls: Sequence[str]) -> None:
        rows = {name: base_row(cfg, name, self.env, self.timing) for name in impls}
        log(f"== {cfg.name}: {cfg.describe()}")
        case: Case | None = None
        try:
            case = Case.make(cfg, self.device, torch.bfloat16)
            setups = self.setup_and_check(case, rows)
            for _ in range(self.timing.rounds):
                for name, impl in setups.items():
                    time_round(case, impl, self.timing, rows[name])
            for name, row in rows.items():
                impl = setups.pop(name, None)
                if impl is not None:
                    finish_row(case, impl, row)
                    del impl
                    free_memory(self.device)
                self.emit(row)
        except DeviceLost:
            for row in rows.values():
                if id(row) not in self.emitted:
                    row["error"] = row["error"] or "not run: CUDA context lost"
                    self.emit(row)
            raise
        except Exception as e:  # inputs or reference failed (e.g. out of memory): every row of the config says so
            log(traceback.format_exc() if os.environ.get("BENCH_VERBOSE") else f"    config failed: {short_error(e)}")
            for row in rows.values():
                if id(row) not in self.emitted:
                    row["error"] = row["error"] or f"config: {short_error(e)}"
                    self.emit(row)
            if not device_alive(self.device):
                raise DeviceLost(short_error(e)) from e
        finally:
            del case
            free_memory(self.device)
            torch._dynamo.reset()

    def setup_and_check(self, case: Case, rows: dict[str, dict[str, Any]]) -> dict[str, Impl]:
        """Set up every implementation and check it against the reference before anything is timed."""
        cfg = case.cfg
        counted = int(torch.count_nonzero(case.mask("topology")))
        if counted != cfg.live_pairs:  # the TFLOP/s basis must be right
            raise RuntimeError(f"live pair count {cfg.live_pairs} != reference mask count {counted}")
        setups: dict[str, Impl] = {}
        for name, row in rows.items():
            t0 = time.perf_counter()
            try:
                impl = SETUPS[name](case, self.timing)
            except Skip as s:
                row["skipped"] = str(s)
                row["error"] = f"skipped: {s}"
                continue
            except DeviceLost:
                raise
            except Exception as e:
                add_error(row, "setup", e, self.device)
                log(f"    setup {name:<11} ERROR {row['error']}")
                continue
            row.update(build_ms=impl.build_ms, state_mib=impl.state_mib, reference=impl.reference, **impl.info)
            try:
                row.update(check(case, impl, grads=self.grad_check))
            except DeviceLost:
                raise
            except Exception as e:
                add_error(row, "check", e, self.device)
                log(f"    check {name:<11} ERROR {row['error']}")
                continue
            log(check_line(row, time.perf_counter() - t0))
            if not row["correct"]:
                loud_fail(row)
            setups[name] = impl
            free_memory(self.device)
        return setups


def run_isolated(args: argparse.Namespace, configs: list[BenchConfig], impls: list[str], env: dict[str, str],
                 timing: Timing, save: Callable[[Rows], None]) -> Rows:
    """One subprocess per (config, impl): a crash (illegal address, segfault) costs only its own row."""
    rows: Rows = []
    for cfg in configs:
        for impl in impls:
            with tempfile.TemporaryDirectory(prefix="mmsparse-bench-") as tmp:
                cmd = [sys.executable, "-m", "benchmarks.run", "--child", "--no-plot", "--configs", cfg.name,
                       "--impls", impl, "--out", tmp, "--device", args.device, "--warmup", str(timing.warmup),
                       "--rep", str(timing.rep), "--cpu-warmup", str(timing.cpu_warmup),
                       "--cpu-reps", str(timing.cpu_reps), "--rounds", str(timing.rounds)]
                if not args.grad_check:
                    cmd.append("--no-grad-check")
                proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO_DIR)
                result = Path(tmp) / "latest.json"
                child_rows = json.loads(result.read_text()) if result.exists() else []
                if proc.returncode != 0 or not child_rows:
                    tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-400:]
                    sys.stderr.write(proc.stderr[-4000:])
                    if not child_rows:
                        row = base_row(cfg, impl, env, timing)
                        row["error"] = f"subprocess exited with {proc.returncode}: {tail}"
                        child_rows = [row]
                rows.extend(child_rows)
                save(rows)
    return rows
