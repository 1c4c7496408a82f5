"""The host A/B tool (tools/host_ab.py): its medians and ratios, and one real run against an exported tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tools import host_ab
from tools.host_ab import summarize


def _run(side: str, round_: int, pinned: bool, seed_us: float) -> dict:
    return {"round": round_, "side": side, "pinned": pinned, "mmsparse": side,
            "figures": {"seed_fwd_bwd": seed_us, "seed_fwd": seed_us / 4}}


def test_each_pinning_gets_its_own_medians_and_ratio():
    runs = [_run("base", 0, False, 400.0), _run("new", 0, False, 500.0), _run("base", 1, False, 300.0),
            _run("new", 1, False, 200.0), _run("base", 2, False, 350.0), _run("new", 2, False, 250.0),
            _run("base", 0, True, 240.0), _run("new", 0, True, 220.0)]
    rows = {(row["figure"], row["pinned"]): row for row in summarize(runs)}
    unpinned = rows[("seed_fwd_bwd", False)]
    assert (unpinned["base_us"], unpinned["new_us"]) == (350.0, 250.0)  # medians over rounds, not the first run
    assert unpinned["ratio"] == 350.0 / 250.0 and unpinned["base_each_us"] == [400.0, 300.0, 350.0]
    assert (unpinned["base_fastest_us"], unpinned["new_fastest_us"]) == (300.0, 200.0)
    assert unpinned["fastest_ratio"] == 300.0 / 200.0
    pinned = rows[("seed_fwd_bwd", True)]
    assert pinned["ratio"] == 240.0 / 220.0 and pinned["new_each_us"] == [220.0]
    assert rows[("seed_fwd", True)]["base_us"] == 60.0
    assert [row["pinned"] for row in summarize(runs)][:2] == [True, True]  # the pinned rows, which compare, first


@pytest.mark.interpreter  # CPU children through the interpreter; a GPU's children are the tool's own runs
def test_host_ab_runs_against_an_exported_tree(tmp_path):
    """Each side's process imports mmsparse from its own tree and reports every figure (CPU: the interpreter, so the
    times mean nothing)."""
    base = tmp_path / "base"
    base.mkdir()
    subprocess.run(["cp", "-r", str(REPO / "mmsparse"), str(base / "mmsparse")], check=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tools.host_ab", "--base", str(base), "--device", "cpu", "--calls", "1",
           "--rounds", "1", "--pin", "none", "--warmup", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "host_ab.json").read_text())
    sources = {run["side"]: Path(run["mmsparse"]) for run in record["runs"]}
    assert sources == {"base": (base / "mmsparse").resolve(), "new": REPO / "mmsparse"}
    figures = {row["figure"] for row in record["rows"]}
    assert figures == {"seed_fwd", "seed_fwd_bwd", "seed_fwd_bwd_one_thread", "seed_fwd_bwd_new_lengths",
                       "seed_fwd_bwd_new_lengths_one_thread", "small_2k_fwd", "small_2k_fwd_bwd",
                       "small_2k_fwd_bwd_one_thread", "seed_fwd_op", "seed_bwd_op"}
    assert all(row["base_us"] > 0 and row["new_us"] > 0 for row in record["rows"])
    assert "| seed_bwd_op | no |" in (out / "host_ab.md").read_text()


def test_warmup_processes_are_run_first_and_dropped(monkeypatch):
    """A run's first process is slow on a GPU host: ``warmup`` unpinned processes of each side run before the
    rounds and none of their figures enter a median."""
    calls = []

    def child(tree, device, calls_, pin):
        calls.append((tree, pin))
        return {"mmsparse": tree, "figures": {"seed_fwd": 1000.0 if len(calls) <= 2 else 10.0}}

    monkeypatch.setattr(host_ab, "run_child", child)
    runs = host_ab.measure({"base": "b", "new": "n"}, "cpu", 3, rounds=2, pin="5", warmup=1)
    assert calls[:2] == [("b", None), ("n", None)] and len(calls) == 2 + 2 * 2 * 2
    assert len(runs) == 8 and all(run["figures"]["seed_fwd"] == 10.0 for run in runs)
