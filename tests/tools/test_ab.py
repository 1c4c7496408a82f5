"""The A/B tool (tools/ab.py): its verdict, and one real run against HEAD on a tiny config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tools.ab_stats import config_row, paired_ratio, verdict


def _row(name: str, base_fwd: list[float], new_fwd: list[float], equal: bool = True) -> dict:
    both = lambda fwd: {"fwd_ms": fwd, "fwdbwd_ms": [3 * t for t in fwd]}  # bwd = 2x fwd on both sides
    digests = {"base": {"out": "a", "dq": "b"}, "new": {"out": "a", "dq": "b" if equal else "c"}}
    return config_row(name, both(base_fwd), both(new_fwd), digests, [])


def test_ratio_is_the_median_of_paired_rounds():
    assert paired_ratio([1.0, 2.0, 1.0], [1.0, 1.0, 2.0]) == 1.0  # round ratios 1, 2, 0.5
    assert paired_ratio([], []) is None


def test_verdict_applies_the_bar():
    same = [_row("a", [1.0] * 3, [1.0] * 3), _row("b", [2.0] * 3, [2.0] * 3)]
    assert verdict(same)["pass"]
    slower = [_row("a", [1.0] * 3, [1.0] * 3), _row("b", [1.0] * 3, [1.06] * 3)]  # 0.943 < 0.95
    v = verdict(slower)
    assert not v["speed_ok"] and v["min_at"] in ("b fwd", "b bwd")
    assert not verdict([_row("a", [1.0], [1.0], equal=False)])["pass"]
    assert verdict([_row("a", [1.0], [1.0], equal=False)])["speed_ok"]
    seed = verdict([_row("seed", [0.085] * 3, [0.0851] * 3)])  # 0.1 us slower, ratio 0.999
    assert seed["seed_ok"] and seed["pass"]
    assert not verdict([_row("seed", [0.085] * 3, [0.0905] * 3)])["seed_ok"]  # +5.5 us


def _git_ok() -> bool:
    """This tree is the top of a git checkout with a commit. The tool exports the base with ``git archive HEAD`` run
    here, which refuses a copy of the tree in an untracked folder of another checkout ("current working directory
    is untracked"), where ``git rev-parse HEAD`` alone still answers."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return Path(top).resolve() == REPO.resolve()


@pytest.mark.skipif(not _git_ok(), reason="needs a git checkout of this tree (the base is exported from HEAD)")
def test_ab_runs_against_head(tmp_path):
    """Two workers per side start, time a tiny config in two rounds (one on each worker) and compare outputs of
    all four; on CPU the times mean nothing."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "-m", "tools.ab", "--base", "HEAD", "--configs", "tiny_ab", "--rounds", "2",
           "--workers", "2", "--warmup", "0", "--rep", "0", "--cpu-reps", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert out.exists(), proc.stderr[-3000:]  # status 1 is also a crash or a refusal before the record
    record = json.loads(out.read_text())
    (row,) = record["configs"]
    assert row["config"] == "tiny_ab" and row["rounds"] == 2 and row["errors"] == [] and record["workers"] == 2
    assert row["fwd_ratio"] > 0 and row["bwd_ratio"] is not None
    assert record["base"]["mmsparse"] != record["new"]["mmsparse"]  # two trees, two processes
    assert Path(record["new"]["mmsparse"]) == REPO / "mmsparse"
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "mmsparse"], cwd=REPO).returncode == 0
    if unchanged:  # the same kernels on the same seeded inputs
        assert row["bit_equal"] is True
    assert "verdict" in out.with_suffix(".md").read_text()


@pytest.mark.interpreter  # a CPU side in this process; a GPU's sides are the tool's own runs
def test_nondet_side_digests_all_but_dq(monkeypatch):
    """--nondet: each side's worker calls deterministic=False and digests out, dK and dV, not dQ (the one pass adds
    it in any order, so its bits may differ between two runs of one tree)."""
    import torch

    import mmsparse
    from tools.ab import parse_args
    from tools.ab_worker import Side

    assert parse_args(["--base", "HEAD", "--nondet"]).nondet and not parse_args(["--base", "HEAD"]).nondet
    calls = []
    real = mmsparse.mbs_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mmsparse, "mbs_attention", spy)
    threads = torch.get_num_threads()  # a CPU side takes one thread
    try:
        side = Side(mmsparse, "cpu", 0, 0, 1, deterministic=False)
        assert set(side.prepare("tiny_ab")["digests"]) == {"out", "dk", "dv"}
    finally:
        torch.set_num_threads(threads)
    assert calls == [False]


def test_head_dim_reaches_every_config_of_a_side():
    """``--head-dim`` runs every config at that head dim on both sides (the worker script is this checkout's)."""
    import torch

    import mmsparse
    from tools.ab import parse_args
    from tools.ab_worker import Side

    assert parse_args(["--base", "HEAD", "--head-dim", "64"]).head_dim == 64
    threads = torch.get_num_threads()  # a CPU side runs single-threaded
    try:
        assert {cfg.head_dim for cfg in Side(mmsparse, "cpu", 0, 0, 1, head_dim=64).configs.values()} == {64}
        assert Side(mmsparse, "cpu", 0, 0, 1).configs["mm13k_hub"].head_dim == 128
    finally:
        torch.set_num_threads(threads)
