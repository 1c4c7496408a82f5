"""tools/one_pass.py on a CPU: the one-pass backward against the two-pass one on a tiny config, checked and
compared."""

from __future__ import annotations

import json
import math

import pytest

from tools import one_pass


def test_one_pass_tool_checks_and_compares(tmp_path, capsys):
    out = tmp_path / "one_pass.json"
    assert one_pass.main(["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["sides"] == ["two-pass", "one-pass"]
    row = record["rows"][0]
    assert row["config"] == "tiny_ab"
    for side in record["sides"]:
        assert row[f"{side}_check"] == "ok", side
        # CPU times mean nothing, and the backward's is a difference of two of them (it can come out <= 0 on a
        # busy machine): only that every side was timed.
        assert row[f"{side}_fwd_ms"] > 0 and math.isfinite(row[f"{side}_bwd_ms"]), side
    assert row["one-pass_out_equal"]
    assert max(row[f"one-pass_{g}_rel_diff"] for g in ("dq", "dk", "dv")) < 1e-5
    assert "| tiny_ab | ok / ok | True, " in capsys.readouterr().out


def test_one_pass_tool_sides(tmp_path):
    out = tmp_path / "one_pass.json"
    args = ["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--out", str(out)]
    assert one_pass.main([*args, "--sides", "one-pass,two-pass"]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert "one-pass-atomic_check" not in row and row["two-pass_check"] == "ok"
    assert "two-pass_bwd_speedup" in row and "one-pass_bwd_speedup" not in row  # the first side is the baseline
    with pytest.raises(SystemExit):
        one_pass.main([*args, "--sides", "two-pass,ordered-one-pass"])  # a side that is gone


def test_one_pass_tool_times_both_ways_of_adding_dq(tmp_path):
    """The atomic side (register atomics on Hopper) is timed in the same rounds as the default one (TMA bulk
    reduce-adds there); off Hopper both run the tl one pass, and the record says which tile each ran."""
    out = tmp_path / "one_pass.json"
    argv = ["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--sides", "two-pass,one-pass,one-pass-atomic",
            "--out", str(out)]
    assert one_pass.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    for side in ("one-pass", "one-pass-atomic"):
        assert row[f"{side}_check"] == "ok" and row[f"{side}_out_equal"] and row[f"{side}_dq_rel_diff"] < 1e-5
        assert math.isfinite(row[f"{side}_bwd_ms"]) and row[f"{side}_tile"] == "16x32 tl"
