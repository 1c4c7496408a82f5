"""The fuzzer's CPU mode, so that it cannot rot: a few random cases through the interpreter, and one repro."""

from __future__ import annotations

import pytest
import torch

from benchmarks import fuzz


def test_random_cases_pass(device):
    if device.type != "cpu":
        pytest.skip("the GPU runs python -m benchmarks.fuzz --minutes N")
    result = fuzz.fuzz(seed=7, device=device, minutes=None, cases=10)
    assert result["cases"] == 10
    assert result["failures"] == [], result["failures"]


def test_a_wrong_mask_is_caught(device, monkeypatch):
    """The check can fail: with the reference's causal flag flipped, a causal case must report errors."""
    import dataclasses

    seed = next(s for s in range(1000) if fuzz.draw_case(s, device).causal and fuzz.draw_case(s, device).seq_k > 8)
    case = fuzz.draw_case(seed, device)
    original = fuzz._allowed_rows
    # A wrong reference mask (causal dropped) is the only way to a case the fuzzer must fail.
    monkeypatch.setattr(fuzz, "_allowed_rows", lambda c, d: original(dataclasses.replace(c, causal=False), d))
    assert fuzz.run_case(case, device)


def test_repro_runs_one_case(capsys):
    assert fuzz.main(["--repro", "12345", "--device", "cuda" if torch.cuda.is_available() else "cpu"]) == 0
    assert "ok" in capsys.readouterr().out
