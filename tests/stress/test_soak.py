"""The soak script (tests/stress/soak.py): a few steps on the CPU through the interpreter write its records, and its
verdict flags growing memory, caches and kernel variants on synthetic records."""

from __future__ import annotations

import json

import pytest

from mmsparse import clear_caches
from tests.stress import soak

pytestmark = pytest.mark.stress  # the stress tools' smoke tests: pytest -m stress


def test_a_few_steps_write_the_records(tmp_path):
    clear_caches()  # count this run's masks only
    assert soak.main(["--steps", "5", "--every", "2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert [r["step"] for r in summary["records"]] == [2, 4, 5]
    last = summary["records"][-1]
    assert last["loss"] is not None and last["variants"] and last["launch_cache"]
    # one new mask a step, and the topology and first-query position they share
    assert 1 <= last["caches"]["mmsparse.mask.cache.CACHE"] <= 5 + 2
    assert summary["verdict"] == {"judged": False, "ok": True, "records_after_warmup": 0,
                                  "reason": summary["verdict"]["reason"]}
    assert "Not judged" in (tmp_path / "soak.md").read_text()


def _records(steps=range(10, 210, 10), allocated=lambda s: 100 << 20, cache=lambda s: 64, variants=lambda s: 12):
    return [{"step": s, "loss": 1.0, "allocated": allocated(s), "peak": allocated(s) + (8 << 20),
             "variants": {"k": variants(s)}, "launch_cache": {"k": variants(s)},
             "caches": {"mmsparse.mask.cache.CACHE": cache(s), "other": 3}} for s in steps]


def test_flat_records_pass():
    verdict = soak.judge(_records(allocated=lambda s: (100 << 20) + (s % 30) * 4096), warmup=50)
    assert verdict["judged"] and verdict["ok"] and not verdict["unbounded"], verdict
    assert abs(verdict["memory"]["ratio_last_to_after_warmup"] - 1) < 0.01


def test_growing_memory_fails():
    verdict = soak.judge(_records(allocated=lambda s: (100 << 20) + s * (1 << 18)), warmup=50)  # 256 KiB a step
    assert verdict["judged"] and not verdict["ok"] and not verdict["memory"]["ok"]
    assert verdict["memory"]["slope_bytes_per_step"] == 1 << 18


def test_a_cache_or_variants_growing_late_are_unbounded():
    verdict = soak.judge(_records(cache=lambda s: 64 + max(0, s - 100) // 2), warmup=50)  # a leak after step 100
    assert not verdict["ok"] and verdict["unbounded"] == ["mmsparse.mask.cache.CACHE"]
    verdict = soak.judge(_records(variants=lambda s: 12 + (s > 150)), warmup=50)
    assert not verdict["ok"] and verdict["unbounded"] == ["launch_cache", "variants"]


def test_a_cache_wandering_within_its_bound_is_bounded():
    verdict = soak.judge(_records(cache=lambda s: 60 + (s * 7919) % 5), warmup=50)  # 60..64, no trend
    assert verdict["caches"]["mmsparse.mask.cache.CACHE"]["ok"], verdict["caches"]
