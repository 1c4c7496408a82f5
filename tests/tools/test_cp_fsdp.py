"""benchmarks.cp_fsdp on CPU: four processes over gloo under torchrun (dp 2 x cp 2, FSDP2 over dp, ContextParallel
over cp), a tiny model for two steps: the loss curve follows the single-process one and a second run repeats it
bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import torchrun_on_cpu


def test_cp_times_dp_training_matches_one_process_and_repeats(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo run; GPUs run it under torchrun with NCCL")
    torchrun_on_cpu("benchmarks.cp_fsdp", 4, ["--device", "cpu", "--tiny", "--steps", "2", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "cp_fsdp.json").read_text())
    assert (row["gpus"], row["dp"], row["cp"], row["steps"]) == (4, 2, 2, 2)
    assert len(row["losses_single"]) == len(row["losses_cp_dp"]) == len(row["losses_cp_dp_again"]) == 2
    assert row["repeatable_losses"] and row["repeatable_weights"]
    assert row["losses_cp_dp"] == row["losses_cp_dp_again"]
    assert row["max_rel_diff"] < 1e-5, (row["losses_single"], row["losses_cp_dp"])
    assert row["losses_cp_dp"][1] < row["losses_cp_dp"][0], "a step of training lowers the loss"
    assert {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "4",
            "NCCL_MAX_NCHANNELS": "4"}.items() <= row["nccl"].items()
    assert "| max abs difference, one GPU vs CP x DP |" in (tmp_path / "cp_fsdp.md").read_text()
