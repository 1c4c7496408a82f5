"""tests.stress.shared_gpu: several processes running mmsparse at once, the watchdog that reports them, and the record
that keeps one entry per setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mmsparse.attention.dispatch import hopper_gluon_available
from tests.stress import shared_gpu

pytestmark = pytest.mark.stress  # the stress tools' smoke tests: pytest -m stress


def test_mixed_children_run_to_the_end_and_are_recorded(capsys, tmp_path, device):
    # Training and inference children on the session's device (through the interpreter on a CPU) with the tiny
    # config (the CPU's default; a GPU's default configs are 13k tokens), both warmed up first; the run lands in the
    # record. An interpreted call with a new mask takes seconds, and tens of them on a loaded 2-core machine: the
    # stall time (25 s by default, for GPU calls of milliseconds) would read a slow child as a hung one.
    assert shared_gpu.main(["--procs", "2", "--seconds", "1", "--device", device.type, "--configs", "tiny_ab",
                            "--mode", "mixed", "--stall", "600", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "process 0 (train): ok" in out and "process 1 (infer): ok" in out and "all ran to the end" in out
    record = json.loads((tmp_path / "shared_gpu.json").read_text())
    (run,) = record["runs"]
    assert run["mode"] == "mixed" and run["roles"] == {"train": 1, "infer": 1} and run["ok"]
    assert run["failures"] == run["stalls"] == 0 and all(c >= 1 for c in run["calls_per_process"])
    # what the children report: the Gluon kernels only on a Hopper GPU with Gluon, the device's name
    cuda = device.type == "cuda"
    gluon = cuda and bool(hopper_gluon_available(torch.cuda.current_device()))
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    assert run["gluon_kernels"] is gluon and run["gpu"].startswith(gpu) and run["torch"] and run["triton"]
    assert run["commit"]
    kernels = "Gluon" if gluon else "tl"
    assert f"| mixed (1 train, 1 infer) | on | {kernels} | 2 |" in (tmp_path / "shared_gpu.md").read_text()


def test_a_config_that_cannot_run_fails_before_the_children_start(capsys, tmp_path):
    assert shared_gpu.main(["--procs", "2", "--seconds", "1", "--device", "cpu", "--configs", "no_such",
                            "--out", str(tmp_path)]) == 1
    assert "warm-up: failed" in capsys.readouterr().out
    (run,) = json.loads((tmp_path / "shared_gpu.json").read_text())["runs"]
    assert run["failures"] == 1 and not run["ok"] and run["calls_per_process"] == []


def _run(procs, gluon, mode, statuses, calls):
    args = shared_gpu.parse_args(["--procs", str(procs), "--seconds", "60", "--gluon", gluon, "--mode", mode,
                                  "--device", "cuda"])
    args.configs = shared_gpu.DEFAULT_CONFIGS
    reports = [shared_gpu.ChildReport(i, status, n, "boom" if status != "ok" else "", shared_gpu.role_of(mode, i))
               for i, (status, n) in enumerate(zip(statuses, calls))]
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "gluon_kernels": gluon == "on"}
    return shared_gpu.run_entry(args, reports, env, "abc123")


def test_the_record_keeps_one_entry_per_setting(tmp_path):
    gluon = _run(6, "on", "train", ["failed", "stalled", "ok", "failed", "failed", "failed"], [3, 9, 40, 1, 2, 5])
    control = _run(6, "off", "train", ["ok"] * 6, [80] * 6)
    mixed = _run(6, "on", "mixed", ["ok"] * 6, [50, 90, 50, 90, 50, 90])
    for run in (gluon, control, mixed):
        shared_gpu.write_record(tmp_path, run)
    assert gluon["failures"] == 4 and gluon["stalls"] == 1 and not gluon["ok"]
    table = (tmp_path / "shared_gpu.md").read_text()
    assert "| 3, 9, 40, 1, 2, 5 | 4 | 1 | **failed or stalled** |" in table
    assert "process 1 (train) stalled after 9 calls: boom" in table
    fixed = _run(6, "on", "train", ["ok"] * 6, [70] * 6)  # the same setting again: replaces the first run
    shared_gpu.write_record(tmp_path, fixed)
    runs = json.loads((tmp_path / "shared_gpu.json").read_text())["runs"]
    assert [(r["gluon"], r["mode"], r["ok"]) for r in runs] == [("on", "train", True), ("off", "train", True),
                                                                 ("on", "mixed", True)]
    table = (tmp_path / "shared_gpu.md").read_text()
    assert table.count("| NVIDIA H200 |") == 3 and "| mixed (3 train, 3 infer) | on | Gluon | 6 | 60 |" in table
    assert "Failures and stalls" not in table  # the failing run was replaced


def test_watch_tells_failed_stalled_and_finished_children_apart(tmp_path):
    scripts = [
        "import sys; print('boom: the kernel failed'); sys.exit(3)",  # fails at once
        "import time; time.sleep(60)",  # never makes progress
        f"import pathlib; pathlib.Path({str(tmp_path / 'p2')!r}).write_text('7')",  # finishes after 7 calls
    ]
    progress = [tmp_path / f"p{i}" for i in range(3)]
    logs = [tmp_path / f"log{i}" for i in range(3)]
    procs = []
    for script, log in zip(scripts, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", script], stdout=f, stderr=subprocess.STDOUT))
    reports = shared_gpu.watch(procs, progress, logs, seconds=1, stall=2)
    assert [r.status for r in reports] == ["failed", "stalled", "ok"]
    assert "boom" in reports[0].detail and reports[2].calls == 7
    assert all(p.poll() is not None for p in procs)  # the stalled one was stopped
