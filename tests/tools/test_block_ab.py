"""The block A/B tool (tools/block_ab.py): each process's own ratios, and one real run against an exported tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tools.block_ab import markdown, process_ratios

MODES = {"block_eager_us": 2000.0, "block_compile_us": 1800.0, "block_reduce_overhead_us": 1000.0,
         "block_sdpa_eager_us": 1600.0, "block_sdpa_compile_us": 1500.0}


def test_ratios_are_each_process_own_and_medians_per_side():
    assert process_ratios(MODES) == {"compile/eager": 0.9, "reduce_overhead/eager": 0.5,
                                     "sdpa_compile/sdpa_eager": 1500.0 / 1600.0}
    assert process_ratios({"block_eager_us": 5.0}) == {}  # a CPU process times eager only
    slow = {name: 2 * value for name, value in MODES.items()}  # a slow process: every mode twice as long
    runs = [{"round": 0, "side": "base", "figures": MODES}, {"round": 0, "side": "new", "figures": slow},
            {"round": 1, "side": "new", "figures": {**MODES, "block_compile_us": 1600.0}}]
    record = {"base": "b", "new": "n", "gpu": "G", "torch": "t", "triton": "tr", "rounds": 2,
              "figures": list(MODES), "ratios": list(process_ratios(MODES)), "checksums_equal": True}
    text = markdown(runs, record)
    assert "| 0 | new | 0.900 | 0.500 | 0.938 | 4000 |" in text  # the slow process's ratios are its own
    assert "new: median compile/eager 0.850" in text and "base: median compile/eager 0.900" in text


@pytest.mark.interpreter  # the CPU run: eager only; on a GPU every mode, torch.compile included
def test_block_ab_runs_against_an_exported_tree(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    subprocess.run(["cp", "-r", str(REPO / "mmsparse"), str(base / "mmsparse")], check=True)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tools.block_ab", "--base", str(base), "--device", "cpu", "--calls", "1",
           "--rounds", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "block_ab.json").read_text())
    assert {run["side"]: Path(run["mmsparse"]) for run in record["runs"]} == {
        "base": (base / "mmsparse").resolve(), "new": REPO / "mmsparse"}
    assert record["figures"] == ["block_eager_us"] and record["checksums_equal"] is True
    assert all(run["figures"]["block_eager_us"] > 0 for run in record["runs"])
