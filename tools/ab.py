"""Time the working tree against a git ref, interleaved, and compare their outputs bit for bit.

    python -m tools.ab --base REF                       # every benchmark config, 5 rounds
    python -m tools.ab --base REF --configs seed,mm13k_hub --rounds 9 --out ab.json
    python -m tools.ab --base REF --configs mm13k_hub --nondet    # deterministic=False's backward
    python -m tools.ab --base REF --configs mm13k_hub_causal --head-dim 64   # the configs at another head dim
    python -m tools.ab --base DIR                       # a tree exported before (no .git needed here)
    python -m tools.ab --export REF DIR                 # write that tree: REF's files and DIR/.commit

Each side runs in worker processes of its own (both register the same torch custom ops), importing mmsparse from
its tree and the timing harness from this checkout. Round r times every config on both sides back to back, the
side that goes first alternating, so that the machine's slow spells land on both. Host-bound rows (the seed,
decoding) also vary between processes of one tree: on an H100 host the seed backward's host time ran 345-591 us
in four processes of the same tree. So each side has ``--workers`` processes (3 on a GPU) and round r uses the
r-th of them in turn: the median spans processes instead of following one process's luck. Per config and pass (forward;
backward = forward+backward minus forward) the ratio is base / new, the median over rounds of the paired ratios
(> 1: the new tree is faster). Before timing, each side runs the config once on the same seeded inputs; out, dq,
dk and dv must be bit-equal (in every worker).

The bar for a change that must not cost speed: geometric mean of the ratios >= 0.98, none below 0.95, and the
seed forward at most 5 us slower. The exit status is 0 when the bar is met and every output is bit-equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.arguments import at_least_one
from benchmarks.configs import ALL_CONFIGS, CONFIGS, DECODE_CONFIGS, expand_names
from benchmarks.env import REPO_DIR, git_commit

from .ab_stats import config_row, markdown, verdict

WORKER = Path(__file__).resolve().parent / "ab_worker.py"
COMMIT_FILE = ".commit"  # written by --export: the commit a tree was exported from


@dataclass
class Tree:
    label: str  # "REF (sha)", "working tree (sha+dirty)" or a folder
    path: Path


def _git(*args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_DIR, check=True, **kwargs)


def export(ref: str, dest: Path) -> str:
    """Write the files of ``ref`` into ``dest`` (``git archive``: the repository is only read) and the commit into
    ``dest/.commit``. Returns the full commit hash."""
    sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}", capture_output=True, text=True).stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(["git", "archive", "--format=tar", sha], cwd=REPO_DIR, stdout=subprocess.PIPE) as proc:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
            tar.extractall(dest, **safe)
    if proc.returncode:
        raise RuntimeError(f"git archive {ref} failed with status {proc.returncode}")
    (dest / COMMIT_FILE).write_text(sha + "\n")
    return sha


def resolve_tree(spec: str | None, scratch: Path) -> Tree:
    """``None``: this working tree. A folder with ``mmsparse/`` in it: that tree as it is. Anything else: a git ref,
    exported into ``scratch``."""
    if spec is None:
        return Tree(f"working tree ({git_commit()})", REPO_DIR)
    folder = Path(spec)
    if (folder / "mmsparse").is_dir():
        commit = folder / COMMIT_FILE
        label = f"{spec} ({commit.read_text().strip()[:12]})" if commit.exists() else spec
        return Tree(label, folder.resolve())
    try:
        sha = export(spec, scratch)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"{spec!r} is neither a folder with mmsparse/ nor a git ref here ({e}). Without .git, "
                         f"export it where git works: python -m tools.ab --export {spec} DIR") from e
    return Tree(f"{spec} ({sha[:12]})", scratch)


def child_env(device: str) -> dict[str, str] | None:
    """The environment of a child process that runs mmsparse on ``device``: on the CPU with Triton's interpreter,
    also on a host with a GPU (where mmsparse leaves it off); else the parent's (None)."""
    return {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else None


class Worker:
    """A worker process for one tree, spoken to in JSON lines."""

    def __init__(self, tree: Tree, args: argparse.Namespace) -> None:
        cmd = [sys.executable, str(WORKER), "--tree", str(tree.path), "--device", args.device, "--warmup",
               str(args.warmup), "--rep", str(args.rep), "--cpu-reps", str(args.cpu_reps)]
        cmd += ["--nondet"] if args.nondet else []
        cmd += ["--head-dim", str(args.head_dim)] if args.head_dim else []
        self.tree = tree
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=tempfile.gettempdir(), env=child_env(args.device))
        self.info: dict[str, str] = {"label": tree.label}

    def wait_ready(self) -> None:
        hello = self.read()
        if not hello.get("ok"):
            raise SystemExit(f"worker for {self.tree.label} did not start: {hello.get('error')}")
        self.info.update(hello["ready"])

    def read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            return {"ok": False, "error": f"worker exited with status {self.proc.wait()}"}
        return json.loads(line)

    def send(self, op: str, config: str) -> bool:
        if self.proc.poll() is not None:
            return False
        self.proc.stdin.write(json.dumps({"op": op, "config": config}) + "\n")
        self.proc.stdin.flush()
        return True

    def ask(self, op: str, config: str) -> dict[str, Any]:
        if not self.send(op, config):
            return {"ok": False, "error": f"worker exited with status {self.proc.returncode}"}
        return self.read()

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def workers(trees: dict[str, Tree], args: argparse.Namespace) -> Iterator[dict[str, list[Worker]]]:
    """``args.workers`` worker processes per side."""
    with ExitStack() as stack:
        started: dict[str, list[Worker]] = {side: [] for side in trees}
        for _ in range(args.workers):  # all start at once: their imports overlap
            for side, tree in trees.items():
                started[side].append(Worker(tree, args))
                stack.callback(started[side][-1].close)
        for side_workers in started.values():
            for worker in side_workers:
                worker.wait_ready()
        yield started


def measure(sides: dict[str, list[Worker]], names: list[str], rounds: int) -> list[dict[str, Any]]:
    """Prepare every config in every worker (digests), then ``rounds`` interleaved timing rounds, round r on the
    (r mod workers)-th worker of each side."""
    times = {n: {s: {"fwd_ms": [], "fwdbwd_ms": []} for s in sides} for n in names}
    digests: dict[str, dict[str, Any]] = {n: dict.fromkeys(sides) for n in names}
    errors: dict[str, list[str]] = {n: [] for n in names}
    failed: set[str] = set()
    # One worker at a time, the first of each side first: it compiles, and the others find the kernels in Triton's
    # on-disk cache. Only one process runs kernels at any moment, as in the timing rounds: a side may be a tree from
    # before the Gluon kernels invalidated their barriers, whose kernels crash or hang when processes share a GPU
    # (docs/performance.md, "Several processes on one GPU").
    slots = max(len(side_workers) for side_workers in sides.values())
    queue = [(side, side_workers[i]) for i in range(slots) for side, side_workers in sides.items()
             if i < len(side_workers)]
    for name in names:
        for side, worker in queue:
            reply = worker.ask("prepare", name)
            if not reply["ok"]:
                errors[name].append(f"{side} prepare: {reply['error']}")
                failed.add(name)
            elif digests[name][side] is None:
                digests[name][side] = reply["digests"]
            elif digests[name][side] != reply["digests"]:  # one tree, two answers: not reproducible
                errors[name].append(f"{side}: workers of the same tree disagree")
                digests[name][side] = "differs between workers"
        print(f"prepared {name}: {'bit-equal' if _equal(digests[name]) else 'NOT bit-equal or failed'}", flush=True)
    order = list(sides)
    for r in range(rounds):
        for i, name in enumerate(n for n in names if n not in failed):
            first = (r + i) % 2  # alternate which side goes first, across rounds and configs
            pair = {}
            for side in order[first:] + order[:first]:
                reply = sides[side][r % len(sides[side])].ask("time", name)
                if not reply["ok"]:
                    errors[name].append(f"{side} round {r}: {reply['error']}")
                    break
                pair[side] = reply
            if len(pair) == len(sides):  # keep rounds paired: both sides or neither
                for side, reply in pair.items():
                    for key in ("fwd_ms", "fwdbwd_ms"):
                        times[name][side][key].append(reply[key])
        print(f"round {r + 1}/{rounds} done", flush=True)
    return [config_row(n, times[n]["base"], times[n]["new"], digests[n], errors[n]) for n in names]


def _equal(digests: dict[str, Any]) -> bool:
    return None not in digests.values() and digests["base"] == digests["new"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="git ref, or a folder holding mmsparse/ (e.g. from --export)")
    p.add_argument("--new", default=None, help="git ref or folder (default: this working tree)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated names (default: every GPU config; tiny_ab on CPU); from: "
                        f"{', '.join(ALL_CONFIGS)}")
    p.add_argument("--rounds", type=at_least_one, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here (and a .md beside it)")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--workers", type=at_least_one, default=None,
                   help="worker processes per side, taken in turn by the rounds (default 3 on a GPU, 1 on CPU)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time in ms (default 100)")
    p.add_argument("--cpu-reps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--nondet", action="store_true",
                   help="time deterministic=False (the one-pass backward); dQ, added in any order, is not compared")
    p.add_argument("--head-dim", type=at_least_one, default=None,
                   help="run every config at this head dim instead of its own")
    p.add_argument("--export", nargs=2, metavar=("REF", "DIR"), help="only export REF's files into DIR, and exit")
    args = p.parse_args(argv)
    if not args.export and not args.base:
        p.error("--base is required")
    return args


def _default_device() -> str:
    import torch  # only to ask; the parent never runs a kernel

    return "cuda" if torch.cuda.is_available() else "cpu"


def select_configs(text: str | None, device: str) -> list[str]:
    if text:
        names = expand_names(n.strip() for n in text.split(",") if n.strip())  # groups too (``masks``)
    else:
        names = list({**CONFIGS, **DECODE_CONFIGS}) if device.startswith("cuda") else ["tiny_ab"]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config: {', '.join(unknown)}; known: {', '.join(ALL_CONFIGS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.export:
        ref, dest = args.export
        print(f"exported {ref} ({export(ref, Path(dest))[:12]}) to {dest}")
        return 0
    args.device = args.device or _default_device()
    args.workers = args.workers or (3 if args.device.startswith("cuda") else 1)
    names = select_configs(args.configs, args.device)
    with tempfile.TemporaryDirectory(prefix="mmsparse-ab-") as scratch:
        trees = {"base": resolve_tree(args.base, Path(scratch) / "base"),
                 "new": resolve_tree(args.new, Path(scratch) / "new")}
        print(f"A/B on {args.device}: base {trees['base'].label}, new {trees['new'].label}; configs "
              f"{', '.join(names)}; {args.rounds} rounds", flush=True)
        with workers(trees, args) as sides:
            rows = measure(sides, names, args.rounds)
            info = {side: side_workers[0].info for side, side_workers in sides.items()}
    summary = verdict(rows)
    table = markdown(rows, summary, info["base"], info["new"])
    if args.nondet:
        table = ("deterministic=False: the one-pass backward; out, dK and dV compared, dQ not (added in any "
                 "order).\n\n" + table)
    if args.head_dim:
        table = f"Every config at head dim {args.head_dim}.\n\n" + table
    print("\n" + table, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"base": info["base"], "new": info["new"], "device": args.device, "rounds": args.rounds,
                  "workers": args.workers, "deterministic": not args.nondet, "head_dim": args.head_dim,
                  "configs": rows, "summary": summary}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table)
        print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
