"""Several processes running mmsparse on one GPU at once: does any of them fail or stall?

    python -m benchmarks.shared_gpu --procs 6 --seconds 60                  # the Gluon kernels (default on sm_90)
    python -m benchmarks.shared_gpu --procs 6 --seconds 60 --gluon off      # the tl kernels only

Each child process loops forward + backward over ``--configs`` with a fresh mask every call (device lengths, so
the block lists are built each time, as in a training step with new lengths), synchronises, and writes its call
count to a progress file. The parent watches them: a child that exits with an error has *failed*, one whose count
has not moved for ``--stall`` seconds while it lives has *stalled*. On a stall it asks ``cuda-gdb`` (when there is
one) which kernel the child is in, then stops every child. It prints one line per child and exits 0 only when
every child ran to the end.

Without CUDA the children run through Triton's interpreter (``--device cpu``, the tiny ``tiny_ab`` config): a
check that the tool works, not a measurement. Each child first runs one call alone before the others start, so
that compiling is not what is watched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .arguments import at_least_one

DEFAULT_CONFIGS = "mm13k_cyclic,mm13k_hub,mm13k_hub_causal"
ERROR_LINES = 5  # lines of a failed child's stderr kept in its report


@dataclass
class ChildReport:
    index: int
    status: str  # "ok", "failed", "stalled"
    calls: int
    detail: str  # the end of a failed child's stderr, or what cuda-gdb said of a stalled one


def child(configs: list[str], seconds: float, progress: Path, device_name: str) -> int:
    """Loop forward + backward over ``configs`` for ``seconds``, writing the call count to ``progress``."""
    import torch

    import mmsparse
    from benchmarks.baselines import call_topology
    from benchmarks.configs import ALL_CONFIGS
    from benchmarks.inputs import make_inputs

    device = torch.device(device_name)
    cases = [(ALL_CONFIGS[name], *make_inputs(ALL_CONFIGS[name], device)) for name in configs]
    end, calls = time.monotonic() + seconds, 0
    while True:
        for cfg, q, k, v, dout in cases:
            q.grad = k.grad = v.grad = None
            lens = torch.tensor(cfg.seg_lens if cfg.packed else [cfg.seg_lens], device=device)
            topology = call_topology(cfg)
            if cfg.packed:
                out = mmsparse.mbs_attention_varlen(q, k, v, topology, lens, causal=cfg.causal)
            else:
                out = mmsparse.mbs_attention(q, k, v, topology, lens, causal=cfg.causal)
            out.backward(dout)
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


def run(args: argparse.Namespace) -> list[ChildReport]:
    env = dict(os.environ)
    if args.gluon == "off":
        env["MMSPARSE_GLUON"] = "0"
    repo = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    base = [sys.executable, "-m", "benchmarks.shared_gpu", "--child", "--configs", args.configs, "--device",
            args.device]
    with tempfile.TemporaryDirectory(prefix="mmsparse-shared-gpu-") as scratch:
        tmp = Path(scratch)
        warm = subprocess.run([*base, "--seconds", "0", "--progress", str(tmp / "warm")], env=env,
                              capture_output=True, text=True)
        if warm.returncode != 0:
            tail = " / ".join(warm.stderr.strip().splitlines()[-ERROR_LINES:])
            return [ChildReport(-1, "failed", 0, f"the warm-up call alone failed: {tail}")]
        progress = [tmp / f"progress{i}" for i in range(args.procs)]
        logs = [tmp / f"child{i}.log" for i in range(args.procs)]
        procs = []
        for i in range(args.procs):
            with open(logs[i], "w") as log:
                procs.append(subprocess.Popen([*base, "--seconds", str(args.seconds), "--progress", str(progress[i])],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        return watch(procs, progress, logs, args.seconds, args.stall)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shared_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=at_least_one, default=6, help="processes at once (default 6)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long each child loops (default 60)")
    p.add_argument("--stall", type=float, default=25.0, help="seconds without progress that count as a stall")
    p.add_argument("--configs", default=None, help=f"comma-separated configs (default {DEFAULT_CONFIGS}; CPU: "
                                                   "tiny_ab)")
    p.add_argument("--gluon", choices=("on", "off"), default="on", help="off: MMSPARSE_GLUON=0 in the children")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
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
        return child(args.configs.split(","), args.seconds, args.progress, args.device)
    reports = run(args)
    for r in reports:
        who = "warm-up" if r.index < 0 else f"process {r.index}"
        print(f"{who}: {r.status}, {r.calls} calls{'; ' + r.detail if r.detail else ''}")
    bad = sum(r.status != "ok" for r in reports)
    print(f"{args.procs} processes, Gluon {args.gluon}, {args.seconds:g} s each: "
          f"{'all ran to the end' if not bad else f'{bad} failed or stalled'}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
