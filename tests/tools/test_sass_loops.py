"""tools/sass_loops.py: the innermost loops of a SASS listing and what they hold, and a PTX kernel with a loop
assembled and disassembled on the CPU by the binaries Triton ships."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import sass_loops

# nvdisasm -c's form: an outer loop (.L_x_0) around an inner one (.L_x_1) that spills, re-reads the thread index,
# loads from global memory and issues a wgmma; a forward branch (.L_x_2) closes no loop.
SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   STL [R1], R2 ;
        /*0030*/                   S2R R3, SR_TID.X ;
        /*0040*/                   LDS R4, [R3+0x100] ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0058*/                   LDG.E.U8 R5, desc[UR6][R6.64] ;
        /*0060*/                   LDL.LU R2, [R1] ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/               @P1 BRA `(.L_x_2) ;
        /*0090*/               @P2 BRA `(.L_x_0) ;
.L_x_2:
        /*00a0*/                   EXIT ;
"""


def test_innermost_loop_and_its_counts():
    (inner,) = sass_loops.loops(SASS)
    assert inner.instructions == 7
    assert inner.counts == {"hgmma": 1, "stl": 1, "ldl": 1, "s2r_tid": 1, "lds": 1, "ldg": 1}
    both = sass_loops.loops(SASS, innermost=False)
    assert len(both) == 2 and both[0].counts["s2r_tid"] == 2  # the outer loop holds the inner one


# A counted loop that stores the thread index at a runtime stride until a runtime count: ptxas keeps its back edge.
PTX = """\
.version 8.0
.target sm_90a
.address_size 64

.visible .entry stride_store(.param .u64 out, .param .u32 n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r2, %tid.x;
    mov.u32 %r3, 0;
LOOP:
    mul.wide.u32 %rd3, %r3, 4;
    add.s64 %rd4, %rd2, %rd3;
    add.s32 %r4, %r2, %r3;
    st.global.u32 [%rd4], %r4;
    add.s32 %r3, %r3, %r1;
    setp.lt.u32 %p1, %r3, 100000;
    @%p1 bra LOOP;
    ret;
}
"""


def test_report_assembles_ptx_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "stride_store.ptx").write_text(PTX)
    rows = sass_loops.report(tmp_path, all_loops=True)
    assert rows and all(row["kernel"] == "stride_store" and row["instructions"] > 0 for row in rows)
    assert all(row["hgmma"] == 0 and row["stl"] == 0 for row in rows)
    # without --all-loops only loops that issue wgmmas count: none here
    assert sass_loops.main([str(tmp_path)]) == 1
    assert "no loop found" in capsys.readouterr().out
    assert sass_loops.main([str(tmp_path), "--all-loops"]) == 0
    assert "| stride_store |" in capsys.readouterr().out
    assert sass_loops.report(tmp_path, only="other", all_loops=True) == []


def test_a_missing_folder_is_refused(tmp_path: Path):
    with pytest.raises(SystemExit, match="not a folder"):
        sass_loops.main([str(tmp_path / "nothing")])
