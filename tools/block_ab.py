"""The two-layer block's training step in a working tree against a git ref: fresh processes by turns.

    python -m tools.block_ab --base REF                 # this working tree against REF, 2 rounds
    python -m tools.block_ab --base REF --rounds 3 --out DIR
    python -m tools.block_ab --base REF --device cpu --calls 2 --rounds 1   # CPU smoke run (eager only)

Each process (``tools/host_ab_child.py --block``: mmsparse from its tree, the harness of this checkout) times
``benchmarks.host``'s block (two ``MultimodalSelfAttention`` layers at the seed's lengths) eager, compiled and under
``reduce-overhead``, and the same block with dense SDPA, the modes taking turns in 5 rounds, and checksums the
compiled step's output and input gradient. A host-bound step drifts from process to process on a GPU host (dense
SDPA's own step moved 10-20% between processes of one lease), so the ratios that compare are each process's own:
compiled / eager and reduce-overhead / eager, beside dense SDPA's compiled / eager as the control. Equal checksums
across the sides mean equal outputs and gradients. Writes ``DIR/block_ab.{json,md}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.arguments import at_least_one

from .ab import resolve_tree
from .host_ab import add_side_arguments, report, run_child

TOPIC = "block_ab"
RATIOS = (("compile", "eager"), ("reduce_overhead", "eager"), ("sdpa_compile", "sdpa_eager"))


def process_ratios(figures: dict[str, float]) -> dict[str, float]:
    """One process's own ratios of :data:`RATIOS` (those whose modes it timed)."""
    return {f"{top}/{bottom}": figures[f"block_{top}_us"] / figures[f"block_{bottom}_us"] for top, bottom in RATIOS
            if f"block_{top}_us" in figures and f"block_{bottom}_us" in figures}


def markdown(runs: list[dict[str, Any]], record: dict[str, Any]) -> str:
    lines = [
        f"Block A/B (`python -m tools.block_ab`): base {record['base']}, new {record['new']}; {record['gpu']}, torch "
        f"{record['torch']}, triton {record['triton']}; {record['rounds']} rounds, a fresh process a side a round, "
        "the sides by turns. Each process's own ratios (the step's time in one mode over another, the modes taking "
        "turns in the process), then each mode's step in µs.",
        "",
    ]
    columns = [*record["ratios"], *record["figures"]]
    lines += ["| round | side | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
    for run in runs:
        values = {**process_ratios(run["figures"]), **run["figures"]}
        lines.append(f"| {run['round']} | {run['side']} | "
                     + " | ".join(f"{values[c]:.3f}" if c in record["ratios"] else f"{values[c]:.0f}" for c in columns)
                     + " |")
    for side in ("base", "new") if record["ratios"] else ():
        medians = {r: statistics.median(process_ratios(run["figures"])[r] for run in runs if run["side"] == side)
                   for r in record["ratios"]}
        lines += ["", f"{side}: median " + ", ".join(f"{r} {v:.3f}" for r, v in medians.items())]
    lines += ["", f"Checksums equal across every process: {record['checksums_equal']}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.block_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_side_arguments(p)
    p.add_argument("--calls", type=at_least_one, default=50, help="steps a mode's mean is taken over, per turn")
    p.add_argument("--out", type=Path, default=None, help="write block_ab.json and block_ab.md into this folder")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # only to ask; the parent never runs a kernel

    from benchmarks.env import versions

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    runs = []
    with tempfile.TemporaryDirectory(prefix="mmsparse-block-ab-") as scratch:
        trees = {"base": resolve_tree(args.base, Path(scratch) / "base"),
                 "new": resolve_tree(args.new, Path(scratch) / "new")}
        print(f"block A/B on {device}: base {trees['base'].label}, new {trees['new'].label}", flush=True)
        for r in range(args.rounds):
            first = r % 2
            for side in list(trees)[first:] + list(trees)[:first]:
                result = run_child(trees[side], device, args.calls, None, "--block")
                runs.append({"round": r, "side": side, **result})
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    figures = list(runs[0]["figures"])
    record = {**versions(torch.device(device)), "base": trees["base"].label, "new": trees["new"].label,
              "device": device, "rounds": args.rounds, "calls": args.calls, "figures": figures,
              "ratios": list(process_ratios(runs[0]["figures"])),
              "checksums_equal": all(run["sums"] == runs[0]["sums"] for run in runs), "runs": runs}
    report(args.out, TOPIC, record, markdown(runs, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
