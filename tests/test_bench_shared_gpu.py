"""benchmarks.shared_gpu: several processes running mmsparse at once, and the watchdog that reports them."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import shared_gpu


def test_children_run_to_the_end_through_the_interpreter(capsys):
    assert shared_gpu.main(["--procs", "2", "--seconds", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "process 0: ok" in out and "process 1: ok" in out and "all ran to the end" in out


def test_a_config_that_cannot_run_fails_before_the_children_start(capsys):
    assert shared_gpu.main(["--procs", "2", "--seconds", "1", "--device", "cpu", "--configs", "no_such"]) == 1
    assert "warm-up: failed" in capsys.readouterr().out


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
