"""Host time of a working tree against a git ref: fresh processes by turns, pinned to one core and not.

    python -m tools.host_ab --base REF                  # this working tree against REF, 2 rounds, pinned to CPU 5
    python -m tools.host_ab --base REF --rounds 3 --pin 3 --out DIR
    python -m tools.host_ab --base REF --pin none --device cpu --calls 3   # CPU smoke run (the interpreter)

A call small enough to be bound by the host (the seed) measures the host's machinery more than mmsparse: on an H200
host processes of one tree spread up to 2x apart from one lease to the next, and within a process autograd hands the
backward to a thread of its own, whose wake-ups cost more than the attention's own work. So each figure comes from a
new process (``tools/host_ab_child.py``: mmsparse from its tree, the harness of this checkout), the sides take
turns in each round (the side that goes first alternating), and every process runs twice: unpinned, and pinned to
one core with ``taskset`` (both threads on it), where the spread shrinks to a few percent. The figures are
``benchmarks.host``'s: the seed's and small_2k's forward, forward + backward on autograd's device thread and on the
calling thread, the seed's forward + backward with new device lengths every call (the mask built in the call), and
one call of the compiled graph's forward and backward ops at the seed. The ratio is base / new of
the medians over rounds (> 1: the new tree takes less host time), and of each side's fastest round (noise only
adds time). Writes ``DIR/host_ab.{json,md}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.arguments import at_least_one
from benchmarks.report import fmt, write_record

from .ab import Tree, child_env, resolve_tree

CHILD = Path(__file__).resolve().parent / "host_ab_child.py"
TOPIC = "host_ab"


def run_child(tree: Tree, device: str, calls: int, pin: str | None, *extra: str) -> dict[str, Any]:
    """One fresh process's figures (``host_ab_child``, with ``extra`` arguments), pinned to CPU ``pin`` when
    given (on the CPU through Triton's interpreter: ``ab.child_env``)."""
    cmd = [sys.executable, str(CHILD), "--tree", str(tree.path), "--device", device, "--calls", str(calls), *extra]
    if pin is not None:
        cmd = ["taskset", "-c", pin, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=child_env(device))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{tree.label}{'' if pin is None else f' pinned to {pin}'} failed "
                           f"(status {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def measure(trees: dict[str, Tree], device: str, calls: int, rounds: int, pin: str | None,
            warmup: int = 1) -> list[dict[str, Any]]:
    """``rounds`` rounds; in each, every side once unpinned and once pinned (``pin``), the sides in turns. First
    ``warmup`` unpinned processes of each side whose figures are dropped: on an H200 host the run's first process
    read 1.3-2.2x the host time of every later one, pinned or not (``benchmarks/results/h200/host_ab.md``)."""
    runs = []
    modes = [None] if pin is None else [None, pin]
    order = list(trees)
    for _ in range(warmup):
        for side in order:
            run_child(trees[side], device, calls, None)
    for r in range(rounds):
        first = r % 2
        for side in order[first:] + order[:first]:
            for mode in modes:
                result = run_child(trees[side], device, calls, mode)
                runs.append({"round": r, "side": side, "pinned": mode is not None, **result})
        print(f"round {r + 1}/{rounds} done", flush=True)
    return runs


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per figure and pinning: each side's median over rounds and the ratio base / new."""
    rows = []
    figures = list(runs[0]["figures"]) if runs else []
    for pinned in sorted({run["pinned"] for run in runs}, reverse=True):
        for figure in figures:
            values = {side: [run["figures"][figure] for run in runs if run["side"] == side and run["pinned"] == pinned]
                      for side in ("base", "new")}
            base, new = (statistics.median(values[side]) for side in ("base", "new"))
            base_min, new_min = (min(values[side]) for side in ("base", "new"))
            rows.append({"figure": figure, "pinned": pinned, "base_us": base, "new_us": new,
                         "base_each_us": values["base"], "new_each_us": values["new"], "ratio": base / new,
                         "base_fastest_us": base_min, "new_fastest_us": new_min, "fastest_ratio": base_min / new_min})
    return rows


def markdown(rows: list[dict[str, Any]], record: dict[str, Any]) -> str:
    lines = [
        f"Host A/B (`python -m tools.host_ab`): base {record['base']}, new {record['new']}; {record['gpu']}, torch "
        f"{record['torch']}, triton {record['triton']}; {record['rounds']} rounds, a fresh process for each figure "
        f"set, the sides by turns; median host µs of {record['calls']} calls each. Ratio = base / new (> 1: the new "
        "tree takes less host time). A slow spell of the machine only adds time, so where the rounds spread the "
        "fastest round of each side is the steadier reading (its ratio beside the medians').",
        "",
        "| figure | pinned | base µs | new µs | ratio | fastest ratio | base, each round | new, each round |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        each = lambda values: " / ".join(fmt(v, 1) for v in values)  # noqa: E731
        lines.append(f"| {row['figure']} | {'yes' if row['pinned'] else 'no'} | {fmt(row['base_us'], 1)} | "
                     f"{fmt(row['new_us'], 1)} | {row['ratio']:.3f} | {row['fastest_ratio']:.3f} | "
                     f"{each(row['base_each_us'])} | {each(row['new_each_us'])} |")
    return "\n".join(lines) + "\n"


def add_side_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every A/B of fresh processes takes: the two sides, the rounds and the device."""
    p.add_argument("--base", required=True, help="git ref, or a folder holding mmsparse/")
    p.add_argument("--new", default=None, help="git ref or folder (default: this working tree)")
    p.add_argument("--rounds", type=at_least_one, default=2, help="rounds (default 2)")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.host_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_side_arguments(p)
    p.add_argument("--calls", type=at_least_one, default=300, help="calls a figure's median is taken over")
    p.add_argument("--pin", default="5", help="the CPU of the pinned runs (taskset -c), or 'none' (default 5)")
    p.add_argument("--warmup", type=int, default=1,
                   help="processes of each side run first and dropped (default 1: a run's first process is slow)")
    p.add_argument("--out", type=Path, default=None, help="write host_ab.json and host_ab.md into this folder")
    args = p.parse_args(argv)
    args.pin = None if args.pin == "none" else args.pin
    if args.pin is not None and shutil.which("taskset") is None:
        p.error("--pin needs taskset (util-linux); pass --pin none to run unpinned only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # only to ask; the parent never runs a kernel

    from benchmarks.env import versions

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="mmsparse-host-ab-") as scratch:
        trees = {"base": resolve_tree(args.base, Path(scratch) / "base"),
                 "new": resolve_tree(args.new, Path(scratch) / "new")}
        print(f"host A/B on {device}: base {trees['base'].label}, new {trees['new'].label}; {args.rounds} rounds",
              flush=True)
        runs = measure(trees, device, args.calls, args.rounds, args.pin, args.warmup)
    rows = summarize(runs)
    record = {**versions(torch.device(device)), "base": trees["base"].label, "new": trees["new"].label,
              "device": device, "rounds": args.rounds, "warmup": args.warmup, "calls": args.calls, "pin": args.pin,
              "rows": rows,
              "runs": runs}
    report(args.out, TOPIC, record, markdown(rows, record))
    return 0


def report(out: Path | None, topic: str, record: dict[str, Any], table: str) -> None:
    """Print ``table``; with ``out``, write the record there (``topic``.json and .md)."""
    print("\n" + table, end="")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        print(f"wrote {write_record(out, topic, record, table)}")


if __name__ == "__main__":
    sys.exit(main())
