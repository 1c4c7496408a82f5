"""benchmarks/bench_build.py on a CPU (the interpreter): the tiny cases run, their lists match the torch reference,
and without ``--out`` the record goes to a temporary folder, never into benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_build, env


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The results folder and the temporary folders of this test, both under tmp_path."""
    results = tmp_path / "results"
    monkeypatch.setattr(env, "RESULTS_DIR", results)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return results, tmp_path / "tmp"


def test_a_cpu_run_without_out_writes_no_record_into_the_repository(scratch, capsys):
    results, tmp = scratch
    bench_build.main(["--device", "cpu", "--no-flex"])
    assert not results.exists(), sorted(results.rglob("*"))
    (record,) = tmp.glob("*/build.json")
    rows = json.loads(record.read_text())
    assert [r["case"] for r in rows] == [c.name for c in bench_build.CPU_CASES]
    assert all(r["lists_exact"] for r in rows)
    assert f"wrote {record}" in capsys.readouterr().out


def test_out_is_where_the_record_goes(tmp_path):
    bench_build.main(["--device", "cpu", "--no-flex", "--out", str(tmp_path)])
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["build.json", "build.md"]
