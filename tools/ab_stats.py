"""The A/B verdict: paired ratios per config and pass, their geometric mean, the worst one, and the bar."""

from __future__ import annotations

import math
import statistics
from typing import Any

MIN_GEOMEAN = 0.98  # a change may cost at most 2% over all configs and passes
MIN_RATIO = 0.95  # and at most 5% on any one of them
MAX_SEED_FWD_US = 5.0  # the host-bound seed forward may grow by at most this (us)
LATENCY_CONFIG = "seed"
PASSES = ("fwd", "bwd")


def pass_times(rounds: dict[str, list[float]], name: str) -> list[float]:
    """Per-round times of one pass: ``fwd`` as measured, ``bwd`` = (forward + backward) - forward."""
    if name == "fwd":
        return list(rounds.get("fwd_ms", []))
    return [both - fwd for both, fwd in zip(rounds.get("fwdbwd_ms", []), rounds.get("fwd_ms", []))]


def paired_ratio(base: list[float], new: list[float]) -> float | None:
    """Median over rounds of base / new, each round's two times measured back to back: the machine's slow spells
    then cancel instead of landing on one side. > 1 means the new tree is faster."""
    ratios = [b / n for b, n in zip(base, new) if b > 0 and n > 0]
    return statistics.median(ratios) if ratios else None


def config_row(name: str, base: dict[str, list[float]], new: dict[str, list[float]],
               digests: dict[str, dict[str, str] | None], errors: list[str]) -> dict[str, Any]:
    """One config's medians, paired ratios and bit-equality of out, dq, dk, dv."""
    row: dict[str, Any] = {"config": name, "rounds": len(new.get("fwd_ms", []))}
    for p in PASSES:
        b, n = pass_times(base, p), pass_times(new, p)
        row[f"base_{p}_ms"] = statistics.median(b) if b else None
        row[f"new_{p}_ms"] = statistics.median(n) if n else None
        row[f"{p}_ratio"] = paired_ratio(b, n)
    if row["base_fwd_ms"] is not None and row["new_fwd_ms"] is not None:
        row["fwd_delta_us"] = (row["new_fwd_ms"] - row["base_fwd_ms"]) * 1e3
    a, b = digests.get("base"), digests.get("new")
    row["bit_equal"] = None if a is None or b is None else a == b
    row["differs"] = [t for t in a if a[t] != b.get(t)] if a is not None and b is not None else []
    row["errors"] = errors
    return row


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric mean and minimum over every (config, pass) ratio, the seed forward's latency change, whether all
    outputs are bit-equal, and whether the bar is met."""
    ratios = [(r[f"{p}_ratio"], f"{r['config']} {p}") for r in rows for p in PASSES if r.get(f"{p}_ratio")]
    out: dict[str, Any] = {"min_geomean": MIN_GEOMEAN, "min_ratio": MIN_RATIO}
    if ratios:
        out["geomean"] = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
        for p in PASSES:
            sub = [x for x, label in ratios if label.endswith(p)]
            out[f"geomean_{p}"] = math.exp(sum(map(math.log, sub)) / len(sub)) if sub else None
        out["min"], out["min_at"] = min(ratios)
    seed = next((r for r in rows if r["config"] == LATENCY_CONFIG and "fwd_delta_us" in r), None)
    if seed is not None:
        out["seed_fwd_delta_us"] = seed["fwd_delta_us"]
        out["seed_ok"] = seed["fwd_delta_us"] <= MAX_SEED_FWD_US
    out["measured"] = len(ratios) == len(rows) * len(PASSES) and not any(r["errors"] for r in rows)
    out["speed_ok"] = bool(ratios) and out["geomean"] >= MIN_GEOMEAN and out["min"] >= MIN_RATIO
    out["all_bit_equal"] = all(r["bit_equal"] for r in rows)
    out["pass"] = out["measured"] and out["speed_ok"] and out.get("seed_ok", True) and out["all_bit_equal"]
    return out


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], base: dict[str, str], new: dict[str, str]) -> str:
    """The table and the verdict, as printed and as written next to ``--out``."""
    lines = [
        f"A/B: base {base['label']} vs new {new['label']} on {new.get('gpu')}, torch {new.get('torch')}, triton "
        f"{new.get('triton')}. Ratio = base / new time, median of paired rounds (> 1: new is faster).",
        "",
        "| config | base fwd ms | new fwd ms | fwd ratio | base bwd ms | new bwd ms | bwd ratio | fwd delta us "
        "| bit-equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        equal = {True: "equal", False: "UNEQUAL (" + ", ".join(r["differs"]) + ")", None: "-"}[r["bit_equal"]]
        lines.append(
            f"| {r['config']} | {_f(r['base_fwd_ms'])} | {_f(r['new_fwd_ms'])} | {_f(r['fwd_ratio'])} | "
            f"{_f(r['base_bwd_ms'])} | {_f(r['new_bwd_ms'])} | {_f(r['bwd_ratio'])} | "
            f"{_f(r.get('fwd_delta_us'), 1)} | {equal} |"
        )
    errors = [f"- {r['config']}: {e}" for r in rows for e in r["errors"]]
    if errors:
        lines += ["", "Errors:", "", *errors]
    s = summary
    lines += [
        "",
        f"geomean {_f(s.get('geomean'))} (fwd {_f(s.get('geomean_fwd'))}, bwd {_f(s.get('geomean_bwd'))}; bar >= "
        f"{MIN_GEOMEAN}), min {_f(s.get('min'))} at {s.get('min_at', '-')} (bar >= {MIN_RATIO})",
    ]
    if "seed_fwd_delta_us" in s:
        lines.append(f"seed forward {s['seed_fwd_delta_us']:+.1f} us (bar <= +{MAX_SEED_FWD_US:.0f} us)")
    lines.append(f"outputs bit-equal: {'all' if s['all_bit_equal'] else 'NOT all'}; "
                 f"verdict: {'PASS' if s['pass'] else 'FAIL'}")
    return "\n".join(lines) + "\n"
