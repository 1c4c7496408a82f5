"""tools.cp_stream_waits: refuses to run without two GPUs under torchrun (a clear message, no traceback from deep
inside), and its table names a check that did not finish as hung."""

from __future__ import annotations

import pytest

from tools import cp_stream_waits


def test_needs_two_gpus_under_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="two CUDA GPUs"):
        cp_stream_waits.main([])


def test_table_marks_the_check_that_hung():
    record = {"gpu": "GPU", "torch": "t", "triton": "tr", "commit": "c", "max_connections": "unset",
              "checks": {"plain": {"us_per_round": 9.4, "seen": 200, "expected": 200}}}
    table = cp_stream_waits.markdown(record)
    assert '| plain | {"us_per_round": 9.4, "seen": 200, "expected": 200} |' in table
    assert "| beside_kernels | \"hung (past the deadline)\" |" in table
    assert "CUDA_DEVICE_MAX_CONNECTIONS=unset" in table
