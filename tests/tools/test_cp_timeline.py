"""benchmarks.cp_timeline: the interval sums on synthetic GPU events (exchange alone, compute alone, overlap, idle),
the kinds of trace events, and a CPU run of two processes over gloo under torchrun (no GPU events there: zeros, the
plumbing only)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.cp_timeline import Event, classify, gpu_events, idle_gaps, merge, subtract, summarize, union_us
from tests.helpers import torchrun_on_cpu


def test_the_union_joins_overlapping_and_touching_intervals():
    assert merge([(5, 8), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 8)]
    assert union_us([(5, 8), (0, 2), (1, 3), (3, 4)]) == 7
    assert union_us([]) == 0
    assert subtract([(0, 10), (12, 20)], [(2, 3), (5, 13), (19, 30)]) == [(0, 2), (3, 5), (13, 19)]
    assert subtract([(0, 4)], []) == [(0, 4)] and subtract([(1, 2)], [(0, 5)]) == []


def test_events_are_told_apart_by_kind():
    assert classify("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel") == "exchange"
    assert classify("ncclKernel_AllReduce_RING_LL_Sum_int32_t", "Kernel") == "exchange"
    assert classify("_attn_fwd", "kernel") == "compute"
    assert classify("Memcpy PtoP (Device -> Device)", "gpu_memcpy") == "exchange"
    assert classify("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "copy"
    assert classify("Memcpy DtoD (Device -> Device)", "gpu_memcpy",
                    {"fromDevice": 1, "inDevice": 0, "toDevice": 0}) == "exchange"
    assert classify("Memcpy DtoD (Device -> Device)", "gpu_memcpy",
                    {"fromDevice": 0, "inDevice": 0, "toDevice": 0}) == "copy"
    assert classify("Memset (Device)", "gpu_memset") == "copy"
    # a DtoD copy on a stream of its own (no kernel there): the peer copies' streams
    assert classify("Memcpy DtoD (Device -> Device)", "gpu_memcpy", kernel_stream=False) == "exchange"
    assert classify("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", kernel_stream=False) == "copy"


def _timeline() -> list[Event]:
    # compute [0, 10), NCCL [5, 20), a peer copy [25, 30), a memset [30, 31): idle [20, 25)
    return [Event("_attn_fwd", 0, 10, "compute"), Event("ncclDevKernel_SendRecv", 5, 20, "exchange"),
            Event("Memcpy PtoP (Device -> Device)", 25, 30, "exchange"), Event("Memset (Device)", 30, 31, "copy")]


def test_the_sums_of_a_timeline():
    s = summarize(_timeline(), steps=1)
    assert (s["span_us"], s["busy_us"], s["idle_us"]) == (31, 26, 5)
    assert (s["compute_us"], s["exchange_us"], s["copy_us"]) == (10, 20, 1)
    # exchange with no compute beside it: [10, 20) and [25, 30); compute alone [0, 5); both [5, 10)
    assert (s["exchange_alone_us"], s["compute_alone_us"], s["overlap_us"]) == (15, 5, 5)
    assert s["gpu_events"] == 4
    assert [(e["name"], e["kind"], e["ms"]) for e in s["exchange_alone_top"]] == [
        ("ncclDevKernel_SendRecv", "exchange", 0.010), ("Memcpy PtoP (Device -> Device)", "exchange", 0.005)]
    assert [e["name"] for e in s["top"]] == ["ncclDevKernel_SendRecv", "_attn_fwd", "Memcpy PtoP (Device -> Device)",
                                             "Memset (Device)"]
    assert s["idle_gaps"] == [{"us": 5, "at_us": 20, "before": "ncclDevKernel_SendRecv",
                               "after": "Memcpy PtoP (Device -> Device)"}]
    assert s["copies"] == [{"name": "Memcpy PtoP (Device -> Device)", "stream": None, "kind": "exchange", "ms": 0.005,
                            "events": 1}, {"name": "Memset (Device)", "stream": None, "kind": "copy", "ms": 0.001,
                                           "events": 1}]


def test_per_step_values_divide_by_the_steps():
    shifted = [Event(e.name, e.start + 100, e.end + 100, e.kind) for e in _timeline()]
    s = summarize(shifted + [Event("_attn_bwd", 131, 162, "compute")], steps=2)
    assert (s["span_us"], s["busy_us"], s["compute_us"]) == (62, 57, 41)
    assert s["step_ms"] == pytest.approx(0.031) and s["busy_ms"] == pytest.approx(0.0285)
    assert s["exchange_alone_ms"] == pytest.approx(0.0075) and s["idle_ms"] == pytest.approx(0.0025)
    assert s["top"][0] == {"name": "_attn_bwd", "kind": "compute", "ms": pytest.approx(0.0155), "events": 0.5}


def test_no_events_give_zeros():
    s = summarize([], steps=3)
    assert s["span_us"] == s["busy_us"] == s["idle_us"] == s["exchange_alone_us"] == s["step_ms"] == 0
    assert s["exchange_alone_top"] == s["top"] == s["idle_gaps"] == []


def test_a_gap_after_a_long_event_starts_at_its_end():
    # the short event inside the long one ends first; the gap starts when the long one ends
    events = [Event("long", 0, 10, "compute"), Event("inner", 2, 3, "copy"), Event("next", 14, 15, "compute")]
    assert idle_gaps(events) == [{"us": 4, "at_us": 10, "before": "long", "after": "next"}]


def test_the_trace_gives_this_devices_gpu_events():
    dtod = "Memcpy DtoD (Device -> Device)"
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "Kernel", "name": "ncclDevKernel_SendRecv", "ts": 10.5, "dur": 4, "tid": 20,
         "args": {"device": 1, "stream": 20}},
        {"ph": "X", "cat": "gpu_memcpy", "name": dtod, "ts": 3, "dur": 2, "tid": 7,
         "args": {"fromDevice": 0, "inDevice": 1, "toDevice": 1, "stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": dtod, "ts": 6, "dur": 1, "args": {"device": 1, "stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": dtod, "ts": 8, "dur": 1, "args": {"device": 1, "stream": 9}},
        {"ph": "X", "cat": "kernel", "name": "_attn_bwd", "ts": 9, "dur": 1, "tid": 7, "args": {"device": 1}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 1, "dur": 1, "args": {"device": 1}},
        {"ph": "X", "cat": "kernel", "name": "_attn_fwd", "ts": 2, "dur": 9, "args": {"device": 0}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "a range", "ts": 0, "dur": 30, "args": {"device": 1}},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 2},
    ]}
    # two devices named: a copy between GPUs; DtoD on stream 7 (a kernel runs there): a copy on this GPU; on
    # stream 9 (no kernel): a peer copy
    assert gpu_events(trace, device_index=1) == [
        Event("Memset (Device)", 1, 2, "copy"), Event(dtod, 3, 5, "exchange", 7), Event(dtod, 6, 7, "copy", 7),
        Event(dtod, 8, 9, "exchange", 9), Event("_attn_bwd", 9, 10, "compute", 7),
        Event("ncclDevKernel_SendRecv", 10.5, 14.5, "exchange", 20)]
    assert [e.name for e in gpu_events(trace)] == ["Memset (Device)", "_attn_fwd", dtod, dtod, dtod, "_attn_bwd",
                                                  "ncclDevKernel_SendRecv"]


def test_two_processes_over_gloo_fill_the_record(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo run; GPUs run it under torchrun with NCCL")
    torchrun_on_cpu("benchmarks.cp_timeline", 2, ["--device", "cpu", "--steps", "1", "--out", str(tmp_path)],
                    MMSPARSE_COMMIT="test-commit")
    record = json.loads((tmp_path / "cp_timeline.json").read_text())
    assert record["commit"] == "test-commit" and record["nccl"]["NCCL_NVLS_ENABLE"] == "0"
    assert (record["steps"], record["keep_fetched_kv"]) == (1, "auto")
    rows = record["rows"]
    assert [(r["config"], r["gpus"], r["rank"]) for r in rows] == [("tiny_cyclic", 2, 0), ("tiny_cyclic", 2, 1)]
    for row in rows:
        assert row["host_ms"] > 0 and row["wall_ms"] >= row["host_ms"]
        # no GPU on a CPU run: every GPU time is 0
        for field in ("step_ms", "busy_ms", "compute_ms", "exchange_ms", "copy_ms", "exchange_alone_ms",
                      "compute_alone_ms", "overlap_ms", "idle_ms", "gpu_events"):
            assert row[field] == 0, field
        assert row["exchange_alone_top"] == row["top"] == row["idle_gaps"] == []
        assert isinstance(row["keeps_fetched_kv"], bool)
        # the host's own time, and where it goes: the attention's entry point among mmsparse's functions
        assert row["host_plain_ms"] > 0 and row["host_self"]
        assert any("(attention)" in h["function"] and h["calls"] == 1 for h in row["host_mmsparse"])
    table = (tmp_path / "cp_timeline.md").read_text()
    assert "| config | GPUs | rank | keeps K/V | step ms | host ms | host ms, no profiler | busy |" in table
    assert "mmsparse's functions of most time with their callees" in table
    assert "| tiny_cyclic | 2 | 0 |" in table and "| tiny_cyclic | 2 | 1 |" in table

