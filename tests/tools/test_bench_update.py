"""``python -m benchmarks --update``: one record measured in parts, each part's configs replacing their rows, and
only parts of one commit, GPU and versions in it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks.record_merge import merged, rows_kept

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "commit": "0123456789ab"}


def _row(config: str, impl: str, **env: str) -> dict:
    return {**ENV, **env, "config": config, "impl": impl}


def test_a_part_replaces_its_configs_and_keeps_the_others_in_the_configs_order(tmp_path):
    record = tmp_path / "latest.json"
    assert rows_kept(record, ENV, {"seed"}) == []  # no record yet: the first part starts one
    old = [_row("video_64k", "mmsparse"), _row("seed", "mmsparse"), _row("seed", "flex"), _row("mm13k_hub", "flex")]
    record.write_text(json.dumps(old))
    kept = rows_kept(record, ENV, {"seed"})
    assert [(r["config"], r["impl"]) for r in kept] == [("video_64k", "mmsparse"), ("mm13k_hub", "flex")]
    new = [_row("seed", "mmsparse", fwd_ms=1.0), _row("seed", "flex", fwd_ms=2.0)]
    rows = merged(kept, new)
    assert [(r["config"], r["impl"]) for r in rows] == [("seed", "mmsparse"), ("seed", "flex"),
                                                         ("mm13k_hub", "flex"), ("video_64k", "mmsparse")]
    assert [r.get("fwd_ms") for r in rows[:2]] == [1.0, 2.0]


@pytest.mark.parametrize("key,value", [("commit", "fedcba987654"), ("gpu", "NVIDIA H100 80GB HBM3"),
                                       ("torch", "2.13.0+cu130"), ("triton", "3.7.1")])
def test_a_record_of_another_commit_or_version_is_refused(tmp_path, key, value):
    record = tmp_path / "latest.json"
    record.write_text(json.dumps([_row("video_64k", "mmsparse", **{key: value})]))
    with pytest.raises(SystemExit, match=re.escape(f"has rows of {key} '{value}' (config video_64k), this run's is")):
        rows_kept(record, ENV, {"seed"})


@pytest.mark.parametrize("commit", ["0123456789ab+dirty", "unknown"])
def test_a_tree_whose_commit_does_not_name_its_code_is_refused(tmp_path, commit):
    with pytest.raises(SystemExit, match="MMSPARSE_COMMIT"):
        rows_kept(tmp_path / "latest.json", {**ENV, "commit": commit}, {"seed"})


@pytest.mark.interpreter  # whole CPU runs; a GPU's are the benchmark tests'
def test_two_parts_make_one_record(tmp_path, monkeypatch):
    """Runs of tiny_ab and tiny_cyclic (the record's order is the configs', not the runs'), then tiny_ab again: its
    row replaced, not added. tiny_ab, the A/B tool's config, is the cheapest tiny one through the interpreter; the
    merge is the same whatever the rows hold."""
    from benchmarks.run import main

    monkeypatch.setenv("MMSPARSE_COMMIT", "0123456789ab")
    args = ["--device", "cpu", "--impls", "mmsparse", "--no-plot", "--out", str(tmp_path), "--warmup", "0", "--rep",
            "0", "--cpu-warmup", "1", "--cpu-reps", "1", "--rounds", "1", "--update"]
    threads = torch.get_num_threads()
    try:
        assert main(["--configs", "tiny_ab", *args]) == 0
        assert main(["--configs", "tiny_cyclic", *args]) == 0
        first = json.loads((tmp_path / "latest.json").read_text())
        assert main(["--configs", "tiny_ab", *args]) == 0  # measured again: its row replaced, not added
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "latest.json").read_text())
    assert [r["config"] for r in first] == [r["config"] for r in rows] == ["tiny_cyclic", "tiny_ab"]
    assert all(r["check"] == "ok" and r["commit"] == "0123456789ab" for r in rows)
    table = (tmp_path / "latest.md").read_text()
    assert "| tiny_cyclic |" in table and "| tiny_ab |" in table
    monkeypatch.setenv("MMSPARSE_COMMIT", "fedcba987654")
    with pytest.raises(SystemExit, match="one record holds one commit"):
        main(["--configs", "tiny_cyclic", *args])
