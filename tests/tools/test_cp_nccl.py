"""benchmarks.cp_nccl on CPU: two processes over gloo under torchrun, through Triton's interpreter (its GPU run is the
same command with NCCL). The record's fields, correctness against one process, the bytes against the plan, the
dropout mask bit for bit; and the merge of runs on different GPU counts."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import cp_record
from tests.helpers import torchrun_on_cpu

ROW_FIELDS = ("config", "gpus", "impl", "speedup", "step_ms", "one_gpu_step_ms", "one_gpu_step_ms_ranks", "gpu",
              "step_b2b_ms", "one_gpu_step_b2b_ms", "speedup_b2b",
              "torch", "triton", "commit", "nccl", "out_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2", "repeatable",
              "correct", "bytes_sent", "bytes_received")
CP_FIELDS = ("model_speedup", "model_speedup_overlap", "compute_ms", "exchange_ms", "hidden_ms", "plan_bytes_sent",
             "plan_bytes_received", "bytes_match")


def test_two_processes_over_gloo_fill_the_record(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo run; GPUs run it under torchrun with NCCL")
    result = torchrun_on_cpu("benchmarks.cp_nccl", 2, ["--device", "cpu", "--out", str(tmp_path)],
                             MMSPARSE_COMMIT="test-commit")
    assert "NCCL_NVLS_ENABLE" in result.stdout and "mask mismatches 0" in result.stdout

    record = json.loads((tmp_path / "cp_nccl.json").read_text())
    rows = record["rows"]
    assert [(r["config"], r["gpus"], r["impl"]) for r in rows] == [("tiny_hub_causal", 2, "mmsparse_cp"),
                                                                     ("tiny_hub_causal", 2, "mmsparse_cp_keep"),
                                                                     ("tiny_hub_causal", 2, "mmsparse_cp_refetch"),
                                                                     ("tiny_hub_causal", 2, "mmsparse_cp_p2p"),
                                                                     ("tiny_hub_causal", 2, "all_gather")]
    for row in rows:
        missing = [f for f in ROW_FIELDS + (CP_FIELDS if row["impl"] == "mmsparse_cp" else ()) if f not in row]
        assert not missing, missing
        assert row["correct"] and row["repeatable"] and row["commit"] == "test-commit"
        assert max(row[f"{n}_rel_l2"] for n in ("out", "dq", "dk", "dv")) <= 1e-4
        assert row["speedup"] == pytest.approx(row["one_gpu_step_ms"] / row["step_ms"])
        assert row["speedup_b2b"] == pytest.approx(row["one_gpu_step_b2b_ms"] / row["step_b2b_ms"])
        assert row["nccl"]["NCCL_NVLS_ENABLE"] == "0"
    cp, kept, refetch = rows[0], rows[1], rows[2]
    assert cp["same_bits_as_p2p"] and rows[3]["bytes_match"]
    assert cp["bytes_match"] and min(cp["bytes_sent"]) > 0, "the ranks exchange exactly what the plan says"
    assert kept["bytes_match"] and sum(kept["bytes_received"]) < sum(refetch["bytes_received"]), (
        "keeping the fetched K/V saves the backward's fetch, as planned")
    assert cp["kept_fetched_kv"] and cp["bytes_received"] == kept["bytes_received"], (
        "a tiny config is far below KEEP_FETCHED_MAX_BYTES: the default keeps the fetched K/V")
    assert refetch["bytes_match"] and not refetch["kept_fetched_kv"]
    assert cp["hidden_ms"] == pytest.approx(cp["compute_ms"] + cp["exchange_ms"] - cp["step_ms"])
    links = record["links"]
    assert len(links) == 1 and links[0]["all_gather_busbw_gbs"] > 0 and links[0]["send_recv_gbs"] > 0
    (dropout,) = record["dropout"]
    assert dropout["ok"] and dropout["mask_mismatches"] == 0 and dropout["other_seed_mismatches"] > 0
    assert 0.8 < dropout["kept_fraction"] < 0.97
    table = (tmp_path / "cp_nccl.md").read_text()
    assert "| tiny_hub_causal | 2 | mmsparse_cp |" in table and "mask mismatches" in table


def _row(config: str, gpus: int, commit: str, impl: str = "mmsparse_cp") -> dict:
    return {"config": config, "gpus": gpus, "impl": impl, "commit": commit, "step_ms": float(gpus)}


def test_runs_on_different_gpu_counts_merge_into_one_record(tmp_path):
    first = {"rows": [_row("hub_causal_256k", 2, "a"), _row("hub_causal_256k", 2, "a", "all_gather"),
                      _row("long_1m", 2, "a")], "links": [{"gpus": 2, "commit": "a"}], "dropout": []}
    (tmp_path / "cp_nccl.json").write_text(json.dumps(cp_record.merge(tmp_path, first, "a")))
    second = {"rows": [_row("hub_causal_256k", 4, "a"), _row("long_1m", 2, "a")],
              "links": [{"gpus": 4, "commit": "a"}], "dropout": []}
    merged = cp_record.merge(tmp_path, second, "a")
    assert [(r["config"], r["gpus"], r["impl"]) for r in merged["rows"]] == [
        ("hub_causal_256k", 2, "mmsparse_cp"), ("hub_causal_256k", 2, "all_gather"),
        ("hub_causal_256k", 4, "mmsparse_cp"), ("long_1m", 2, "mmsparse_cp")]
    assert [r["gpus"] for r in merged["links"]] == [2, 4]
    other = cp_record.merge(tmp_path, second, "b")  # another commit: the old rows go
    assert [(r["config"], r["gpus"]) for r in other["rows"]] == [("hub_causal_256k", 4), ("long_1m", 2)]


def test_records_of_two_machines_merge_from_the_command_line(tmp_path):
    rows = [_row("hub_causal_256k", 2, "a"), _row("hub_causal_256k", 4, "a")]
    for name, row in zip(("two", "four"), rows):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cp_nccl.json").write_text(json.dumps({"rows": [{**row, "skipped": "test"}]}))
    assert cp_record.main([str(tmp_path / "two" / "cp_nccl.json"), str(tmp_path / "four" / "cp_nccl.json"),
                           "--out", str(tmp_path / "both")]) == 0
    merged = json.loads((tmp_path / "both" / "cp_nccl.json").read_text())
    assert [r["gpus"] for r in merged["rows"]] == [2, 4]
    assert "hub_causal_256k on 4 GPUs: test" in (tmp_path / "both" / "cp_nccl.md").read_text()
