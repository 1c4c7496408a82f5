"""python -m benchmarks.hf_vlm --tiny: the VLM training-step benchmark runs (on CUDA when there is one, else on a CPU)
and writes its record."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_tiny_run_writes_the_record(tmp_path, device):
    from benchmarks import hf_vlm

    assert hf_vlm.main(["--tiny", "--impls", "mmsparse,sdpa", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "hf_vlm.json").read_text())
    assert {"gpu", "torch", "triton", "transformers", "commit"} <= set(record["env"])
    rows = record["rows"]
    assert [r["impl"] for r in rows] == ["mmsparse", "sdpa"] * len(hf_vlm.TINY_CASES)
    config = hf_vlm.model_config(tiny=True)
    layers = config.text_config.num_hidden_layers + config.vision_config.num_hidden_layers  # both attend
    for r in rows:
        assert not r.get("skipped"), r
        assert r["step_ms"] > 0 and abs(r["loss_vs_sdpa"]) < 1e-3, r
        # the profiled step: each layer's attention call (the vision tower's too) and its backward node found, the
        # masks built; no kernel on a CPU, and on a GPU the attention's kernels a part of the step's
        b = r["breakdown"]
        assert (b["attention_calls"], b["attention_backwards"]) == (layers, layers), b
        assert b["mask_calls"] >= 1 and b["backward_separated"], b
        if device.type == "cuda":  # the benchmark's device: CUDA when there is one
            assert 0 < b["attention_gpu_ms"] <= b["gpu_ms"], b
        else:
            assert b["gpu_ms"] == b["attention_gpu_ms"] == 0, b
    table = (tmp_path / "hf_vlm.md").read_text()
    assert "| mmsparse |" in table and "| sdpa |" in table and "attention fwd / bwd ms" in table


def test_a_cpu_run_without_out_writes_no_record_into_the_repository(tmp_path, monkeypatch):
    """A smoke run's record (no CUDA) goes to a temporary folder, not benchmarks/results/cpu/."""
    import torch

    from benchmarks import env, hf_vlm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(env, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert hf_vlm.main(["--tiny", "--impls", "mmsparse"]) == 0
    assert not (tmp_path / "results").exists(), sorted((tmp_path / "results").rglob("*"))
    (record,) = (tmp_path / "tmp").glob("*/hf_vlm.json")
    assert [r["impl"] for r in json.loads(record.read_text())["rows"]] == ["mmsparse"] * len(hf_vlm.TINY_CASES)
