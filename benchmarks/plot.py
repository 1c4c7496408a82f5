"""Plot a results JSON written by ``python -m benchmarks``: time and live-pair TFLOP/s per config per implementation.

Usage::

    python -m benchmarks.plot benchmarks/results/h100/latest.json     # -> benchmarks/results/h100/latest.png
    python -m benchmarks.plot results.json -o figure.png

Needs matplotlib (``pip install matplotlib`` or the project's ``bench`` extra); the benchmark itself does not.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

IMPL_ORDER = ("mmsparse", "flex", "flex_flash", "sdpa_mask", "dense_flash", "fa4_dense")
COLORS = {"mmsparse": "#d62728", "flex": "#1f77b4", "flex_flash": "#9467bd", "sdpa_mask": "#7f7f7f",
          "dense_flash": "#2ca02c", "fa4_dense": "#8c564b"}
PANELS = (  # (row key, title, log scale)
    ("fwd_ms", "forward time (ms, lower is better)", True),
    ("bwd_ms", "backward time (ms, lower is better)", True),
    ("fwd_tflops", "forward TFLOP/s over live pairs (higher is better)", False),
    ("bwd_tflops", "backward TFLOP/s over live pairs (higher is better)", False),
)


def _number(value: Any) -> float | None:
    """A finite float, or None for a missing / failed measurement."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _ordered(values: list[str], order: tuple[str, ...]) -> list[str]:
    seen = list(dict.fromkeys(values))
    return [v for v in order if v in seen] + [v for v in seen if v not in order]


def plot(rows: list[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Draw four grouped bar charts (fwd/bwd time, fwd/bwd TFLOP/s), configs on x, one bar per implementation.

    Args:
        rows: result rows (``config``, ``impl`` and the timing keys); rows without a number leave a gap.
        path: the PNG to write.
        title: figure title; default from the rows' gpu / commit.

    Returns:
        The path written. Raises ImportError when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    impls = _ordered([r["impl"] for r in rows], IMPL_ORDER)
    table = {(r["config"], r["impl"]): r for r in rows}
    width = 0.8 / max(1, len(impls))
    fig, axes = plt.subplots(2, 2, figsize=(max(10.0, 1.6 * len(configs) + 4), 8.5), squeeze=False)
    for ax, (key, panel_title, log) in zip(axes.flat, PANELS):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for x, cfg in enumerate(configs):
                y = _number(table.get((cfg, impl), {}).get(key))
                if y is not None and (y > 0 or not log):
                    xs.append(x + (i - (len(impls) - 1) / 2) * width)
                    ys.append(y)
            ax.bar(xs, ys, width=width, label=impl, color=COLORS.get(impl))
        if log:
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title is None and rows:
        first = rows[0]
        title = f"mmsparse vs baselines, bf16 — {first.get('gpu', '?')}, torch {first.get('torch', '?')}, " \
                f"triton {first.get('triton', '?')}, commit {first.get('commit', '?')}"
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="results JSON (a list of rows) from python -m benchmarks")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: next to the JSON)")
    args = parser.parse_args(argv)
    rows = json.loads(args.json.read_text())
    if not isinstance(rows, list):
        print(f"{args.json}: expected a JSON list of rows", file=sys.stderr)
        return 2
    try:
        out = plot(rows, args.output or args.json.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
