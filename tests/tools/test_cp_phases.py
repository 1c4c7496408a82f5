"""benchmarks.cp_phases on CPU: two processes over gloo under torchrun (its GPU run is the same command with NCCL):
each phase's messages from the plan match ContextParallel's own byte counters, every way that can run here is timed,
and the one that cannot (copy engines, CUDA only) is recorded with its reason."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.cp_phases import PHASES, WAYS, message_bytes
from benchmarks.report import same_commit_rows
from tests.helpers import torchrun_on_cpu


def test_the_return_sends_back_what_the_fetch_brought():
    tokens = [[0, 5, 7], [3, 0, 0], [1, 2, 0]]  # rank a owns tokens[a][b] keys that rank b's queries see
    fetch = message_bytes(tokens, 10, "fetch")
    back = message_bytes(tokens, 4, "return")
    assert fetch == [[0, 50, 70], [30, 0, 0], [10, 20, 0]]
    assert back == [[0, 12, 4], [20, 0, 8], [28, 0, 0]]  # b returns to a the gradients of what a sent b


def test_two_processes_over_gloo_fill_the_record(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo run; GPUs run it under torchrun with NCCL")
    torchrun_on_cpu("benchmarks.cp_phases", 2, ["--device", "cpu", "--out", str(tmp_path)],
                    MMSPARSE_COMMIT="test-commit")
    record = json.loads((tmp_path / "cp_phases.json").read_text())
    assert record["commit"] == "test-commit" and record["nccl"]["NCCL_NVLS_ENABLE"] == "0"
    rows = record["rows"]
    assert [(r["config"], r["gpus"], r["phase"]) for r in rows] == [("tiny_cyclic", 2, p) for p in PHASES]
    for row in rows:
        assert row["bytes_match"], "the plan's messages are the bytes ContextParallel moved"
        sizes = row["sizes"]
        assert sizes[0][0] == sizes[1][1] == 0 and row["received_max_bytes"] == max(sizes[1][0], sizes[0][1]) > 0
        assert row["phase_ms"] > 0 and row["phase_p2p_ms"] > 0 and row["p2p_ms"] > 0 and row["all_gather_ms"] > 0
        assert row["copy_engine_ms"] is None and "needs CUDA" in row["copy_engine_problem"]
        assert row["fastest_way"] in WAYS and row["phase_share"] > 0
    fetch, back = rows
    # the gradients of what each rank fetched go back to their owner (float32 both ways here)
    assert back["sizes"] == [[0, fetch["sizes"][1][0]], [fetch["sizes"][0][1], 0]]
    table = (tmp_path / "cp_phases.md").read_text()
    assert "| tiny_cyclic | 2 | fetch |" in table and "not run: copy_engine" in table


def test_runs_on_two_gpu_counts_fill_one_record(tmp_path):
    path = tmp_path / "cp_phases.json"
    assert same_commit_rows(path, "a", []) == []
    rows = [{"config": c, "gpus": g, "phase": p} for c, g in (("x", 2), ("x", 4), ("y", 2)) for p in PHASES]
    path.write_text(json.dumps({"commit": "a", "rows": rows}))
    new = [{"config": "x", "gpus": 4, "phase": p} for p in PHASES]
    assert same_commit_rows(path, "a", new) == [r for r in rows if (r["config"], r["gpus"]) != ("x", 4)]
    assert same_commit_rows(path, "b", new) == [], "another commit's rows go"
