"""Several processes running mmsparse on one GPU at once: does any of them fail or stall?

    python -m tests.stress.shared_gpu --procs 6 --seconds 60                  # the Gluon kernels (default on sm_90)
    python -m tests.stress.shared_gpu --procs 6 --seconds 60 --gluon off      # the tl kernels only
    python -m tests.stress.shared_gpu --procs 6 --seconds 60 --mode mixed     # training and inference side by side

Each child process loops over ``--configs`` with a fresh mask every call (device lengths, so the block lists are
built each time, as in a training step with new lengths), synchronises, and writes its call count to a progress
file. With ``--mode train`` (the default) every child runs forward + backward; with ``--mode infer`` the forward
alone under ``torch.inference_mode()``; ``--mode mixed`` alternates the two, training in the even children and
inference in the odd ones. The parent watches them: a child that exits with an error has *failed*, one whose
count has not moved for ``--stall`` seconds while it lives has *stalled*. On a stall it asks ``cuda-gdb`` (when
there is one) which kernel the child is in, then stops every child. It prints one line per child and exits 0 only
when every child ran to the end.

The run is recorded in ``--out`` (default ``benchmarks/results/<gpu>/``; a new temporary folder on the CPU) as
``shared_gpu.json`` and ``shared_gpu.md``: processes, seconds, calls per process, failures and stalls, the mode,
whether the Gluon kernels ran, GPU, torch, triton and commit. A record holds one entry per setting (processes,
seconds, ``--gluon``, mode, configs): a new run replaces the entry of the same setting and keeps the others, so
the Gluon run, its ``--gluon off`` control and a mixed run sit side by side.

Without CUDA the children run through Triton's interpreter (``--device cpu``, the tiny ``tiny_ab`` config): a
check that the tool works, not a measurement. Before the others start, one child per role (training, inference)
runs one call alone, so that compiling is not what is watched; it also reports the GPU, the versions and whether
the Gluon kernels run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.arguments import at_least_one
from benchmarks.env import REPO_DIR

DEFAULT_CONFIGS = "mm13k_cyclic,mm13k_hub,mm13k_hub_causal"
ERROR_LINES = 5  # lines of a failed child's stderr kept in its report
MODES = ("train", "infer", "mixed")
TOPIC = "shared_gpu"
ENV_PREFIX = "shared-gpu-env: "  # a child's first line: its GPU, versions and kernels, as JSON


@dataclass
class ChildReport:
    index: int
    status: str  # "ok", "failed", "stalled"
    calls: int
    detail: str  # the end of a failed child's stderr, or what cuda-gdb said of a stalled one
    role: str = "train"  # "train" (forward + backward) or "infer" (forward under inference mode)


def role_of(mode: str, index: int) -> str:
    """What child ``index`` runs in ``mode``: mixed alternates training (even) and inference (odd)."""
    if mode == "mixed":
        return "train" if index % 2 == 0 else "infer"
    return mode


def child_environment(device: Any) -> dict[str, Any]:
    """GPU, torch and triton of this child, and whether the Gluon kernels run on its device."""
    from benchmarks.env import versions

    gluon = False
    if device.type == "cuda":
        from mmsparse.attention.config import cuda_index
        from mmsparse.attention.dispatch import hopper_gluon_available

        gluon = hopper_gluon_available(cuda_index(device))
    return {**versions(device), "gluon_kernels": gluon}


def child(configs: list[str], seconds: float, progress: Path, device_name: str, role: str = "train") -> int:
    """Loop over ``configs`` for ``seconds``, writing the call count to ``progress``: forward + backward
    (``role`` "train") or the forward alone under ``torch.inference_mode()`` ("infer")."""
    import torch

    import mmsparse
    from benchmarks.baselines import call_topology
    from benchmarks.configs import ALL_CONFIGS
    from benchmarks.inputs import make_inputs

    device = torch.device(device_name)
    print(ENV_PREFIX + json.dumps(child_environment(device)), flush=True)
    cases = [(ALL_CONFIGS[name], *make_inputs(ALL_CONFIGS[name], device)) for name in configs]

    def attention(cfg: Any, q: Any, k: Any, v: Any) -> Any:
        lens = torch.tensor(cfg.seg_lens if cfg.packed else [cfg.seg_lens], device=device)
        topology = call_topology(cfg)
        if cfg.packed:
            return mmsparse.mbs_attention_varlen(q, k, v, topology, lens, causal=cfg.causal, window=cfg.window)
        return mmsparse.mbs_attention(q, k, v, topology, lens, causal=cfg.causal, window=cfg.window)

    end, calls = time.monotonic() + seconds, 0
    while True:
        for cfg, q, k, v, dout in cases:
            if role == "infer":
                with torch.inference_mode():
                    attention(cfg, q, k, v)
            else:
                q.grad = k.grad = v.grad = None
                attention(cfg, q, k, v).backward(dout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            calls += 1
            progress.write_text(f"{calls}\n")
        if time.monotonic() >= end:
            return 0


def _calls(progress: Path) -> int:
    try:
        return int(progress.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _kernel_of(pid: int) -> str:
    """What cuda-gdb says the stalled process ``pid`` is running: the kernel and the focused warp's source line."""
    gdb = shutil.which("cuda-gdb") or "/usr/local/cuda/bin/cuda-gdb"
    if not Path(gdb).exists():
        return "no cuda-gdb here to ask which kernel"
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "info cuda kernels"], capture_output=True,
                             text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return "cuda-gdb did not answer within 60 s"
    keep = [line.strip() for line in out.splitlines() if "<<<" in line or " Active " in line]
    return " | ".join(keep[:3]) or "cuda-gdb saw no CUDA kernel"


def watch(procs: list[subprocess.Popen], progress: list[Path], logs: list[Path], seconds: float,
          stall: float) -> list[ChildReport]:
    """Wait for the children, ending early on a stall; report each one."""
    last = [(0, time.monotonic()) for _ in procs]
    stalled: set[int] = set()
    deadline = time.monotonic() + seconds + stall + 60
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(1.0)
        now = time.monotonic()
        for i, (proc, path) in enumerate(zip(procs, progress)):
            calls = _calls(path)
            if calls != last[i][0]:
                last[i] = (calls, now)
            elif proc.poll() is None and now - last[i][1] > stall:
                stalled.add(i)
        if stalled:
            break
    reports = []
    for i, proc in enumerate(procs):
        calls = _calls(progress[i])
        if i in stalled or proc.poll() is None:
            detail = _kernel_of(proc.pid) if i in stalled else "still running at the deadline"
            reports.append(ChildReport(i, "stalled", calls, detail))
        elif proc.returncode != 0:
            tail = logs[i].read_text(errors="replace").strip().splitlines()[-ERROR_LINES:]
            reports.append(ChildReport(i, "failed", calls, " / ".join(tail)))
        else:
            reports.append(ChildReport(i, "ok", calls, ""))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return reports


def run(args: argparse.Namespace) -> tuple[list[ChildReport], dict[str, Any]]:
    """Warm up one child per role, then start ``args.procs`` children at once and watch them: the children's
    reports and the environment the warm-up children reported (empty if one failed)."""
    env = dict(os.environ)
    if args.gluon == "off":
        env["MMSPARSE_GLUON"] = "0"
    if args.device == "cpu":  # CPU tensors run through the interpreter, also on a machine that has a GPU
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), env.get("PYTHONPATH")]))
    base = [sys.executable, "-m", "tests.stress.shared_gpu", "--child", "--configs", args.configs, "--device",
            args.device]
    roles = [role_of(args.mode, i) for i in range(args.procs)]
    child_env: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mmsparse-shared-gpu-") as scratch:
        tmp = Path(scratch)
        for role in dict.fromkeys(roles):
            warm = subprocess.run([*base, "--role", role, "--seconds", "0", "--progress", str(tmp / "warm")],
                                  env=env, capture_output=True, text=True)
            if warm.returncode != 0:
                tail = " / ".join(warm.stderr.strip().splitlines()[-ERROR_LINES:])
                return [ChildReport(-1, "failed", 0, f"the warm-up call alone ({role}) failed: {tail}", role)], {}
            child_env = next((json.loads(line[len(ENV_PREFIX):]) for line in warm.stdout.splitlines()
                              if line.startswith(ENV_PREFIX)), child_env)
        progress = [tmp / f"progress{i}" for i in range(args.procs)]
        logs = [tmp / f"child{i}.log" for i in range(args.procs)]
        procs = []
        for i in range(args.procs):
            with open(logs[i], "w") as log:
                procs.append(subprocess.Popen([*base, "--role", roles[i], "--seconds", str(args.seconds),
                                               "--progress", str(progress[i])],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        reports = watch(procs, progress, logs, args.seconds, args.stall)
    for report in reports:
        report.role = roles[report.index]
    return reports, child_env


# ---------------------------------------------------------------------------------------------------------------
# The record: shared_gpu.json and shared_gpu.md, one entry per setting


def run_key(run: dict[str, Any]) -> str:
    """The settings that name a run: a later run of the same settings replaces it in the record."""
    return (f"procs={run['procs']} seconds={run['seconds']:g} gluon={run['gluon']} mode={run['mode']} "
            f"configs={run['configs']}")


def run_entry(args: argparse.Namespace, reports: list[ChildReport], child_env: dict[str, Any],
              commit: str) -> dict[str, Any]:
    """One run's entry in the record."""
    children = [r for r in reports if r.index >= 0]
    run = {
        "procs": args.procs, "seconds": args.seconds, "gluon": args.gluon, "mode": args.mode,
        "configs": args.configs, "device": args.device, "stall_s": args.stall,
        "gluon_kernels": child_env.get("gluon_kernels"),
        "roles": {role: sum(r.role == role for r in children) for role in dict.fromkeys(r.role for r in children)},
        "calls_per_process": [r.calls for r in children],
        "failures": sum(r.status == "failed" for r in reports),
        "stalls": sum(r.status == "stalled" for r in reports),
        "ok": bool(children) and all(r.status == "ok" for r in reports),
        "children": [asdict(r) for r in reports],
        "gpu": child_env.get("gpu"), "torch": child_env.get("torch"), "triton": child_env.get("triton"),
        "commit": commit, "date": datetime.date.today().isoformat(),
    }
    run["key"] = run_key(run)
    return run


def merge_record(old: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, Any]:
    """The record with ``run`` in place of the entry of the same settings (or added after the others)."""
    runs = [r for r in (old or {}).get("runs", []) if r.get("key") != run["key"]]
    index = next((i for i, r in enumerate((old or {}).get("runs", [])) if r.get("key") == run["key"]), len(runs))
    runs.insert(index, run)
    return {"topic": TOPIC, "runs": runs}


def _kernels(run: dict[str, Any]) -> str:
    if run["gluon_kernels"] is None:
        return "-"
    return "Gluon" if run["gluon_kernels"] else "tl"


def markdown(record: dict[str, Any]) -> str:
    """A table of the record's runs, then what failed or stalled."""
    lines = [
        "Several processes running mmsparse on one GPU at once (`python -m tests.stress.shared_gpu`): each loops "
        "over its configs with new masks every call; *failed* = exited with an error, *stalled* = no progress for "
        "the stall time. Mode train: forward + backward in every process; infer: the forward alone under "
        "inference mode; mixed: training and inference processes alternating.",
        "",
        "| mode | --gluon | kernels | processes | s | calls per process | failed | stalled | result | GPU | torch "
        "| triton | commit | date |",
        "|---|---|---|---:|---:|---|---:|---:|---|---|---|---|---|---|",
    ]
    notes = []
    for run in record["runs"]:
        roles = ", ".join(f"{n} {role}" for role, n in run["roles"].items())
        calls = ", ".join(str(c) for c in run["calls_per_process"]) or "-"
        result = "all ran to the end" if run["ok"] else "**failed or stalled**"
        lines.append(f"| {run['mode']} ({roles}) | {run['gluon']} | {_kernels(run)} | {run['procs']} | "
                     f"{run['seconds']:g} | {calls} | {run['failures']} | {run['stalls']} | {result} | {run['gpu']} | "
                     f"{run['torch']} | {run['triton']} | {run['commit']} | {run['date']} |")
        for child in run["children"]:
            if child["status"] != "ok":
                who = "warm-up" if child["index"] < 0 else f"process {child['index']} ({child['role']})"
                notes.append(f"- {run['key']}: {who} {child['status']} after {child['calls']} calls: "
                             f"{child['detail']}")
    lines.append("")
    lines += ["Configs: " + ", ".join(dict.fromkeys(r["configs"] for r in record["runs"])) + "."]
    if notes:
        lines += ["", "Failures and stalls:", "", *notes]
    return "\n".join(lines) + "\n"


def write_record(out: Path, run: dict[str, Any]) -> Path:
    """Merge ``run`` into ``out/shared_gpu.json`` and rewrite ``out/shared_gpu.md``; returns the JSON's path."""
    from benchmarks.report import write_record as write

    path = out / f"{TOPIC}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    record = merge_record(old, run)
    return write(out, TOPIC, record, markdown(record))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.stress.shared_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=at_least_one, default=6, help="processes at once (default 6)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long each child loops (default 60)")
    p.add_argument("--stall", type=float, default=25.0, help="seconds without progress that count as a stall")
    p.add_argument("--configs", default=None, help=f"comma-separated configs (default {DEFAULT_CONFIGS}; CPU: "
                                                   "tiny_ab)")
    p.add_argument("--gluon", choices=("on", "off"), default="on", help="off: MMSPARSE_GLUON=0 in the children")
    p.add_argument("--mode", choices=MODES, default="train",
                   help="train: forward + backward in every child (default); infer: the forward alone under "
                        "inference mode; mixed: training and inference children alternating")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--out", type=Path, default=None, help="folder of shared_gpu.json and shared_gpu.md (default "
                                                          "benchmarks/results/<gpu>/; a new temporary folder on "
                                                          "the CPU)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", choices=("train", "infer"), default="train", help=argparse.SUPPRESS)
    p.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.configs is None:
        args.configs = DEFAULT_CONFIGS if args.device.startswith("cuda") else "tiny_ab"
    if args.child:
        return child(args.configs.split(","), args.seconds, args.progress, args.device, args.role)
    reports, child_env = run(args)
    for r in reports:
        who = "warm-up" if r.index < 0 else f"process {r.index} ({r.role})"
        print(f"{who}: {r.status}, {r.calls} calls{'; ' + r.detail if r.detail else ''}")
    bad = sum(r.status != "ok" for r in reports)
    print(f"{args.procs} processes, mode {args.mode}, Gluon {args.gluon} (kernels: "
          f"{_kernels({'gluon_kernels': child_env.get('gluon_kernels')})}), {args.seconds:g} s each: "
          f"{'all ran to the end' if not bad else f'{bad} failed or stalled'}")
    from benchmarks.env import git_commit, results_dir, versions

    if not child_env:  # the warm-up failed before reporting: this process says what it runs on
        import torch

        child_env = {**versions(torch.device(args.device)), "gluon_kernels": None}
    out = args.out
    if out is None:
        gpu = child_env.get("gpu")
        cuda = args.device.startswith("cuda") and gpu
        out = results_dir(gpu) if cuda else Path(tempfile.mkdtemp(prefix="mmsparse-shared-gpu-"))
    path = write_record(out, run_entry(args, reports, child_env, git_commit()))
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
