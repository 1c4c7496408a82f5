"""tests/kernels/ptx_barriers.py on hand-written PTX: a kernel that keeps its barriers' bytes to itself passes; one that
stores into a live barrier, or never invalidates one, fails; and the address forms Triton emits (a symbol plus an
offset, registers computed from it, a ring indexed by a remainder or by a counter modulo its size, a per-warp slot
behind a branch) resolve."""

from __future__ import annotations

from tests.kernels.ptx_barriers import check_barrier_lifetimes


def kernel(body: str) -> str:
    return f"""//
.version 8.7
.target sm_90a
.address_size 64
.extern .shared .align 16 .b8 global_smem[];

.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0
)
.reqntid 384
{{
	.reg .pred 	%p<8>;
	.reg .b32 	%r<64>;
	.reg .b64 	%rd<8>;
	ld.param.b64 	%rd1, [k_param_0];
{body}
	ret;
}}
"""


# Thread 0's predicate %p1, under which barriers are initialised, used and invalidated.
THREAD0 = """
	mov.u32 	%r1, %tid.x;
	setp.eq.b32 	%p1, %r1, 0;
"""

# Two barriers at +1024 and +1032, a value passed to the partitions at +1040 (next to them, not on them).
INIT = THREAD0 + """	mov.b32 	%r2, global_smem;
	add.s32 	%r3, %r2, 1024;
	@%p1 mbarrier.init.shared::cta.b64 [%r3], 1;
	add.s32 	%r4, %r2, 1032;
	@%p1 mbarrier.init.shared::cta.b64 [%r4], 2;
	fence.proxy.async.shared::cta;
	st.shared.b64 	[global_smem+1040], %rd1;
"""
USE = """
	ld.shared.b64 	%rd2, [global_smem+1040];
	// begin inline asm
	{
	.reg .pred complete;
	waitLoop:
	mbarrier.try_wait.parity.shared::cta.b64 complete, [%r3], 0;
	@!complete bra.uni waitLoop;
	}
	// end inline asm
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r4];
"""
INVAL = """
	@%p1 mbarrier.inval.shared::cta.b64 [%r3];
	@%p1 mbarrier.inval.shared::cta.b64 [%r4];
"""


def test_barriers_kept_apart_and_invalidated_pass():
    after = "\tst.shared.b32 \t[global_smem+1024], %r1;\n"  # bytes of an invalidated barrier may be reused
    report = check_barrier_lifetimes(kernel(INIT + USE + INVAL + after))
    assert report.ok, report.summary()
    assert [(b.offset, b.inval_line is not None) for b in report.barriers] == [(1024, True), (1032, True)]
    assert report.checked == 3


def test_a_store_into_a_live_barrier_fails():
    reuse = "\tst.shared.v2.b32 \t[global_smem+1028], {%r1, %r1};\n"  # bytes 1028..1035: both barriers
    report = check_barrier_lifetimes(kernel(INIT + reuse + USE + INVAL))
    assert len(report.problems) == 2, report.summary()
    assert all("touches the live barrier global_smem+10" in p for p in report.problems)


def test_a_load_through_a_register_into_a_live_barrier_fails():
    reuse = "\tadd.s32 \t%r5, %r3, 4;\n\tld.shared.b32 \t%r6, [%r5];\n"
    report = check_barrier_lifetimes(kernel(INIT + reuse + USE + INVAL))
    assert len(report.problems) == 1 and "global_smem+1024" in report.problems[0], report.summary()


def test_a_barrier_never_invalidated_fails():
    report = check_barrier_lifetimes(kernel(INIT + USE + "\t@%p1 mbarrier.inval.shared::cta.b64 [%r3];\n"))
    assert report.problems == [f"barrier {report.barriers[1]}: no mbarrier.inval"], report.summary()
    assert report.barriers[1].offset == 1032 and report.barriers[1].inval_line is None


def test_a_barrier_used_after_its_inval_fails():
    late = "\t@%p1 mbarrier.arrive.shared::cta.b64 _, [%r4];\n"
    report = check_barrier_lifetimes(kernel(INIT + USE + INVAL + late))
    assert len(report.problems) == 1 and "outside the init..inval span" in report.problems[0], report.summary()


def test_an_unbounded_shared_address_is_reported_not_passed():
    loaded = "\tld.global.b32 \t%r5, [%rd1];\n\tld.shared.b32 \t%r6, [%r5];\n"
    report = check_barrier_lifetimes(kernel(INIT + loaded + USE + INVAL))
    assert not report.problems and len(report.unresolved) == 1 and not report.ok


def ring(slots: int, loop: str) -> str:
    """A ring of ``slots`` barriers at +2048, 8 bytes each (slot i's address in %r(20 + i)): thread 0 initialises
    them (arrival count 1) before ``loop`` and invalidates them after it."""
    init = "".join(f"\tadd.s32 \t%r{20 + i}, %r2, {2048 + 8 * i};\n"
                   f"\t@%p1 mbarrier.init.shared::cta.b64 [%r{20 + i}], 1;\n" for i in range(slots))
    inval = "".join(f"\t@%p1 mbarrier.inval.shared::cta.b64 [%r{20 + i}];\n" for i in range(slots))
    return THREAD0 + "\tmov.b32 \t%r2, global_smem;\n" + init + loop + inval


# A ring of 4 barriers, indexed by the signed remainder it % 4 as LLVM spells it
# (it - ((it + ((it >> 31) >>> 30)) & -4)), with the loop counter it widened to [0, inf).
RING = ring(4, """	mov.b32 	%r30, 0;
$L__BB0_1:
	shr.s32 	%r31, %r30, 31;
	shr.u32 	%r32, %r31, 30;
	add.s32 	%r33, %r30, %r32;
	and.b32 	%r34, %r33, -4;
	sub.s32 	%r35, %r30, %r34;
	shl.b32 	%r36, %r35, 3;
	add.s32 	%r37, %r20, %r36;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r37];
	{STORE}
	add.s32 	%r30, %r30, 1;
	setp.lt.s32 	%p2, %r30, 100;
	@%p2 bra 	$L__BB0_1;
""")


def test_a_ring_indexed_by_a_remainder_resolves_to_its_slots():
    clean = check_barrier_lifetimes(kernel(RING.replace("{STORE}", "st.shared.b32 [global_smem+2080], 0;")))
    assert clean.ok and len(clean.barriers) == 4, clean.summary()
    # A store at the ring's index plus 16 bytes lands in the ring (at 2024 + 16 .. 2072 + 16 for it % 4 in -3..3).
    store = "add.s32 %r38, %r37, 16;\n\tst.shared.b32 [%r38], 0;"
    reused = check_barrier_lifetimes(kernel(RING.replace("{STORE}", store)))
    assert {p.split("barrier ")[1].split(" ")[0] for p in reused.problems} == {
        "global_smem+2048", "global_smem+2056", "global_smem+2064", "global_smem+2072"}, reused.summary()


# Three rows of 256 bytes at +512 and a ring of 3 barriers, the stage counted modulo 3 as LLVM spells (s + 1) % 3
# for a loop-carried s in [0, 2]: x = y + 1; s = x == 3 ? 0 : x; y = s on the back edge.
COUNTED = ring(3, """	mov.b32 	%r40, {FIRST};
	mov.b32 	%r30, 0;
$L__BB0_1:
	add.s32 	%r41, %r40, 1;
	setp.eq.b32 	%p3, %r41, 3;
	selp.b32 	%r42, 0, %r41, %p3;
	shl.b32 	%r43, %r42, 3;
	add.s32 	%r44, %r20, %r43;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r44];
	shl.b32 	%r45, %r42, 8;
	add.s32 	%r46, %r2, %r45;
	ld.shared.b32 	%r47, [%r46+{ROW}];
	mov.b32 	%r40, %r42;
	add.s32 	%r30, %r30, 1;
	setp.lt.s32 	%p2, %r30, 100;
	@%p2 bra 	$L__BB0_1;
""")


def test_a_ring_indexed_by_a_counter_modulo_its_size_resolves_to_its_slots():
    clean = check_barrier_lifetimes(kernel(COUNTED.replace("{FIRST}", "0").replace("{ROW}", "512")))
    assert clean.ok and len(clean.barriers) == 3 and clean.checked == 1, clean.summary()
    # Rows at +1800: the three stages' rows (1800, 2056, 2312) span the barriers.
    reused = check_barrier_lifetimes(kernel(COUNTED.replace("{FIRST}", "0").replace("{ROW}", "1800")))
    assert {p.split("barrier ")[1].split(" ")[0] for p in reused.problems} == {
        "global_smem+2048", "global_smem+2056", "global_smem+2064"}, reused.summary()
    # Its first value copied from a register known to lie below the modulus (a phase bit, as ptxas may share them).
    phase = COUNTED.replace("\tmov.b32 \t%r40, {FIRST};", "\tand.b32 \t%r39, %r1, 1;\n\tmov.b32 \t%r40, %r39;")
    assert phase != COUNTED
    shared = check_barrier_lifetimes(kernel(phase.replace("{ROW}", "512")))
    assert shared.ok and shared.checked == 1, shared.summary()
    # A counter that may start past its modulus (or from an unknown value) is not bounded by it.
    for first in ("5", "%r1"):
        wild = check_barrier_lifetimes(kernel(COUNTED.replace("{FIRST}", first).replace("{ROW}", "512")))
        assert not wild.ok and wild.unresolved, wild.summary()


def test_a_per_warp_slot_behind_a_branch_is_bounded_by_it():
    # Warps 4.. (the worker partitions) read a state byte at +1036 + warp, past the barriers at 1024 and 1032:
    # only the branch on the warp index keeps warps 0-3 (bytes 1036..1039) out of the second barrier.
    worker = """
	mov.u32 	%r10, %tid.x;
	shr.u32 	%r11, %r10, 5;
	shfl.sync.idx.b32 	%r12, %r11, 0, 31, -1;
	setp.lt.u32 	%p3, %r12, 4;
	@%p3 bra 	$L__BB0_9;
	add.s32 	%r13, %r2, %r12;
	ld.shared.b8 	%r14, [%r13+1036];
$L__BB0_9:
"""
    report = check_barrier_lifetimes(kernel(INIT + worker + USE + INVAL))
    assert report.ok and report.checked == 3, report.summary()
    unguarded = worker.replace("@%p3 bra", "// @%p3 bra")
    report = check_barrier_lifetimes(kernel(INIT + unguarded + USE + INVAL))
    assert len(report.problems) == 1 and "global_smem+1032" in report.problems[0], report.summary()


def test_terms_split_apart_by_the_compiler_cancel():
    # global_smem + 16376 x - 16128 x = global_smem + 248 x for x in 0..3: bytes 100..847, below the barriers. As two
    # separate ranges the difference would span -48384..49152 and reach them.
    split = """
	and.b32 	%r40, %r1, 3;
	mad.lo.s32 	%r41, %r40, 16376, %r2;
	mad.lo.s32 	%r42, %r40, -16128, %r41;
	ld.shared.b32 	%r43, [%r42+100];
"""
    report = check_barrier_lifetimes(kernel(INIT + split + USE + INVAL))
    assert report.ok and report.checked == 3, report.summary()


# A loop that LLVM placed after the function's end (its preheader jumps there and its exit jumps back): text order
# puts its barrier operations after the inval, the control-flow graph inside the span.
OUT_OF_LINE = """
	bra.uni 	$L__loop;
$L__back:
""" + INVAL + """
	st.shared.b32 	[global_smem+1024], %r1;
	ret;
$L__loop:
""" + USE + """
	setp.lt.s32 	%p2, %r1, 7;
	@%p2 bra 	$L__loop;
	bra.uni 	$L__back;
"""


def test_a_loop_placed_after_the_inval_is_within_the_span_by_the_control_flow_graph():
    report = check_barrier_lifetimes(kernel(INIT + OUT_OF_LINE))
    assert report.ok, report.summary()


def test_an_operation_reachable_from_the_inval_fails():
    """The same loop, entered again after the inval: its wait and arrive may run on invalidated barriers, and its
    load of the passed value touches no barrier (still fine)."""
    again = OUT_OF_LINE.replace("\tret;\n$L__loop:", "\tbra.uni \t$L__loop;\n$L__loop:")
    report = check_barrier_lifetimes(kernel(INIT + again))
    assert len(report.problems) == 2, report.summary()
    assert all("lies outside the init..inval span" in p for p in report.problems), report.summary()


def test_a_store_in_an_out_of_line_loop_into_a_live_barrier_fails():
    """Text order puts the store after the inval; the control-flow graph puts it inside the span."""
    store = OUT_OF_LINE.replace("$L__loop:\n", "$L__loop:\n\tst.shared.b32 \t[global_smem+1032], %r1;\n")
    report = check_barrier_lifetimes(kernel(INIT + store))
    assert any("touches the live barrier global_smem+1032" in p for p in report.problems), report.summary()


# Warp specialisation laid out as Triton does when LLVM puts the worker partitions after the return: the worker
# warps branch off before the inits, wait at the rendezvous (bar.sync 1) and reach their partition's code through a
# jump table; the default partition initialises, starts them at its rendezvous and invalidates after the one that
# ends them. No init dominates the workers' code in the control-flow graph: the rendezvous order it.
SPECIALISED = """
JTI0_0:
	.branchtargets
		$L__part0,
		$L__done;
""" + THREAD0 + """	setp.gt.u32 	%p3, %r1, 255;
	@%p3 bra 	$L__workers;
@INIT@
	barrier.sync 	1;
	barrier.sync 	1;
@INVAL@
	ret;
$L__workers:
	barrier.sync 	1;
	mov.u32 	%r6, 0;
	brx.idx 	%r6, JTI0_0;
$L__part0:
""" + USE + """
	barrier.sync 	1;
	bra.uni 	$L__workers;
$L__done:
"""
_INIT_BODY = INIT.replace(THREAD0, "")


def _specialised(init: str) -> str:
    return SPECIALISED.replace("@INIT@", init).replace("@INVAL@", INVAL)


def test_worker_partitions_after_the_return_are_ordered_by_the_rendezvous():
    report = check_barrier_lifetimes(kernel(_specialised(_INIT_BODY)))
    assert report.ok, report.summary()


def test_an_init_after_the_workers_started_fails():
    """The default partition initialises after its first rendezvous: the workers' wait and arrive may run first."""
    rendezvous = "\tbarrier.sync \t1;\n"
    late = _specialised("").replace(rendezvous * 2, rendezvous + _INIT_BODY + rendezvous, 1)
    report = check_barrier_lifetimes(kernel(late))
    assert len(report.problems) == 2, report.summary()
    assert all("lies outside the init..inval span" in p for p in report.problems), report.summary()
