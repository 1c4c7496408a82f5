"""Nsight Compute side by side: what limits each kernel of one forward + backward.

For each config and implementation, a child process warms the call up, then runs one forward and backward between
``cudaProfilerStart``/``Stop`` under ``ncu``. Every kernel launched there is profiled once (ncu replays it and locks
the clocks, so durations are ncu's, not the benchmark's). The table gives per kernel: duration, SM throughput,
tensor-pipe utilisation, the L2 cache's and device memory's throughput, issue slots busy, warp cycles per issued
instruction, and the largest stall reasons in cycles per issued instruction (a kernel whose L2 or memory column is
near 100 waits on bytes, not on its matmuls). Writes ``--out DIR/ncu.{json,md}`` and the ``.ncu-rep`` reports.

    python -m tools.profile_ncu --configs mm13k_hub --impls mmsparse,flex_flash --out DIR
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.configs import ALL_CONFIGS

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats")
METRICS = (
    "regex:sm__pipe_tensor_op_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active",
    "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio",
    "smsp__average_warp_latency_per_inst_issued.ratio",
    "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
)
_DURATION = "gpu__time_duration.sum"
_SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
_ISSUED = "sm__inst_issued.avg.pct_of_peak_sustained_active"
_CPI = "smsp__average_warp_latency_per_inst_issued.ratio"
_L2 = "lts__throughput.avg.pct_of_peak_sustained_elapsed"
_DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
_STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
TOP_STALLS = 4


def ncu_binary() -> str | None:
    """ncu on PATH, or where CUDA installs it; None (and a message on stderr) where there is none."""
    found = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if found is None:
        print("ncu not found: install Nsight Compute or put it on PATH", file=sys.stderr)
    return found


def child(config: str, impl: str) -> None:
    """Warm up, then one profiled forward + backward."""
    import torch

    from benchmarks.baselines import SETUPS
    from benchmarks.cases import Case
    from benchmarks.timing import Timing

    dev = torch.device("cuda")
    case = Case.make(ALL_CONFIGS[config], dev, torch.bfloat16)
    fn = SETUPS[impl](case, Timing(dev, 1, 1)).fn
    for _ in range(3):
        case.clear_grads()
        fn(case.q, case.k, case.v).backward(case.dout)
    case.clear_grads()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(case.q, case.k, case.v).backward(case.dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(ncu: str, config: str, impl: str, report: Path, timeout: float) -> list[dict]:
    """Run the child under ncu into ``report`` (.ncu-rep) and return its kernels' rows."""
    cmd = [ncu, "--profile-from-start", "off", "--target-processes", "all", "--force-overwrite",
           "--export", str(report), *[a for s in SECTIONS for a in ("--section", s)],
           "--metrics", ",".join(METRICS),
           sys.executable, "-m", "tools.profile_ncu", "--child", config, impl]
    subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    raw = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "raw"], check=True,
                         capture_output=True, text=True).stdout
    return [dict(row, config=config, impl=impl) for row in kernel_rows(raw)]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def kernel_rows(raw_csv: str) -> list[dict]:
    """One row per profiled kernel from ``ncu --csv --page raw`` (a header row, a units row, then kernels)."""
    lines = [line for line in raw_csv.splitlines() if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(table) < 3:
        return []
    header, units = table[0], table[1]
    rows = []
    for values in table[2:]:
        cell = dict(zip(header, values))
        unit = dict(zip(header, units))
        ms = _number(cell.get(_DURATION, ""))
        scale = {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "nsecond": 1e-6}
        ms = None if ms is None else ms * scale.get(unit.get(_DURATION, "ns"), 1e-6)
        tensor = {k: _number(v) for k, v in cell.items() if k.startswith("sm__pipe_tensor_op_") and _number(v)}
        stalls = {k[len(_STALL[0]):-len(_STALL[1])]: _number(v) for k, v in cell.items()
                  if k.startswith(_STALL[0]) and k.endswith(_STALL[1]) and _number(v)}
        rows.append({
            "kernel": cell.get("Kernel Name", "?"),
            "ms": ms,
            "sm_throughput_pct": _number(cell.get(_SM, "")),
            "tensor_pipe_pct": max(tensor.values()) if tensor else None,
            "tensor_pipe_metric": max(tensor, key=tensor.get) if tensor else None,
            "l2_pct": _number(cell.get(_L2, "")),
            "dram_pct": _number(cell.get(_DRAM, "")),
            "issue_active_pct": _number(cell.get(_ISSUED, "")),
            "cycles_per_issue": _number(cell.get(_CPI, "")),
            "stalls": dict(sorted(stalls.items(), key=lambda kv: -(kv[1] or 0))),
        })
    return rows


def _short(name: str) -> str:
    name = name.split("(")[0].strip()
    return name if len(name) <= 48 else name[:45] + "..."


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| config | impl | kernel | ms | SM % | tensor pipe % | L2 % | DRAM % | issue active % | cycles / issue "
             "| top stalls (cycles / issue) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in list(r["stalls"].items())[:TOP_STALLS])
        lines.append(f"| {r['config']} | {r['impl']} | `{_short(r['kernel'])}` | {_f(r['ms'], 3)} | "
                     f"{_f(r['sm_throughput_pct'])} | {_f(r['tensor_pipe_pct'])} | {_f(r.get('l2_pct'))} | "
                     f"{_f(r.get('dram_pct'))} | {_f(r['issue_active_pct'])} | "
                     f"{_f(r['cycles_per_issue'])} | {stalls} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_ncu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "IMPL"), help=argparse.SUPPRESS)
    parser.add_argument("--configs", default="mm13k_hub", help="comma-separated config names")
    parser.add_argument("--impls", default="mmsparse,flex_flash", help="comma-separated implementations")
    parser.add_argument("--out", type=Path, default=Path("ncu"))
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per profiled process")
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    ncu = ncu_binary()
    if ncu is None:
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for config in args.configs.split(","):
        for impl in args.impls.split(","):
            try:
                rows += profile(ncu, config, impl, args.out / f"{config}-{impl}", args.timeout)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                print(f"{config} {impl}: {exc}", file=sys.stderr, flush=True)
            print(f"profiled {config} {impl}", flush=True)
    import torch

    from benchmarks.env import environment

    env = environment(torch.device("cuda"))
    (args.out / "ncu.json").write_text(json.dumps({"environment": env, "kernels": rows}, indent=1) + "\n")
    head = f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}\n\n"
    (args.out / "ncu.md").write_text(head + markdown(rows))
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
