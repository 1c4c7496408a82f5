"""What a benchmark run leaves behind: console lines, and ``results/<gpu>/<topic>.{json,md}`` (+ ``.png``).

Every record has one layout: ``benchmarks/results/<gpu-slug>/<topic>.json`` and ``.md``, holding the current run
only (git history keeps the earlier ones). The attention benchmark's topic is ``latest``; the metadata build's is
``build``.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

from .check import RTOL_OUT


def log(message: str = "") -> None:
    print(message, flush=True)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_json(data: Any, path: Path) -> None:
    """JSON with non-finite floats as null, written atomically (a crash mid-run keeps the previous file)."""
    if isinstance(data, list):
        data = [{k: _finite(v) for k, v in r.items()} if isinstance(r, dict) else r for r in data]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def write_record(folder: Path, topic: str, data: Any, table: str) -> Path:
    """``folder/<topic>.json`` and ``folder/<topic>.md``; returns the JSON's path."""
    path = folder / f"{topic}.json"
    write_json(data, path)
    (folder / f"{topic}.md").write_text(table)
    return path


def same_commit_rows(path: Path, commit: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the record at ``path`` that a run of the same ``commit`` keeps: those of the (config, GPUs) it
    did not measure. Runs on 2 and on 4 GPUs fill one record; another commit's rows go."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    measured = {(r["config"], r["gpus"]) for r in rows}
    return [r for r in old.get("rows", []) if old.get("commit") == commit and (r["config"], r["gpus"]) not in measured]


# ---------------------------------------------------------------------------------------------------------------
# Console


def _has_rates(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows ran where TFLOP/s mean something: a GPU (a CPU run leaves them None, see ``finish_row``)."""
    return any(not str(r.get("gpu") or "").startswith("cpu") for r in rows)


def progress_line(index: int, total: int, row: dict[str, Any]) -> str:
    head = f"[{index}/{total}] {row['config']:<18} {row['impl']:<11}"
    if row.get("skipped"):
        return f"{head} skipped: {row['skipped']}"
    rates = _has_rates([row])
    parts = [
        f"fwd {fmt(row['fwd_ms']):>8} ms" + (f" {fmt(row['fwd_tflops'], 1):>6} TF/s" if rates else ""),
        f"bwd {fmt(row['bwd_ms']):>8} ms" + (f" {fmt(row['bwd_tflops'], 1):>6} TF/s" if rates else ""),
        f"peak {fmt(row['peak_mib'], 0):>6} MiB",
        f"build {fmt(row['build_ms'])} ms",
        f"check {row.get('check') or '-'}",
    ]
    if row.get("first_call_s") is not None:  # flex_flash
        parts.append(f"first call {row['first_call_s']:.1f} s, deterministic bwd {row.get('deterministic_bwd')}")
    if row.get("error"):
        parts.append(f"ERROR {row['error']}")
    return f"{head} " + " | ".join(parts)


def check_line(row: dict[str, Any], seconds: float) -> str:
    grads = (f"grads max_err {row['grad_max_err']:.2e} rel {row['grad_rel_err']:.2e}"
             if row.get("grad_max_err") is not None else row.get("grad_error", "grads not checked"))
    return (f"    check {row['impl']:<11} {row['check']:<4} out max_err {row['max_err']:.2e} rel {row['rel_err']:.2e}"
            f" | {grads} | backend {row.get('backend')} ({seconds:.1f} s)")


def loud_fail(row: dict[str, Any]) -> None:
    bar = "!" * 100
    what = row.get("grad_fail") or f"out rel err {row['rel_err']:.2e} > {RTOL_OUT}"
    log(f"{bar}\n!!! FAIL {row['config']} / {row['impl']}: does not match the float32 reference ({what})\n{bar}")


# ---------------------------------------------------------------------------------------------------------------
# The attention benchmark's tables


def _ratio(base: float | None, ours: float | None) -> str:
    return f"{base / ours:.2f}x" if base and ours and ours > 0 and base > 0 else "-"


def _status(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "skipped"
    if row.get("check") == "FAIL":
        what = row.get("grad_fail") or f"out rel {row['rel_err']:.1e}"
        status = f"**FAIL** ({what})"
    elif row.get("error"):
        status = "error"
    else:
        status = row.get("check") or "-"
    if row.get("reference") == "dense":  # dense_flash: checked against the mask it computes, not the config's
        status += " (speed only: other mask)"
    return status


def markdown(rows: list[dict[str, Any]], timing_method: str) -> str:
    """Two tables: mmsparse vs Flex per config (and vs Flex's FLASH backend when the run has ``flex_flash`` rows),
    then every (config, impl) row; a third with what only ``flex_flash`` records; plus the run's provenance."""
    by = {(r["config"], r["impl"]): r for r in rows}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    flash = any(r["impl"] == "flex_flash" for r in rows)
    rates = _has_rates(rows)
    first = rows[0] if rows else {}
    flash_cols = "---:|---:|" if flash else ""  # two more right-aligned columns
    flash_head = ("flex_flash fwd ms | fwd speedup vs flex_flash | ",
                  "flex_flash bwd ms | bwd speedup vs flex_flash | ", " / flex_flash") if flash else ("", "", "")
    lines = [
        f"Run: {first.get('gpu')}, torch {first.get('torch')}, triton {first.get('triton')}, commit "
        f"{first.get('commit')}, {datetime.date.today().isoformat()}. bf16; {timing_method}; bwd = (fwd+bwd) - fwd; "
        + ("TF/s count live pairs only (4·B·Hq·D·live fwd, 2.5x bwd), also for dense_flash, which computes every "
           "pair (or the causal half on configs with causal pairs): a speed reference only, checked against the mask "
           "it computes, not the config's." if rates else
           "no TF/s on a CPU (Triton's interpreter); dense_flash is checked against the mask it computes, not the "
           "config's."),
        "",
        f"| config | S | density | window | mmsparse fwd ms | flex fwd ms | fwd speedup | {flash_head[0]}mmsparse bwd "
        f"ms | flex bwd ms | bwd speedup | {flash_head[1]}build ms mmsparse / flex{flash_head[2]} |",
        "|---|---:|---:|---:|---:|---:|---:|" + flash_cols + "---:|---:|---:|" + flash_cols + "---:|",
    ]
    for c in configs:
        m, f, ff = by.get((c, "mmsparse"), {}), by.get((c, "flex"), {}), by.get((c, "flex_flash"), {})
        any_row = m or f or ff or next(r for r in rows if r["config"] == c)
        fwd_flash = f"{fmt(ff.get('fwd_ms'))} | {_ratio(ff.get('fwd_ms'), m.get('fwd_ms'))} | " if flash else ""
        bwd_flash = f"{fmt(ff.get('bwd_ms'))} | {_ratio(ff.get('bwd_ms'), m.get('bwd_ms'))} | " if flash else ""
        build_flash = f" / {fmt(ff.get('build_ms'), 2)}" if flash else ""
        lines.append(
            f"| {c} | {any_row.get('seq_len')} | {fmt(any_row.get('density'), 2)} | {fmt(any_row.get('window'))} | "
            f"{fmt(m.get('fwd_ms'))} | "
            f"{fmt(f.get('fwd_ms'))} | {_ratio(f.get('fwd_ms'), m.get('fwd_ms'))} | {fwd_flash}"
            f"{fmt(m.get('bwd_ms'))} | {fmt(f.get('bwd_ms'))} | {_ratio(f.get('bwd_ms'), m.get('bwd_ms'))} | "
            f"{bwd_flash}{fmt(m.get('build_ms'), 2)} / {fmt(f.get('build_ms'), 2)}{build_flash} |"
        )
    lines += [
        "",
        "| config | impl | fwd ms | bwd ms | " + ("fwd TF/s | bwd TF/s | " if rates else "")
        + "peak MiB | build ms | fwd vs flex | bwd vs flex "
        + ("| fwd vs flex_flash | bwd vs flex_flash " if flash else "") + "| check |",
        "|---|---|---:|---:|" + ("---:|---:|" if rates else "") + "---:|---:|---:|---:|" + flash_cols + "---|",
    ]
    for r in rows:
        f, ff = by.get((r["config"], "flex"), {}), by.get((r["config"], "flex_flash"), {})
        vs_flash = (f"{_ratio(ff.get('fwd_ms'), r.get('fwd_ms'))} | {_ratio(ff.get('bwd_ms'), r.get('bwd_ms'))} | "
                    if flash else "")
        lines.append(
            f"| {r['config']} | {r['impl']} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('bwd_ms'))} | "
            + (f"{fmt(r.get('fwd_tflops'), 0)} | {fmt(r.get('bwd_tflops'), 0)} | " if rates else "")
            + f"{fmt(r.get('peak_mib'), 0)} | "
            f"{fmt(r.get('build_ms'), 2)} | {_ratio(f.get('fwd_ms'), r.get('fwd_ms'))} | "
            f"{_ratio(f.get('bwd_ms'), r.get('bwd_ms'))} | {vs_flash}{_status(r)} |"
        )
    if flash:
        lines += [
            "",
            "flex_flash (FlexAttention, FLASH backend): the first forward + backward, compilation included, and "
            "whether two backward passes on the same inputs give bit-equal dq/dk/dv.",
            "",
            "| config | first call s | deterministic bwd | peak MiB | status |",
            "|---|---:|---|---:|---|",
        ]
        for c in configs:
            ff = by.get((c, "flex_flash"))
            if ff is not None:
                det = {True: "yes", False: "no"}.get(ff.get("deterministic_bwd"), "-")
                lines.append(f"| {c} | {fmt(ff.get('first_call_s'), 1)} | {det} | "
                             f"{fmt(ff.get('peak_mib'), 0)} | {_status(ff)} |")
    notes = [f"- {r['config']} / {r['impl']}: {r['error']}" for r in rows if r.get("error")]
    if notes:
        lines += ["", "Errors and skips:", "", *notes]
    return "\n".join(lines) + "\n"


def write_final(rows: list[dict[str, Any]], out_dir: Path, timing_method: str, plot: bool,
                topic: str = "latest") -> str:
    """The run's record (``<topic>.json``, ``.md``) and, when matplotlib imports, ``<topic>.png``."""
    table = markdown(rows, timing_method)
    write_record(out_dir, topic, rows, table)
    if plot and rows:
        try:
            from .plot import plot as plot_rows

            log(f"plot: {plot_rows(rows, out_dir / f'{topic}.png')}")
        except ImportError:
            log(f"plot: matplotlib not available; later: python -m benchmarks.plot {out_dir / f'{topic}.json'}")
        except Exception as e:
            log(f"plot failed: {type(e).__name__}: {e}")
    return table
