"""The benchmark's timing rounds: every implementation is timed in each round and its row keeps the best one."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(_BENCH))  # bench_attention imports its sibling configs.py
    try:
        spec = importlib.util.spec_from_file_location("bench_attention", _BENCH / "bench_attention.py")
        module = sys.modules["bench_attention"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(_BENCH))
        sys.modules.pop("bench_attention", None)


def _case_and_timing(bench, rounds):
    cfg = bench.TINY["tiny_cyclic"]
    case = bench.Case.make(cfg, torch.device("cpu"), torch.float32)
    return case, bench.Timing(torch.device("cpu"), warmup=0, rep=0, cpu_warmup=1, cpu_reps=1, rounds=rounds)


def test_rows_keep_the_best_round(bench):
    case, timing = _case_and_timing(bench, rounds=3)
    impl = bench.Impl(fn=lambda q, k, v: q * 2 + v.sum() * 0)
    row = bench.base_row(case.cfg, "fake", {}, timing)
    for _ in range(timing.rounds):
        bench.time_round(case, impl, timing, row)
    bench.finish_row(case, impl, row)
    assert len(row["fwd_ms_rounds"]) == len(row["fwdbwd_ms_rounds"]) == 3
    assert row["fwd_ms"] == min(row["fwd_ms_rounds"]) and row["fwdbwd_ms"] == min(row["fwdbwd_ms_rounds"])
    assert row["bwd_ms"] == pytest.approx(row["fwdbwd_ms"] - row["fwd_ms"])
    assert row["fwd_tflops"] > 0 and row["error"] is None
    assert case.q.grad is None  # each round leaves no gradients behind
    assert "best of 3 interleaved rounds" in timing.method


def test_a_failing_stage_is_recorded_once_and_not_retried(bench):
    case, timing = _case_and_timing(bench, rounds=2)
    calls = []

    def no_backward(q, k, v):
        calls.append(1)
        return (q * 2).detach()  # backward() then raises

    row = bench.base_row(case.cfg, "fake", {}, timing)
    impl = bench.Impl(fn=no_backward)
    for _ in range(timing.rounds):
        bench.time_round(case, impl, timing, row)
    bench.finish_row(case, impl, row)
    assert len(row["fwd_ms_rounds"]) == 2 and row["fwd_ms"] is not None
    assert row["fwdbwd_ms_rounds"] is None and row["fwdbwd_ms"] is None and row["bwd_ms"] is None
    assert row["error"].count("fwdbwd:") == 1


@pytest.mark.parametrize("rounds", ["0", "-2"])
def test_rounds_below_one_are_refused(bench, rounds, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", rounds])
    assert "--rounds: must be at least 1" in capsys.readouterr().err
    assert bench.parse_args(["--rounds", "2"]).rounds == 2

