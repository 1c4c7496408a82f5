"""A CPU run of ``python -m benchmarks`` (Triton's interpreter): what cannot run there is left out of the default
list with one line that says so, and no TF/s are printed or recorded."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.baselines import DEFAULT_IMPLS, NOT_ON_CPU
from benchmarks.report import markdown, progress_line
from benchmarks.run import left_out_on_cpu, parse_args, select


def test_the_default_list_on_a_cpu_leaves_out_flex():
    args = parse_args(["--device", "cpu", "--tiny"])
    assert left_out_on_cpu(args) == ["flex", "flex_flash"] == list(NOT_ON_CPU)
    assert select(args)[1] == [n for n in DEFAULT_IMPLS if n not in NOT_ON_CPU]
    assert select(parse_args([]))[1] == list(DEFAULT_IMPLS)  # a GPU run keeps them
    named = parse_args(["--device", "cpu", "--impls", "mmsparse,flex"])  # asked for by name: run anyway
    assert left_out_on_cpu(named) == [] and select(named)[1] == ["mmsparse", "flex"]


def test_no_tflops_columns_for_cpu_rows():
    row = {"config": "c", "impl": "mmsparse", "fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_tflops": None, "bwd_tflops": None,
           "peak_mib": None, "build_ms": 1.0, "check": "ok", "seq_len": 96, "density": 0.3}
    cpu = [{**row, "gpu": "cpu (x86_64, Triton interpreter)"}]
    gpu = [{**row, "gpu": "NVIDIA H200", "fwd_tflops": 500.0, "bwd_tflops": 400.0}]
    assert "TF/s |" not in markdown(cpu, "t") and "TF/s" not in progress_line(1, 1, cpu[0])
    assert "| fwd TF/s | bwd TF/s |" in markdown(gpu, "t") and "500 TF/s" in progress_line(1, 1, gpu[0])


@pytest.mark.interpreter  # the CPU run itself; a GPU's is the benchmark tests' (test_bench_masks, test_bench_harness)
def test_a_cpu_run_has_no_error_rows_and_says_what_it_left_out(tmp_path, capsys):
    from benchmarks.run import main

    threads = torch.get_num_threads()
    try:
        status = main(["--device", "cpu", "--configs", "tiny_ab", "--no-plot", "--out", str(tmp_path), "--warmup",
                       "0", "--rep", "0", "--cpu-warmup", "1", "--cpu-reps", "1", "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    out = capsys.readouterr().out
    assert out.count("not run on a CPU: flex (FlexAttention has no backward on a CPU); flex_flash") == 1
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert len(progress) == 3 and not any("TF/s" in line for line in progress)
    rows = json.loads((tmp_path / "latest.json").read_text())
    assert [r["impl"] for r in rows] == ["mmsparse", "sdpa_mask", "dense_flash"]
    assert all(r["error"] is None and r["check"] == "ok" and r["fwd_tflops"] is None for r in rows)
    table = (tmp_path / "latest.md").read_text()
    assert "TF/s |" not in table and "Errors and skips" not in table
