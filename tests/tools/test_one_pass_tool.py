"""tools/one_pass.py on a CPU: the one-pass and the two-pass backward of a tiny config, checked and compared."""

from __future__ import annotations

import json
import math

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
    assert "| tiny_ab | ok / ok | True |" in capsys.readouterr().out
