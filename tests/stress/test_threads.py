"""The thread stress tool (tests/stress/threads.py): a smoke run on the session's device (through the interpreter on
a CPU) writes its record with no wrong call, and a perturbed output is counted as wrong (exit 1)."""

from __future__ import annotations

import json

import pytest

from tests.stress import threads

pytestmark = pytest.mark.stress  # the stress tools' smoke tests: pytest -m stress


def test_a_smoke_run_writes_the_record(tmp_path, device):
    assert threads.main(["--threads", "3", "--calls", "2", "--device", device.type, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "threads.json").read_text())
    (entry,) = record["entries"]
    assert (entry["threads"], entry["calls"], entry["wrong"], entry["errors"]) == (3, 6, 0, 0)
    assert entry["calls_per_thread"] == [2, 2, 2] and entry["commit"]
    assert f"| {device.type}-3x2calls | 3 |" in (tmp_path / "threads.md").read_text()


def test_a_wrong_output_is_counted(tmp_path, monkeypatch, device):
    original = threads.mbs_attention

    def off_by_a_little(*args, **kwargs):
        return original(*args, **kwargs) + 0.05

    monkeypatch.setattr(threads, "mbs_attention", off_by_a_little)
    monkeypatch.setattr(threads.random.Random, "choice", lambda self, seq: seq[0])  # the functional API each call
    assert threads.main(["--threads", "2", "--calls", "1", "--device", device.type, "--out", str(tmp_path)]) == 1
    (entry,) = json.loads((tmp_path / "threads.json").read_text())["entries"]
    assert entry["wrong"] == 2 and entry["errors"] == 0
    assert "out" in entry["messages"][0]


def test_entries_of_other_settings_are_kept():
    a = {"key": "cuda-8x300s", "calls": 1}
    b = {"key": "cuda-16x60s", "calls": 2}
    record = threads.merge_record(threads.merge_record(None, a), b)
    record = threads.merge_record(record, {**a, "calls": 3})
    assert [(e["key"], e["calls"]) for e in record["entries"]] == [("cuda-8x300s", 3), ("cuda-16x60s", 2)]
