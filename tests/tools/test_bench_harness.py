"""The benchmark harness: timing rounds, the one Flex mask_mod, and where records go."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import mmsparse
from benchmarks.cases import Case
from benchmarks.configs import CYCLIC, HUB, TINY
from benchmarks.env import gpu_slug
from benchmarks.flex_mask import flex_mask_mod, segment_ids
from benchmarks.impl import Impl
from benchmarks.report import write_record
from benchmarks.run import parse_args
from benchmarks.runner import base_row, finish_row, time_round
from benchmarks.timing import Timing


def _case_and_timing(rounds):
    case = Case.make(TINY["tiny_cyclic"], torch.device("cpu"), torch.float32)
    return case, Timing(torch.device("cpu"), warmup=0, rep=0, cpu_warmup=1, cpu_reps=1, rounds=rounds)


def test_rows_keep_the_best_round():
    case, timing = _case_and_timing(rounds=3)
    impl = Impl(fn=lambda q, k, v: q * 2 + v.sum() * 0)
    row = base_row(case.cfg, "fake", {}, timing)
    for _ in range(timing.rounds):
        time_round(case, impl, timing, row)
    finish_row(case, impl, row)
    assert len(row["fwd_ms_rounds"]) == len(row["fwdbwd_ms_rounds"]) == 3
    assert row["fwd_ms"] == min(row["fwd_ms_rounds"]) and row["fwdbwd_ms"] == min(row["fwdbwd_ms_rounds"])
    assert row["bwd_ms"] == pytest.approx(row["fwdbwd_ms"] - row["fwd_ms"])
    assert row["fwd_tflops"] is None and row["error"] is None  # no TF/s through the CPU interpreter
    assert case.q.grad is None  # each round leaves no gradients behind
    assert "best of 3 interleaved rounds" in timing.method


def test_a_failing_stage_is_recorded_once_and_not_retried():
    case, timing = _case_and_timing(rounds=2)
    calls = []

    def no_backward(q, k, v):
        calls.append(1)
        return (q * 2).detach()  # backward() then raises

    row = base_row(case.cfg, "fake", {}, timing)
    impl = Impl(fn=no_backward)
    for _ in range(timing.rounds):
        time_round(case, impl, timing, row)
    finish_row(case, impl, row)
    assert len(row["fwd_ms_rounds"]) == 2 and row["fwd_ms"] is not None
    assert row["fwdbwd_ms_rounds"] is None and row["fwdbwd_ms"] is None and row["bwd_ms"] is None
    assert row["error"].count("fwdbwd:") == 1


@pytest.mark.parametrize("rounds", ["0", "-2"])
def test_rounds_below_one_are_refused(rounds, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rounds", rounds])
    assert "--rounds: must be at least 1" in capsys.readouterr().err
    assert parse_args(["--rounds", "2"]).rounds == 2


@pytest.mark.parametrize("tool", ["fwd_turns", "one_pass"])
def test_unknown_configs_are_a_usage_error(tool, capsys):
    """The tools' --configs (benchmarks.arguments.config_names): empty names skipped, the unknown ones listed."""
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"tools.{tool}").main(["--configs", "tiny_ab,nope,,tiny"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"tools.{tool}: error: unknown config nope, tiny; known: " in err and "tiny_ab" in err, err


@pytest.mark.parametrize(
    "topology, lens, seq_q, causal",
    [(CYCLIC, (10, 45, 41), None, False), (HUB, (13, 50, 37), None, True), (HUB, (40, 30, 11), 4, True)],
    ids=["cyclic", "hub-causal", "decode-causal"],
)
def test_flex_mask_mod_is_the_reference_mask(topology, lens, seq_q, causal):
    from torch.nn.attention.flex_attention import create_mask

    seq_k = sum(lens)
    seq_q = seq_q or seq_k
    seg, real = segment_ids(lens, seq_k, torch.device("cpu"))
    mask_mod = flex_mask_mod(topology, seg, causal, past=seq_k - seq_q, real=real)
    got = create_mask(mask_mod, 1, 1, seq_q, seq_k, device="cpu")[0, 0]
    assert torch.equal(got, mmsparse.reference_mask(topology, lens, seq_k, seq_q, causal)[0])


def test_flex_mask_mod_with_per_sample_padding():
    from torch.nn.attention.flex_attention import create_mask

    lens = torch.tensor([[10, 30, 20], [5, 0, 40], [0, 0, 0]])
    seg, real = segment_ids(lens, 64, torch.device("cpu"))
    got = create_mask(flex_mask_mod(HUB, seg, True, real=real), 3, 1, 64, 64, device="cpu")[:, 0]
    assert torch.equal(got, mmsparse.reference_mask(HUB, lens, 64, 64, True))


def test_records_go_to_one_folder_per_gpu(tmp_path):
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_slug("cpu (x86_64, Triton interpreter)") == "cpu"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    path = write_record(tmp_path / "h100", "build", [{"ms": float("nan")}], "| table |\n")
    assert json.loads(path.read_text()) == [{"ms": None}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["build.json", "build.md"]


def test_the_benchmark_checks_times_and_writes_its_record(tmp_path, device):
    """``python -m benchmarks`` end to end on a tiny config: every row checked ok, timed, written as latest.*."""
    from benchmarks.run import main

    threads = torch.get_num_threads()
    try:
        status = main(["--device", device.type, "--configs", "tiny_ab", "--impls", "mmsparse,sdpa_mask", "--no-plot",
                       "--out", str(tmp_path), "--warmup", "0", "--rep", "0", "--cpu-warmup", "1", "--cpu-reps", "1",
                       "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    rows = json.loads((tmp_path / "latest.json").read_text())
    assert [(r["impl"], r["check"]) for r in rows] == [("mmsparse", "ok"), ("sdpa_mask", "ok")]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] is not None for r in rows)
    assert "| tiny_ab |" in (tmp_path / "latest.md").read_text()
