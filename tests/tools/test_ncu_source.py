"""The source-view tool's parsing of ``ncu --page source --csv --print-source sass`` (no GPU, no ncu)."""

from __future__ import annotations

import pytest

from tools.ncu_source import markdown, stall_rows

SOURCE = '''"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",\
"Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"
"0x10","BAR.SYNC.DEFER_BLOCKING 0x1","0","0","4096","0","0","0","0"
"0x20","NOP","600","600","4096","600","0","0","600"
"0x30","@!P0  BRA 0x10","300","290","527,584","0","280","20","0"
"0x40","HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24], R152","100","10","2,102,144","0","0","100","0"
'''


def test_rows_by_samples_with_reasons():
    total, rows = stall_rows("==PROF== noise\n" + SOURCE, top=2)
    assert total == 1000
    assert [r["address"] for r in rows] == ["0x20", "0x30"]
    assert rows[1]["instruction"] == "@!P0 BRA 0x10" and rows[1]["executed"] == 527584
    assert rows[1]["reasons"] == {"long_sb": 280, "wait": 20}  # the two largest, not the Not-Issued columns
    table = markdown(total, rows)
    assert "| 60.0% | 4096 | `NOP` | barrier 100% |" in table
    assert "| 30.0% | 527584 | `@!P0 BRA 0x10` | long_sb 93%, wait 7% |" in table


def test_output_without_a_source_table_is_refused():
    with pytest.raises(ValueError, match="no source table"):
        stall_rows("==PROF== nothing profiled\n")
