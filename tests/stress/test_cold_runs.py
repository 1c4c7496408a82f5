"""tests.stress.cold_runs: fresh child processes through the interpreter (on a CPU: the GPU configs take minutes a
run), the record merged across invocations, and wrong or crashed runs counted as wrong."""

from __future__ import annotations

import json

import pytest

import mmsparse
from tests.stress import cold_runs

pytestmark = pytest.mark.stress  # the stress tools' smoke tests: pytest -m stress


def test_lengths_are_new_each_run_and_stay_close():
    cfg = cold_runs.GPU_CONFIGS[0]
    a, b = cold_runs.jittered(cfg.seg_lens, 1), cold_runs.jittered(cfg.seg_lens, 2)
    assert a != b
    for row, base in zip(a, cfg.seg_lens):
        assert all(abs(n - m) <= max(1, m // 10) for n, m in zip(row, base))


def test_every_gpu_config_passes_the_side_stream_threshold():
    from mmsparse.attention.config import SHORT_KEYS

    for cfg in cold_runs.GPU_CONFIGS:
        case = cold_runs.make_case(cfg, 0)
        assert case.seq_k > SHORT_KEYS, cfg.name
    names = [c.name for c in cold_runs.GPU_CONFIGS]
    assert len(set(names)) == len(names)


@pytest.mark.interpreter  # the children run the tiny CPU configs through the interpreter
def test_runs_and_record_merge(tmp_path, capsys):
    assert cold_runs.main(["--runs", "2", "--parallel", "2", "--out", str(tmp_path), "--device", "cpu"]) == 0
    assert cold_runs.main(["--runs", "1", "--out", str(tmp_path), "--device", "cpu"]) == 0
    record = json.loads((tmp_path / "cold_runs.json").read_text())
    assert record["runs"] == 3 and record["wrong"] == 0 and record["next_seed"] == 3
    assert {"gpu", "torch", "triton", "commit", "configs"} <= record.keys()
    assert sum(row["runs"] for row in record["configs"].values()) == 3
    assert "3 runs, 0 wrong" in (tmp_path / "cold_runs.md").read_text()


def test_a_wrong_result_is_reported(monkeypatch, capsys, device):
    # one run of the tiny config in this process, on the session's device (a GPU's own configs take minutes a run)
    monkeypatch.setattr(cold_runs, "configs_for", lambda _device: cold_runs.CPU_CONFIGS)
    real = mmsparse.mbs_attention
    monkeypatch.setattr(mmsparse, "mbs_attention", lambda *a, **kw: real(*a, **kw) * 1.05)
    assert cold_runs.child("codes5_tiny", 0, device.type) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["problems"] and report["problems"][0].startswith("out")


def test_a_crashed_child_is_wrong():
    cfg = cold_runs.ColdConfig("no_such_config", cold_runs.CYCLIC, ((4, 4, 4),), (16, 1, 1, 1))
    result = cold_runs.run_child(cfg, 0, "cpu", timeout=120)()
    assert result.wrong and "KeyError" in result.detail
