"""The compute-sanitizer driver without a GPU: its command line, the case lists, the parsers of the sanitizer's
and the child's output on realistic samples, a clear exit without CUDA or without compute-sanitizer, and a whole
driver run against a stand-in sanitizer that prints canned reports. (The GPU run itself: python -m
tests.stress.sanitize on a CUDA machine.)"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import pytest

from tests.stress import sanitize

pytestmark = pytest.mark.stress  # the stress tools' smoke tests: pytest -m stress

MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
CASE bits-causal-gqa ok 3.2s []
CASE bits-decode-split ok 1.1s ['split']
DONE 2 cases, 0 failed
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at attention_fwd_tl+0x1a70
=========     by thread (64,0,0) in block (3,0,0)
=========     Address 0x7f3c5e000410 is out of bounds
=========     and is 1,040 bytes after the nearest allocation at 0x7f3c5dfffc00 of size 1,024 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f1c3b] in libcuda.so.1
=========
========= Invalid __global__ read of size 16 bytes
=========     at attention_fwd_tl+0x1a70
=========     by thread (65,0,0) in block (3,0,0)
=========     Address 0x7f3c5e000420 is out of bounds
=========
CASE codes-k600 FAIL RuntimeError: CUDA error: unspecified launch failure
DONE 6 cases, 1 failed
========= ERROR SUMMARY: 2 errors
"""

MEMCHECK_MANY = """\
========= COMPUTE-SANITIZER
========= Invalid __shared__ write of size 4 bytes
=========     at attention_dkdv_gluon+0x3b0
========= ERROR SUMMARY: 1234 errors
========= ERROR SUMMARY: 1184 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at attention_fwd_gluon+0x2210
=========     and Read access at attention_fwd_gluon+0x2c40 [512 hazards]
=========
CASE gluon-bits-causal-d128 ok 40.2s ['gluon-dkdv', 'gluon-dq', 'gluon-fwd']
DONE 1 cases, 0 failed
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
CASE bits-causal-gqa ok 9.0s []
DONE 1 cases, 0 failed
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

SYNCCHECK = """\
========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at attention_dq_gluon+0x990
=========     by thread (3,0,0) in block (0,0,0)
=========
CASE gluon-codes-types ok 20.0s ['gluon-dkdv', 'gluon-dq', 'gluon-fwd']
DONE 1 cases, 0 failed
========= ERROR SUMMARY: 1 error
"""

UNSUPPORTED = """\
========= COMPUTE-SANITIZER
========= Error: Device not supported
========= Target application terminated before first instrumented API call
"""


def test_summary_parser():
    clean = sanitize.parse_sanitizer(MEMCHECK_CLEAN)
    assert clean["errors"] == 0 and clean["report"] == [] and clean["problem"] is None
    bad = sanitize.parse_sanitizer(MEMCHECK_ERRORS)
    assert bad["errors"] == 2
    assert bad["report"][0] == "========= Invalid __global__ read of size 16 bytes"
    assert "=========     at attention_fwd_tl+0x1a70" in bad["report"]
    assert not any("SUMMARY" in line or "COMPUTE-SANITIZER" in line for line in bad["report"])
    assert not any(line.startswith("CASE") for line in bad["report"])  # the child's lines are not the report
    many = sanitize.parse_sanitizer(MEMCHECK_MANY)
    assert many["errors"] == 1234  # not the "were not printed" line
    race = sanitize.parse_sanitizer(RACECHECK)
    assert (race["errors"], race["hazards"], race["warnings"]) == (1, 1, 0)
    assert race["report"][0].startswith("========= Error: Race reported between Write access")
    assert sanitize.parse_sanitizer(RACECHECK_CLEAN)["errors"] == 0
    sync = sanitize.parse_sanitizer(SYNCCHECK)
    assert sync["errors"] == 1 and "Barrier error" in sync["report"][0]
    none = sanitize.parse_sanitizer(UNSUPPORTED)
    assert none["errors"] is None and none["problem"] == "Error: Device not supported"
    assert sanitize.parse_sanitizer("")["errors"] is None


def test_report_lines_are_capped():
    text = "========= COMPUTE-SANITIZER\n" + "=========     at k+0x10\n" * 500 + "========= ERROR SUMMARY: 500 errors\n"
    parsed = sanitize.parse_sanitizer(text)
    assert len(parsed["report"]) == sanitize.REPORT_LINES and parsed["report_lines"] == 500


def test_child_parser_and_verdicts():
    ok = sanitize.parse_child(MEMCHECK_CLEAN)
    assert ok == {"ok": ["bits-causal-gqa", "bits-decode-split"], "failed": {}, "finished": True, "total": 2}
    bad = sanitize.parse_child(MEMCHECK_ERRORS)
    assert bad["failed"] == {"codes-k600": "RuntimeError: CUDA error: unspecified launch failure"}
    judge = sanitize.judge
    assert judge(sanitize.parse_sanitizer(MEMCHECK_CLEAN), ok, 0, False) == "clean"
    assert judge(sanitize.parse_sanitizer(MEMCHECK_ERRORS), bad, 1, False) == "errors"
    assert judge(sanitize.parse_sanitizer(RACECHECK), sanitize.parse_child(RACECHECK), 1, False) == "errors"
    assert judge(sanitize.parse_sanitizer(UNSUPPORTED), sanitize.parse_child(""), 1, False) == "sanitizer unsupported"
    crashed = "========= COMPUTE-SANITIZER\nCASE a ok 1.0s []\nSegmentation fault\n"
    assert judge(sanitize.parse_sanitizer(crashed), sanitize.parse_child(crashed), -11, False) == "no summary"
    failed = MEMCHECK_CLEAN.replace("CASE bits-decode-split ok 1.1s ['split']",
                                    "CASE bits-decode-split FAIL AssertionError: took nothing special")
    assert judge(sanitize.parse_sanitizer(failed), sanitize.parse_child(failed), 1, False) == "child failed"
    assert judge(None, sanitize.parse_child(""), None, True) == "timeout"


def test_arguments():
    args = sanitize.parse_args([])
    assert args.tools == ["memcheck"] and args.groups is None and not args.child
    args = sanitize.parse_args(["--tool", "racecheck", "--tool", "synccheck", "--groups", "tl-bits,gluon-bits"])
    assert args.tools == ["racecheck", "synccheck"] and args.groups == ["tl-bits", "gluon-bits"]
    assert sanitize.parse_args(["--tool", "all"]).tools == list(sanitize.TOOLS)
    args = sanitize.parse_args(["--child", "--group", "tl-codes", "--only", "codes-k40,codes-k600"])
    assert args.child and args.group == "tl-codes" and args.only == ["codes-k40", "codes-k600"]
    for bad in (["--tool", "initcheck"], ["--groups", "tl-bits,nope"], ["--group", "tl-bits"], ["--child"],
                ["--child", "--group", "tl-bits", "--only", "codes-k40"], ["--child", "--group", "nope"]):
        with pytest.raises(SystemExit):
            sanitize.parse_args(bad)


def test_case_lists(capsys):
    """Every group has cases with distinct names; the racecheck/synccheck subset names real cases; a dry run lists
    them all; the cases cover what the sanitizer must see."""
    names = [c.name for g in sanitize.GROUPS.values() for c in g.cases]
    assert len(names) == len(set(names))
    for tool, groups in sanitize.TOOL_GROUPS.items():
        for group, only in groups.items():
            assert sanitize.selected_cases(group, only), (tool, group)
    assert set(sanitize.TOOL_GROUPS["memcheck"]) == set(sanitize.GROUPS)
    assert {g for g in sanitize.SUBSET if sanitize.GROUPS[g].hopper} == {"gluon-bits", "gluon-codes", "gluon-dense",
                                                                         "gluon-d256"}
    cases = [c for g in sanitize.GROUPS.values() for c in g.cases]
    assert any(c.dropout for c in cases) and any(c.dense for c in cases) and any(c.packed for c in cases)
    assert any(c.layout == "thd" for c in cases) and any(c.q_start for c in cases)
    assert any("split" in c.expect for c in cases) and any(c.kind == "lists" for c in cases)
    assert any(not c.dense and len(sanitize._topology(c.topology)) > 32 for c in cases)
    assert any(c.heads > c.kv_heads for c in cases) and any(not c.use_tma for c in cases)
    assert {c.head_dim for c in cases} >= {64, 128} and {c.dtype for c in cases} == {"fp16", "bf16", "fp32"}
    assert any(c.seq_q is not None and c.seq_q <= 16 for c in cases)  # decode tiles
    for group in sanitize.GROUPS.values():
        for c in group.cases:
            if not c.dense:
                rows = sanitize._rows(c)
                assert all(len(r) == len(sanitize._topology(c.topology)) for r in rows), c.name
            if c.q_start:
                assert all(0 <= s <= sanitize._seq_k(c) - c.seq_q for s in c.q_start), c.name

    assert sanitize.main(["--child", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in sanitize.GROUPS:
        assert out.count(f"\n{name} (") + out.startswith(f"{name} (") == 1
    for name in names:
        assert f"  {name}: " in out
    assert sanitize.main(["--child", "--group", "tl-dense", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dense-decode" in out and "bits-causal-gqa" not in out


def test_plan_skips_gluon_off_hopper():
    runs = sanitize.plan(["memcheck", "racecheck"], None, hopper=False)
    assert [(r["tool"], r["group"]) for r in runs if not r["skipped"]] == [
        *(("memcheck", g) for g in sanitize.GROUPS if not sanitize.GROUPS[g].hopper), ("racecheck", "tl-bits")]
    assert all(r["skipped"] for r in runs if sanitize.GROUPS[r["group"]].hopper)
    runs = sanitize.plan(["synccheck"], ["gluon-bits", "builders"], hopper=True)
    assert [(r["group"], r["only"], r["skipped"]) for r in runs] == [
        ("gluon-bits", sanitize.SUBSET["gluon-bits"], None)]


def test_exits_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(sanitize, "cuda_available", lambda: False)
    assert sanitize.main(["--tool", "memcheck"]) == sanitize.EXIT_CANNOT_RUN
    assert "no CUDA device" in capsys.readouterr().err
    assert sanitize.main(["--child", "--group", "tl-bits"]) == sanitize.EXIT_CANNOT_RUN
    assert "no CUDA device" in capsys.readouterr().err
    assert sanitize.main(["--child", "--group", "gluon-bits", "--device", "cpu"]) == sanitize.EXIT_CANNOT_RUN


def test_exits_without_compute_sanitizer(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sanitize, "cuda_available", lambda: True)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    if os.path.exists("/usr/local/cuda/bin/compute-sanitizer"):
        pytest.skip("this machine has compute-sanitizer in /usr/local/cuda")
    assert sanitize.main(["--out", str(tmp_path)]) == sanitize.EXIT_CANNOT_RUN
    assert "compute-sanitizer not found" in capsys.readouterr().err
    assert sanitize.main(["--sanitizer", str(tmp_path / "nope")]) == sanitize.EXIT_CANNOT_RUN
    assert "compute-sanitizer not found" in capsys.readouterr().err


def _fake_sanitizer(tmp_path, script: str):
    path = tmp_path / "compute-sanitizer"
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(script))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


FAKE = """\
import os, sys
args = sys.argv[1:]
if args == ["--help"]:
    print("  --report-api-errors arg (=explicit)  Print errors if any API call fails.")
    sys.exit(0)
if args == ["--version"]:
    print("NVIDIA (R) Compute Sanitizer\\nVersion 2099.1.0.0 (fake)")
    sys.exit(0)
assert os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"
tool = args[args.index("--tool") + 1]
assert args[args.index("--error-exitcode") + 1] == "1"
print("========= COMPUTE-SANITIZER")
if "-c" in args:  # the preflight probe
    print("probe 16.0")
    print("========= ERROR SUMMARY: 0 errors")
    sys.exit(0)
assert "--report-api-errors" in args
assert args[args.index("-m") + 1:args.index("-m") + 4] == ["tests.stress.sanitize", "--child", "--group"]
group = args[args.index("--group") + 1]
if group == "tl-dense" and tool == "memcheck":
    print("========= Invalid __global__ read of size 4 bytes")
    print("=========     at attention_fwd_tl+0x10")
    print("CASE dense-gqa FAIL RuntimeError: CUDA error: unspecified launch failure")
    print("DONE 3 cases, 1 failed")
    print("========= ERROR SUMMARY: 1 error")
    sys.exit(1)
if group == "tl-dropout":
    print("CASE dropout-bits ok 1.0s []")
    print("Segmentation fault")
    sys.exit(139)
print(f"CASE first-of-{group} ok 1.0s []")
print("DONE 1 cases, 0 failed")
print("========= ERROR SUMMARY: 0 errors" if tool != "racecheck" else
      "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
"""


def test_driver_with_a_stand_in_sanitizer(monkeypatch, tmp_path, capsys):
    """The whole driver: preflight, one child per tool and group with the sanitizer's arguments and the
    environment, the verdicts, sanitizer.json and sanitizer.md, the exit status; --merge keeps earlier runs."""
    fake = _fake_sanitizer(tmp_path, FAKE)
    monkeypatch.setattr(sanitize, "cuda_available", lambda: True)
    monkeypatch.setattr(sanitize, "gluon_available", lambda: False)
    monkeypatch.setattr(sanitize, "gpu_environment",
                        lambda: {"gpu": "NVIDIA H100 80GB HBM3", "torch": "t", "triton": "tr", "commit": "abc"})
    out = tmp_path / "out"
    argv = ["--sanitizer", str(fake), "--out", str(out), "--logs", str(tmp_path / "logs")]
    assert sanitize.main([*argv, "--tool", "memcheck"]) == 1
    record = json.loads((out / "sanitizer.json").read_text())
    status = {(r["tool"], r["group"]): r.get("status") or "skipped" for r in record["runs"]}
    assert status == {("memcheck", "tl-bits"): "clean", ("memcheck", "tl-codes"): "clean",
                      ("memcheck", "tl-dense"): "errors", ("memcheck", "tl-dropout"): "no summary",
                      ("memcheck", "builders"): "clean", ("memcheck", "gluon-bits"): "skipped",
                      ("memcheck", "gluon-codes"): "skipped", ("memcheck", "gluon-dense"): "skipped",
                      ("memcheck", "gluon-d256"): "skipped"}
    dense = next(r for r in record["runs"] if r["group"] == "tl-dense")
    assert dense["errors"] == 1 and dense["report"][0] == "========= Invalid __global__ read of size 4 bytes"
    assert dense["cases"]["failed"] == {"dense-gqa": "RuntimeError: CUDA error: unspecified launch failure"}
    assert dense["command"].startswith(f"{fake} --tool memcheck --error-exitcode 1")
    assert "python -m tests.stress.sanitize --child --group tl-dense" in dense["command"]
    assert record["sanitizer"]["version"] == "Version 2099.1.0.0 (fake)" and record["sanitizer"]["preflight"]["ok"]
    assert not record["ok"]
    md = (out / "sanitizer.md").read_text()
    assert "| memcheck | tl-dense | errors | 1 |" in md and "Invalid __global__ read" in md
    assert "skipped: the Gluon kernels run only on sm_90" in md and "NVIDIA H100 80GB HBM3" in md
    assert (tmp_path / "logs" / "memcheck-tl-dense.log").exists()

    assert sanitize.main([*argv, "--tool", "racecheck", "--merge"]) == 1  # earlier memcheck errors are kept
    record = json.loads((out / "sanitizer.json").read_text())
    race = [r for r in record["runs"] if r["tool"] == "racecheck" and not r.get("skipped")]
    assert [(r["group"], r["status"]) for r in race] == [("tl-bits", "clean")]
    assert any(r["tool"] == "memcheck" for r in record["runs"])

    assert sanitize.main([*argv, "--tool", "racecheck"]) == 0  # without --merge: only this run
    record = json.loads((out / "sanitizer.json").read_text())
    assert record["ok"] and {r["tool"] for r in record["runs"]} == {"racecheck"}
    capsys.readouterr()


def test_driver_stops_when_the_sanitizer_cannot_run(monkeypatch, tmp_path, capsys):
    """A sanitizer that refuses the device (it does on some virtual machines): exit 2 with its words, no record."""
    fake = _fake_sanitizer(tmp_path, """\
        import sys
        if sys.argv[1:] in (["--help"], ["--version"]):
            sys.exit(0)
        print("========= COMPUTE-SANITIZER")
        print("========= Error: Device not supported")
        sys.exit(1)
        """)
    monkeypatch.setattr(sanitize, "cuda_available", lambda: True)
    monkeypatch.setattr(sanitize, "gpu_environment",
                        lambda: {"gpu": "NVIDIA H200", "torch": "t", "triton": "tr", "commit": "abc"})
    code = sanitize.main(["--sanitizer", str(fake), "--out", str(tmp_path / "out"), "--logs", str(tmp_path)])
    assert code == sanitize.EXIT_CANNOT_RUN
    assert "Device not supported" in capsys.readouterr().err
    assert not (tmp_path / "out" / "sanitizer.json").exists()


@pytest.mark.parametrize("group, case", [("tl-codes", "codes-pack50-causal"), ("tl-dropout", "dropout-decode-split"),
                                         ("builders", "lists-codes")])
def test_a_case_runs_in_the_interpreter(device, capsys, monkeypatch, group, case):
    """The child's code on the CPU (Triton's interpreter, no sanitizer): a case runs, forward and backward, and
    takes the paths it says (the interpreter splits grids under 8 programs); the plan the child reads them from is
    the one the call planned, once, for its forward and backward."""
    if device.type != "cpu":
        pytest.skip("the GPU runs python -m tests.stress.sanitize")
    from mmsparse.attention import call, plan

    plans = []
    for module in (plan, call):  # the child asks mmsparse.attention.plan; the call plans under its own name
        real = module.plan_attention

        def spy(*args, _real=real, _where=module.__name__, **kwargs):
            plans.append((_where, _real(*args, **kwargs)))
            return plans[-1][1]

        monkeypatch.setattr(module, "plan_attention", spy)
    assert sanitize.main(["--child", "--group", group, "--only", case, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"CASE {case} ok" in out and "DONE 1 cases, 0 failed" in out
    if group != "builders":
        asked = [p for where, p in plans if where == plan.__name__]
        called = [p for where, p in plans if where != plan.__name__]
        assert len(asked) == 1 and len(called) == 1, plans
        assert all(p == asked[0] for p in called)
        assert f"{sorted(sanitize.taken_paths(asked[0]))}" in out
