"""The host-time benchmark (benchmarks/host.py): a CPU smoke run through the interpreter writes every row the
record holds; GPU-only measures (cuDNN, CUDA graphs, compile, the profiler) are left empty there."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import host


@pytest.mark.interpreter  # the CPU run; on a GPU the tool runs its full-size shapes, torch.compile and CUDA graphs
def test_a_cpu_run_writes_the_record(tmp_path):
    assert host.main(["--device", "cpu", "--calls", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "host.json").read_text())
    assert {"gpu", "torch", "triton", "commit"} <= set(record)
    seed = record["seed"]
    assert set(seed) == {"host_us_fwd", "host_us_fwd_bwd", "host_us_fwd_bwd_one_thread", "host_us_fwd_bwd_nondet",
                         "host_us_fwd_bwd_new_lengths", "host_us_bwd",
                         "host_us_autograd_floor", "gpu_kernel_ms", "fwd_bwd_ms", "cudnn_dense_fwd_bwd_ms",
                         "cudnn_gpu_kernel_ms", "graph_fwd_bwd_ms", "host_us_fwd_op", "host_us_bwd_op",
                         "layers_new_lengths_ms", "layers_prepared_ms"}
    timed = ("host_us_fwd", "host_us_fwd_bwd", "host_us_fwd_bwd_one_thread", "host_us_fwd_bwd_nondet",
             "host_us_fwd_bwd_new_lengths", "host_us_bwd", "host_us_autograd_floor", "fwd_bwd_ms", "host_us_fwd_op",
             "host_us_bwd_op", "layers_new_lengths_ms", "layers_prepared_ms")
    assert all(seed[k] > 0 for k in timed)
    assert set(record["small_2k"]) == {"fwd_bwd_ms", "cudnn_dense_fwd_bwd_ms"}
    assert set(record["block"]) == {"eager_ms", "compile_ms", "reduce_overhead_ms", "sdpa_eager_ms",
                                    "sdpa_compile_ms"} and record["block"]["eager_ms"] > 0
    assert "| seed | host_us_fwd |" in (tmp_path / "host.md").read_text()
    assert torch.autograd.is_multithreading_enabled()  # the one-thread row leaves autograd's setting as it was
