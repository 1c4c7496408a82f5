"""tools/one_pass.py on a CPU: the one-pass and the two-pass backward of a tiny config, checked and compared."""

from __future__ import annotations

import json
import math

import pytest

from tools import one_pass


def test_one_pass_tool_checks_and_compares(tmp_path, capsys):
    out = tmp_path / "one_pass.json"
    assert one_pass.main(["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["config"] == "tiny_ab"
    assert row["two-pass_check"] == "ok" and row["one-pass_check"] == "ok" and row["out_equal"]
    assert row["dq_rel_diff"] < 1e-5 and row["dk_rel_diff"] < 1e-5 and row["dv_rel_diff"] < 1e-5
    # CPU times mean nothing, and the backward's is a difference of two of them (it can come out <= 0 on a busy
    # machine): only that both sides were timed.
    assert row["two-pass_fwd_ms"] > 0 and row["one-pass_fwd_ms"] > 0
    assert math.isfinite(row["two-pass_bwd_ms"]) and math.isfinite(row["one-pass_bwd_ms"])
    assert "| tiny_ab | one-pass (16x32 tl) | ok / ok | True |" in capsys.readouterr().out


def test_one_pass_tool_times_both_ways_of_adding_dq(tmp_path, capsys):
    """--dq-adds atomic,bulk: a side each, timed in the same rounds; off Hopper both run the tl one pass."""
    out = tmp_path / "one_pass.json"
    argv = ["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--dq-adds", "atomic,bulk", "--out", str(out)]
    assert one_pass.main(argv) == 0
    record = json.loads(out.read_text())
    row = record["rows"][0]
    assert record["dq_adds"] == ["atomic", "bulk"]
    for side in ("one-pass", "one-pass-bulk"):
        assert row[f"{side}_check"] == "ok" and row[f"{side}_out_equal"] and row[f"{side}_dq_rel_diff"] < 1e-5
        assert math.isfinite(row[f"{side}_bwd_ms"]) and row[f"{side}_tile"] == "16x32 tl"
    assert math.isfinite(row["bulk_vs_atomic"]) and row["bwd_speedup"] == row["one-pass_speedup"]
    printed = capsys.readouterr().out
    assert "| tiny_ab | one-pass-bulk (16x32 tl) | ok / ok | True |" in printed and "bulk vs atomic" in printed


def test_one_pass_tool_refuses_unknown_dq_adds(capsys):
    with pytest.raises(SystemExit):
        one_pass.main(["--configs", "tiny_ab", "--dq-adds", "atomic,tma"])
    assert "--dq-adds" in capsys.readouterr().err
