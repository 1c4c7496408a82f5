"""The ncu table tool's parsing of ``ncu --csv --page raw`` (no GPU, no ncu: a report's text)."""

from __future__ import annotations

from tools.profile_ncu import kernel_rows, markdown

RAW = '''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed",\
"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",\
"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",\
"smsp__average_warp_latency_per_inst_issued.ratio","sm__inst_issued.avg.pct_of_peak_sustained_active",\
"lts__throughput.avg.pct_of_peak_sustained_elapsed","dram__throughput.avg.pct_of_peak_sustained_elapsed"
"","","usecond","%","%","%","inst","inst","cycle","%","%","%"
"0","attention_fwd_gluon(int, int)","1,660.50","70.1","61.2","0","0.8","2.5","7.6","38.0","55.5","20.25"
"1","flash_fwd","1450","81","n/a","0","1.5","0.3","5.5","39","n/a","n/a"
'''


def test_rows_and_table():
    rows = kernel_rows(RAW)
    assert [r["kernel"] for r in rows] == ["attention_fwd_gluon(int, int)", "flash_fwd"]
    first = rows[0]
    assert abs(first["ms"] - 1.6605) < 1e-9 and first["sm_throughput_pct"] == 70.1
    assert first["tensor_pipe_pct"] == 61.2 and "gmma" in first["tensor_pipe_metric"]
    assert list(first["stalls"]) == ["wait", "long_scoreboard"] and first["cycles_per_issue"] == 7.6
    assert first["l2_pct"] == 55.5 and first["dram_pct"] == 20.25
    assert rows[1]["tensor_pipe_pct"] is None and rows[1]["stalls"]["long_scoreboard"] == 1.5
    assert rows[1]["l2_pct"] is None
    for r in rows:
        r.update(config="mm13k_hub", impl="x")
    table = markdown(rows)
    row = ("| mm13k_hub | x | `attention_fwd_gluon` | 1.661 | 70.1 | 61.2 | 55.5 | 20.2 | 38.0 | 7.6 | wait 2.5, "
           "long_scoreboard 0.8 |")
    assert row in table
    assert kernel_rows("no csv here") == []
