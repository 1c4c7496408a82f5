"""The Gluon Hopper kernels compile for sm_90 on any machine, and their PTX keeps every mbarrier's bytes to itself.

Gluon has no CPU interpreter, but Triton's compiler and ptxas ship with the wheel: an API that a Triton release
renamed, or a type error in a kernel, shows here on CPU instead of first on a Hopper GPU. The PTX of each variant
is then read for barrier lifetimes (``tests/kernels/ptx_barriers.py``): every barrier a variant initialises is
invalidated, and no plain shared load or store touches its bytes in between. A barrier left live and unused let Triton's
allocator hand its bytes to the values passed into the warp-specialised partitions: processes sharing a GPU then
crashed (misaligned address, illegal memory access) or hung. The variant count is also checked: only the barriers
a variant uses are initialised (the forward's turn mbarriers only with PINGPONG and ``turns="mbarrier"``). The
forward's consumer loops are counted too (``tests/kernels/ptx_loops.py``): the mbarrier arrives per key block of each
turn scheme; and the dK/dV kernels' PTX is read for a shared-memory load between a matmul's wait and the
exponentials (lse belongs in S^T's initial value, ``rules.lse_in_scores``).

The variants are the tiles the config launches (``config.py``: D=64 and D=128, the forward's 128x64 tile for packs of
short samples, the D=256 forward and dQ candidates ``GLUON_D256``, which must not spill at 240 registers a thread, and
the D=256 dK/dV kernel at ``GLUON_D256["dkdv"]``, which must not spill at all) over the three mask modes (bits, segment
codes, a dense mask), causal and not, the forward's ping-pong on and off, with and without a sliding window, and the
warp-specialised one-pass kernel with a dQ writer warp (``kernels/gluon/bwd_dq_writer.py``, deterministic=False's
backward at D=64 and 128: its dQ adds must be TMA bulk reduce-adds, with no atomic but its ordered variant's counter,
and no spill at all, under Triton 3.6, 3.7 and 3.9). ptxas's report of each dK/dV variant must not say that it
serialized the wgmmas (C7512). All compile in one child process without TRITON_INTERPRET (the interpreter replaces the
``triton.jit`` helpers that the Gluon kernels call), which writes each variant's PTX and ptxas report to a folder.
Run as a script, ``python tests/kernels/test_gluon_compiles.py DIR [SUBSTRING]`` compiles them all (or those whose
name contains SUBSTRING) and prints one line a kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.long_module  # one compile child for every test: minutes


@dataclass(frozen=True)
class Variant:
    kind: str  # "fwd", "fwd_short" (the short-samples forward tile), "dq", "dkdv", "dq_writer" (bwd_dq_writer.py)
    head_dim: int
    mask: str  # "bits", "codes", "dense"
    causal: bool = False
    pingpong: bool | None = None  # the forward's; None: as the config's tile
    window: bool = False  # a sliding window (the kernels' HAS_WINDOW)
    group: int = 2  # query heads per KV head
    turns: str | None = None  # the forward's Tile.turns; None: as the config's tile
    stages: int | None = None  # the tile's gluon_stages; None: as the config's tile
    long: bool = False  # dq_writer only: the tile of longer calls (config.GLUON_DQ_WRITER_LONG, 128 query rows)
    arrival: bool = False  # dkdv only: keys still landing (WAIT_ARRIVAL: a context-parallel rank's fetched keys)
    ordered: bool = False  # dq_writer only: its adds in the key blocks' launch order (ORDERED: deterministic)
    head_section: int = 1  # ordered dq_writer only: key block by key block for this many heads (HEADS_SECTION)

    @property
    def name(self) -> str:
        pp = "" if self.pingpong is None else ("-pingpong" if self.pingpong else "-no-pingpong")
        kind = "dqwriter" if self.kind == "dq_writer" else self.kind
        kind += "-128rows" if self.long else "-arrival" if self.arrival else ""
        kind += "-ordered" if self.ordered else ""
        kind += f"-sections{self.head_section}" if self.head_section > 1 else ""
        turns = "" if self.turns is None else f"-{self.turns}"
        stages = "" if self.stages is None else f"-{self.stages}stages"
        return f"{kind}-D{self.head_dim}-{self.mask}{'-causal' if self.causal else ''}{pp}{turns}{stages}" + (
            "-window" if self.window else "") + ("" if self.group == 2 else f"-group{self.group}")


# Each pass at each head dim, each mask mode at D=128 and one or two at D=64, causal on and off, and the forward's
# ping-pong setting the config does not use. The D=64 forward and the dQ pass at either head dim
# reused barrier bytes before their barriers were invalidated. A variant is a compile of about 5 s: each stands for
# a setting no other one has (the D=128 forward's own tile, ping-pong with named turns, is the one without
# ``turns``; its mbarrier turns are the ``turns="mbarrier"`` one).
VARIANTS = [
    Variant("fwd", 128, "codes"),
    Variant("fwd", 128, "dense", causal=True),
    Variant("fwd", 128, "bits", pingpong=False),
    Variant("fwd", 128, "codes", causal=True, turns="mbarrier"),
    Variant("fwd", 64, "bits"),
    Variant("fwd", 64, "codes", causal=True),
    Variant("fwd", 64, "dense"),
    # D=64 with ping-pong (the config runs it without): each turn scheme, at 2 stages (3 stages with named turns
    # are the D=128 tile's).
    Variant("fwd", 64, "codes", causal=True, pingpong=True, turns="named_release", stages=2),
    Variant("fwd", 64, "bits", causal=True, pingpong=True, turns="mbarrier", stages=2),
    Variant("dq", 128, "bits", causal=True),
    Variant("dq", 128, "dense", causal=True),
    Variant("dq", 64, "bits"),
    Variant("dq", 64, "dense", causal=True),
    Variant("dkdv", 128, "codes"),
    Variant("dkdv", 128, "dense"),
    Variant("dkdv", 64, "bits", causal=True),
    # A sliding window: each pass, each mask mode once. A windowed variant also stands for its mask mode in its pass
    # and tile (the D=128 forward's bits, the short-samples tile, the D=128 dQ pass's codes and dK/dV's bits);
    # the pass's other variants compile without the window (HAS_WINDOW=False; the short-samples tile is the
    # forward kernel's).
    Variant("fwd", 128, "bits", causal=True, window=True),
    Variant("fwd_short", 128, "codes", causal=True, window=True),
    Variant("dq", 128, "codes", window=True),
    Variant("dkdv", 128, "bits", causal=True, window=True),
    Variant("dkdv", 64, "dense", window=True),
    # The dK/dV kernel over keys still landing (a context-parallel rank's fetched keys: WAIT_ARRIVAL), the token
    # bits that rank's one piece has.
    Variant("dkdv", 128, "bits", arrival=True),
    Variant("dkdv", 64, "bits", group=1, arrival=True),
    # D=256 (config.GLUON_D256): the forward and the dQ pass, each mask mode, causal, a window.
    Variant("fwd", 256, "bits", causal=True),
    Variant("fwd", 256, "codes", window=True),
    Variant("fwd", 256, "dense", causal=True, group=4),
    Variant("dq", 256, "bits", causal=True),
    Variant("dq", 256, "codes", window=True),
    Variant("dq", 256, "dense", causal=True, group=4),
    # D=256 dK/dV (kernels/gluon/dkdv_d256.py, GLUON_D256["dkdv"]): each mask mode, causal, a window, GQA 1 and 4.
    Variant("dkdv", 256, "bits", causal=True),
    Variant("dkdv", 256, "codes", window=True, group=1),
    Variant("dkdv", 256, "dense", group=4),
    # The warp-specialised one-pass backward (kernels/gluon/bwd_dq_writer.py, config.GLUON_DQ_WRITER): each head dim,
    # each mask mode, causal, a window, GQA groups 1, 2 and 4; at D=64 also the 128-row tile of longer calls.
    Variant("dq_writer", 128, "bits", causal=True),
    Variant("dq_writer", 128, "codes", window=True, group=1),
    Variant("dq_writer", 128, "dense", group=4),
    Variant("dq_writer", 128, "codes", causal=True, group=4),
    Variant("dq_writer", 64, "bits", group=1),
    Variant("dq_writer", 64, "codes", causal=True, group=4),
    Variant("dq_writer", 64, "dense", causal=True, window=True),
    Variant("dq_writer", 64, "bits", group=1, long=True),
    Variant("dq_writer", 64, "codes", causal=True, group=4, long=True),
    Variant("dq_writer", 64, "dense", causal=True, window=True, long=True),
    # the 128-row tile's whole step under segment codes (lse in S^T without the causal flag; with it the halved step)
    Variant("dq_writer", 64, "codes", long=True),
    # ... and with its adds in order (deterministic=True where config.ordered_dq_writer is set), launched shortest
    # list first (the causal flag, segment codes) and longest first (a bit mask without the flag), one head after
    # the other and in sections of heads (config.ordered_head_section)
    Variant("dq_writer", 128, "bits", causal=True, ordered=True),
    Variant("dq_writer", 64, "codes", causal=True, group=4, long=True, ordered=True),
    Variant("dq_writer", 128, "bits", ordered=True),
    Variant("dq_writer", 64, "bits", long=True, ordered=True, head_section=4),
]
ANY_GLOBAL_ATOMIC = r"\b(?:red|atom)(?:\.[a-z]+)*?\.global\."  # with or without memory-order qualifiers
BULK_REDUCE_ADD = r"\bcp\.reduce\.async\.bulk\.tensor\.3d\.global\.shared::cta\.add\.[a-z_.]*bulk_group\b"
COMPILE_TIMEOUT_S = 900
HOPPER_SHARED_BYTES = 227 * 1024  # the most shared memory one CTA may take on an H100 or H200


def _tile(variant: Variant):
    """The config's tile of the variant's pass, with its ping-pong setting."""
    from dataclasses import replace

    from mmsparse.attention.config import (
        _GLUON_DKDV,
        _GLUON_DQ,
        _GLUON_FWD,
        _GLUON_FWD_SHORT_SAMPLES,
        GLUON_D256,
        GLUON_D256_HEAD_DIM,
        GLUON_DQ_WRITER,
        GLUON_DQ_WRITER_LONG,
    )

    if variant.head_dim == GLUON_D256_HEAD_DIM:
        tile = GLUON_D256[variant.kind]
    else:
        table = {"fwd": _GLUON_FWD, "fwd_short": _GLUON_FWD_SHORT_SAMPLES, "dq": _GLUON_DQ,
                 "dkdv": _GLUON_DKDV,
                 "dq_writer": GLUON_DQ_WRITER_LONG if variant.long else GLUON_DQ_WRITER}
        tile = table[variant.kind][variant.head_dim]
    tile = tile if variant.pingpong is None else replace(tile, pingpong=variant.pingpong)
    tile = tile if variant.stages is None else replace(tile, gluon_stages=variant.stages)
    return tile if variant.turns is None else replace(tile, turns=variant.turns)


def expected_barriers(variant: Variant) -> int:
    """The barriers the variant uses: the forward and dQ passes Q (and dO) once, K-ready, V-ready and release per
    stage (two without ping-pong: K's and V's); dK/dV K and V once, done, ready and release per stage, and
    the dQ writer's dS handshake and staging halves besides; the forward with ping-pong the two turns. Its named
    turns and releases (``turns="named_release"``) are hardware barriers, not mbarriers."""
    tile = _tile(variant)
    if variant.kind == "dkdv" and variant.head_dim == 256:
        return 2 + 2 * tile.gluon_stages + 2  # the hand-over of P^T: staged, read
    if variant.kind == "dkdv":
        return 2 + 2 * tile.gluon_stages
    if variant.kind == "dq_writer":
        return 2 + 2 * tile.gluon_stages + 2 + 4  # the dS handshake; each dQ staging half's full and empty
    if variant.kind == "dq":
        return 1 + 3 * tile.gluon_stages
    if tile.pingpong and tile.turns == "named_release":
        return 1 + 2 * tile.gluon_stages
    # without ping-pong a stage's K and its V are released apart
    return 1 + 3 * tile.gluon_stages + (2 if tile.pingpong else tile.gluon_stages)


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory):
    """Every variant compiled in one child process; its PTX files and the child's output and time."""
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path_factory.mktemp("gluon-ptx")
    # this checkout's mmsparse in the child too, not an installed one
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # a cache of its own: a cached kernel skips ptxas, whose report the spill test reads
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path, TRITON_CACHE_DIR=str(out / "cache"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S)
    print(f"compiled {len(VARIANTS)} Gluon variants in {time.perf_counter() - start:.1f} s")
    return out, proc


def test_gluon_kernels_compile_for_sm90(ptx_dir):
    _, proc = ptx_dir
    assert proc.returncode == 0, proc.stderr[-6000:]
    compiled = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith(" compiled")]
    assert compiled == [v.name for v in VARIANTS], proc.stdout


def _compiled(ptx_dir, variant, suffix: str) -> Path:
    """The compile child's output of ``variant`` with this suffix (".ptx" or ".ptxas.txt"), which must exist."""
    out, proc = ptx_dir
    path = out / f"{variant.name}{suffix}"
    assert path.exists(), f"{variant.name} did not compile:\n{proc.stderr[-3000:]}"
    return path


# The spills Triton 3.6's code generation leaves (3.7 and later leave none), all outside the loops (the thread id
# across the partitions' dispatch, a word of the producer's), as they were timed on the GPU image's Triton 3.6: four
# words of the 128-row D=64 dQ-writer tile's segment-code variant, two of its ordered variant in sections of heads.
# Any other spill, or a larger one, fails.
_TRITON_36_SPILL_STORES = {"dqwriter-128rows-D64-codes-causal-group4": 16,
                           "dqwriter-128rows-ordered-sections4-D64-bits": 8}


def _assert_no_spill(ptx_dir, variant) -> str:
    """The ptxas report of ``variant``, which shows no stack frame, no spill (but :data:`_TRITON_36_SPILL_STORES`
    under Triton 3.6), no serialized wgmma (C7512) and no ignored setmaxnreg (C7508)."""
    import triton

    report = _compiled(ptx_dir, variant, ".ptxas.txt").read_text()
    allowed = _TRITON_36_SPILL_STORES.get(variant.name, 0) if triton.__version__.startswith("3.6.") else 0
    if allowed:
        stores = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        assert stores and max(stores) <= allowed, f"{variant.name}:\n{report}"
    else:
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, f"{variant.name}:\n{report}"
    assert "C7512" not in report and "C7508" not in report, f"{variant.name}:\n{report}"
    return report


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_barriers_are_invalidated_and_their_bytes_not_reused(ptx_dir, variant):
    from tests.kernels.ptx_barriers import check_barrier_lifetimes

    path = _compiled(ptx_dir, variant, ".ptx")
    report = check_barrier_lifetimes(path.read_text())
    assert not report.problems and not report.unresolved, f"{variant.name}:\n{report.summary()}"
    assert len(report.barriers) == expected_barriers(variant), f"{variant.name}:\n{report.summary()}"
    assert report.checked > 0  # the shared accesses were read, not skipped


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind == "dq_writer"], ids=lambda v: v.name)
def test_one_pass_bulk_adds_dq_by_tma_reduce(ptx_dir, variant):
    """The one-pass kernel adds dQ only by TMA bulk reduce-adds through the ``[B * Hq, Sq, D]`` dQ descriptor (rows
    past Sq are dropped per head), waits for them before it reuses the staging tile, and has no global atomic but,
    with its adds in order, the counter's: an acquire load before each step's adds, and after them a wait for their
    writes (not only their reads) before one release add."""
    path = _compiled(ptx_dir, variant, ".ptx")
    ptx = path.read_text()
    assert re.search(BULK_REDUCE_ADD, ptx), f"{variant.name}: no TMA bulk reduce-add in the PTX"
    assert "cp.async.bulk.commit_group" in ptx and "cp.async.bulk.wait_group" in ptx, variant.name
    atomics = re.findall(ANY_GLOBAL_ATOMIC + r"\S*", ptx)
    counting = {"red.release.gpu.global.add.s32"} if variant.ordered else set()  # (the code may hold copies)
    assert set(atomics) == counting, f"{variant.name}: {atomics}"
    assert ("ld.acquire.gpu.global.b32" in ptx) == variant.ordered, variant.name
    assert bool(re.search(r"cp\.async\.bulk\.wait_group 0;", ptx)) == variant.ordered, variant.name


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind in ("dkdv", "dq_writer")], ids=lambda v: v.name)
def test_dkdv_wgmmas_are_not_serialized(ptx_dir, variant):
    """ptxas did not serialize the dK/dV kernel's wgmmas for want of registers (C7512): the pipeline would be
    gone; and the kernel fits a Hopper SM's shared memory. Spills are printed for the record."""
    path = _compiled(ptx_dir, variant, ".ptxas.txt")
    report = path.read_text()
    assert "Function properties" in report, f"{variant.name}: no ptxas report:\n{report}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    print(variant.name, "spill stores / loads:", spills)
    assert "C7512" not in report, f"{variant.name}:\n{report}"
    shared = int(re.search(r"shared memory: (\d+) bytes", report).group(1))
    assert shared <= HOPPER_SHARED_BYTES, f"{variant.name}: {shared} bytes of shared memory"


# Spill stores of the two-pass dK/dV kernel at D=128, at most: with its K and V descriptors hoisted out of the loop
# it spilled 140-168 B (Triton 3.9) and 40-104 B (3.6); made in each step, 20-32 and 0-68.
D128_DKDV_MAX_SPILL_STORES = 72
# Under segment codes: spill stores in each MMA warpgroup's step loop over the key block's runs (the loop of every
# block of up to key_runs.RUN_SLOTS runs), at most (Triton 3.6 and 3.9: 2 and 4; 3.7.1: none). The kernel's other
# step loop, the pair table's (blocks of more runs), spills as the one loop did before the runs (3.6: 7 and 8).
D128_DKDV_MAX_RUNS_LOOP_SPILL_STORES = 4


def _step_loops(ptx_dir, variant) -> list:
    """The innermost loops that issue wgmmas in ``variant``'s SASS (``tools.sass_loops``: assembled by the ptxas of
    this Triton), in the order of the code."""
    import tempfile

    from tools.sass_loops import disassemble, loops

    with tempfile.TemporaryDirectory() as work:
        sass = disassemble(_compiled(ptx_dir, variant, ".ptx"), Path(work))
    return [loop for loop in loops(sass) if loop.counts["hgmma"]]


def _runs_loops(ptx_dir, variant) -> list:
    """A segment-code variant's step loops over the key block's runs: of its two loops per MMA warpgroup, the one
    without global loads (the other reads the pair table)."""
    step_loops = _step_loops(ptx_dir, variant)
    runs = [loop for loop in step_loops if not loop.counts["ldg"]]
    assert len(step_loops) == 4 and len(runs) == 2, f"{variant.name}: {step_loops}"
    return runs


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind == "dkdv" and v.head_dim == 128],
                         ids=lambda v: v.name)
def test_d128_dkdv_spills_at_most_a_few_words(ptx_dir, variant):
    """The deterministic backward's dK/dV pass at D=128 (two 64 x 128 float32 accumulators a warpgroup) spills at most
    a few words under any Triton from 3.6 on, and serializes no wgmma (C7512). Under segment codes, whose kernel
    has a second step loop per warpgroup for key blocks of many runs, the loops over the runs spill at most a few
    stores each (the kernel's bytes are printed)."""
    report = _compiled(ptx_dir, variant, ".ptxas.txt").read_text()
    stores = [int(a) for a in re.findall(r"(\d+) bytes spill stores", report)]
    assert "C7512" not in report and "C7508" not in report, f"{variant.name}:\n{report}"
    if variant.mask != "codes":
        assert stores and max(stores) <= D128_DKDV_MAX_SPILL_STORES, f"{variant.name}:\n{report}"
        return
    print(variant.name, "spill stores:", stores)
    for loop in _runs_loops(ptx_dir, variant):
        assert loop.counts["stl"] <= D128_DKDV_MAX_RUNS_LOOP_SPILL_STORES, f"{variant.name}: {loop}"


# Spill stores of a D=256 variant, at most: with its resident Q / dO descriptors hoisted out of the loop
# (gluon.common.resident_tile) the forward at 64-key tiles and the dQ pass spilled 140-320 bytes, inside the loop.
D256_MAX_SPILL_STORES = 64


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.head_dim == 256], ids=lambda v: v.name)
def test_d256_variants_spill_at_most_a_few_words(ptx_dir, variant):
    """At D=256 the forward and the dQ pass hold a 64 x 256 fp32 accumulator (128 of a thread's 240 registers), and
    so does each consumer warpgroup of the dK/dV kernel (dV in one, dK in the other): ptxas did not serialize their
    wgmmas (C7512) nor ignore setmaxnreg (C7508), spilled at most a few words (where measured: none in the forward;
    in the dQ pass outside the loop, and one reload in its masked path with segment codes; none at all in dK/dV,
    which has a test of its own), and the shared memory it allots is within a Hopper CTA's and matches
    config.gluon_tile_problem's count."""
    from mmsparse.attention.config import _GLUON_SHARED_SLACK, dkdv_d256_shared_bytes, gluon_tile_problem

    path = _compiled(ptx_dir, variant, ".ptxas.txt")
    report = path.read_text()
    assert "Function properties" in report, f"{variant.name}: no ptxas report:\n{report}"
    stores = [int(a) for a, _ in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)]
    assert stores and max(stores) <= D256_MAX_SPILL_STORES, f"{variant.name}:\n{report}"
    assert "C7512" not in report and "C7508" not in report, f"{variant.name}:\n{report}"
    shared = int(re.search(r"shared memory: (\d+) bytes", report).group(1))
    tile = _tile(variant)
    assert shared <= HOPPER_SHARED_BYTES and gluon_tile_problem(variant.kind, tile, 256) is None, variant.name
    row_bytes = 2 * 256
    if variant.kind == "dkdv":
        # the count holds a query-bit row per stage, which a dense mask does not read (one row stands in)
        unread = (tile.gluon_stages - 1) * tile.block_m * 4 if variant.mask == "dense" else 0
        counted = dkdv_d256_shared_bytes(tile) - unread
    else:
        counted = (1 if variant.kind == "fwd" else 2) * tile.block_m * row_bytes + \
            tile.gluon_stages * 2 * tile.block_n * row_bytes
    assert counted <= shared <= counted + _GLUON_SHARED_SLACK, f"{variant.name}: {shared} bytes, {counted} counted"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind == "dkdv" and v.head_dim == 256],
                         ids=lambda v: v.name)
def test_d256_dkdv_does_not_spill(ptx_dir, variant):
    """The D=256 dK/dV kernel keeps everything in registers (warpgroup 0 gets 248 a thread, warpgroup 1 216, the
    producer 40: kernels/gluon/dkdv_d256.py says why): no stack frame, no spill store or load, with Triton 3.9's
    ptxas and with 3.6's."""
    _assert_no_spill(ptx_dir, variant)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind == "dq_writer"], ids=lambda v: v.name)
def test_dq_writer_does_not_spill(ptx_dir, variant):
    """The warp-specialised one-pass kernel keeps everything in registers at its split (kernels/gluon/bwd_dq_writer.py:
    both MMA warpgroups 240 a thread, the producer and the dQ writer warps 24): no stack frame, no spill, no
    serialized wgmma (C7512) nor ignored setmaxnreg (C7508); its shared memory is what
    config.dq_writer_shared_bytes counts, plus the barriers and alignment (and the key block's runs under segment
    codes). Under segment codes, whose kernel has a second step loop per warpgroup for key blocks of many runs (the
    pair table's, spilling a few words with the causal flag), the loops over the runs store no spill and reload at
    most one word a step."""
    from mmsparse.attention.config import _GLUON_SHARED_SLACK, KEY_RUNS_BYTES, dq_writer_shared_bytes
    from mmsparse.kernels.gluon.bwd_dq_writer import WORKER_REGS

    if variant.mask == "codes":
        report = _compiled(ptx_dir, variant, ".ptxas.txt").read_text()
        assert "C7512" not in report and "C7508" not in report, f"{variant.name}:\n{report}"
        print(variant.name, "spill stores:", re.findall(r"(\d+) bytes spill stores", report))
        for loop in _runs_loops(ptx_dir, variant):
            assert loop.counts["stl"] == 0 and loop.counts["ldl"] <= 1, f"{variant.name}: {loop}"
    else:
        report = _assert_no_spill(ptx_dir, variant)
    ptx = _compiled(ptx_dir, variant, ".ptx").read_text()
    regs = {int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert set(WORKER_REGS.value) <= regs, f"{variant.name}: setmaxnreg {sorted(regs)}"
    tile = _tile(variant)
    # the count holds a query-bit row per stage, which a dense mask does not read (one row stands in)
    unread = (tile.gluon_stages - 1) * tile.block_m * 4 if variant.mask == "dense" else 0
    runs = KEY_RUNS_BYTES if variant.mask == "codes" else 0
    counted = dq_writer_shared_bytes(tile, variant.head_dim) - unread + runs
    shared = int(re.search(r"shared memory: (\d+) bytes", report).group(1))
    assert counted <= shared <= counted + _GLUON_SHARED_SLACK <= HOPPER_SHARED_BYTES, f"{variant.name}: {shared} B"



@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind == "dq_writer" and v.long], ids=lambda v: v.name)
def test_dq_writer_128_rows_take_whole_steps_where_lse_is_in_the_scores(ptx_dir, variant):
    """The 128-row D=64 tile issues S^T and dP^T of all 128 rows at once (m64n128 wgmmas: no other matmul of the
    kernel is 128 wide) where lse is in S^T's initial value, and 64-row halves where it is not (segment codes with
    the causal flag, whose whole step spilled)."""
    from mmsparse.kernels.constants import MASK_BITS, MASK_DENSE, MASK_SEGMENTS
    from mmsparse.kernels.rules import lse_in_scores

    mode = {"bits": MASK_BITS, "codes": MASK_SEGMENTS, "dense": MASK_DENSE}[variant.mask]
    ptx = _compiled(ptx_dir, variant, ".ptx").read_text()
    whole = "wgmma.mma_async.sync.aligned.m64n128k16." in ptx
    assert whole == lse_in_scores(mode, variant.causal, variant.head_dim), variant.name

FORWARD_VARIANTS = [v for v in VARIANTS if v.kind in ("fwd", "fwd_short")]


def expected_arrives_per_block(variant: Variant) -> int:
    """mbarrier arrives of a forward consumer warpgroup per key block (Gluon puts a warpgroup-wide bar.sync before
    each): without ping-pong the stage's K and its V released apart; with turn mbarriers the stage's release and
    the turn hand-off; named barriers hand the turn over and release the stages without one."""
    tile = _tile(variant)
    if tile.pingpong and tile.turns == "named_release":
        return 0
    return 2


@pytest.mark.parametrize("variant", FORWARD_VARIANTS, ids=lambda v: v.name)
def test_forward_arrives_per_key_block(ptx_dir, variant):
    from tests.kernels.ptx_loops import counts, matmul_loops

    path = _compiled(ptx_dir, variant, ".ptx")
    loops = [counts(seq) for seq in matmul_loops(path.read_text())]
    assert len(loops) == 2, f"{variant.name}: {loops}"  # one steady-state loop per consumer warpgroup
    released_by_name = _tile(variant).pingpong and _tile(variant).turns == "named_release"
    for loop in loops:
        assert loop["mbarrier.arrive"] == expected_arrives_per_block(variant), f"{variant.name}: {dict(loop)}"
        assert loop["bar.arrive reg, 288"] == released_by_name, f"{variant.name}: {dict(loop)}"


_BARRIER = re.compile(
    r"^\s*(?:@%p\d+\s+)?(?:bar|barrier)\.(?:cta\.)?(sync|arrive|red\.\w+)(?:\.aligned)?\s+(\d+|%r\d+)(?:,\s*(\d+))?")


def test_named_turns_keep_clear_of_tritons_barriers(ptx_dir):
    """The forward's named barriers use ids that none of Triton's own barriers use (warp specialisation's
    rendezvous and each partition's bar.sync): the turns only ever over the two consumer warpgroups' 256 threads,
    the releases (ids from RELEASE_BARRIER_ID on, in a register) over those and the producer warp's 288, and only in
    the variants that take turns or release stages through them."""
    from mmsparse.kernels.gluon.forward import RELEASE_BARRIER_ID, TURN_BARRIER_IDS

    ours_ids = {*TURN_BARRIER_IDS, *range(RELEASE_BARRIER_ID.value, 16)}
    out, _ = ptx_dir
    named = 0
    for variant in VARIANTS:
        lines = (out / f"{variant.name}.ptx").read_text().splitlines()
        uses = [m.groups() for line in lines if (m := _BARRIER.match(line))]
        tile = _tile(variant)
        turns = tile.turns if variant.kind in ("fwd", "fwd_short") and tile.pingpong else None
        mine = {(op, bar, threads) for op, bar, threads in uses if bar.startswith("%") or int(bar) in ours_ids}
        theirs = {int(bar) for op, bar, threads in uses if not bar.startswith("%") and int(bar) not in ours_ids}
        assert 0 in theirs or 1 in theirs, f"{variant.name}: no barrier of Triton's found: {uses[:5]}"
        turn_uses = {(op, str(bar), "256") for op in ("sync", "arrive") for bar in TURN_BARRIER_IDS}
        if turns == "named_release":
            releases = {(op, threads) for op, bar, threads in mine - turn_uses if bar.startswith("%")}
            assert mine - turn_uses and releases == {("sync", "288"), ("arrive", "288")}, f"{variant.name}: {mine}"
            assert turn_uses <= mine, f"{variant.name}: {mine}"
        else:
            assert not mine, f"{variant.name} uses barrier ids {sorted(ours_ids)}: {mine}"
        named += turns == "named_release"
    assert named > 0


@pytest.mark.parametrize("variant", [v for v in FORWARD_VARIANTS], ids=lambda v: v.name)
def test_named_turns_fence_each_turns_matmuls(ptx_dir, variant):
    """With named turn barriers, each consumer loop iteration waits on its own turn barrier before its first wgmma
    and arrives on the other warpgroup's after committing both groups: the inline assembly stayed where it was
    written (LLVM may rotate the loop, so the order is read cyclically from the wait)."""
    from mmsparse.kernels.gluon.forward import TURN_BARRIER_IDS
    from tests.kernels.ptx_loops import matmul_loops

    tile = _tile(variant)
    if not (tile.pingpong and tile.turns == "named_release"):
        pytest.skip("no named turns")
    out, _ = ptx_dir
    loops = matmul_loops((out / f"{variant.name}.ptx").read_text())
    assert len(loops) == 2, f"{variant.name}: {loops}"
    for seq in loops:
        named = [i for i, k in enumerate(seq) if k.startswith("bar.sync") and k.endswith(", 256")]
        assert len(named) == 1, f"{variant.name}: {seq}"
        seq = seq[named[0]:] + seq[: named[0]]  # from the turn's wait on
        own = int(seq[0].split()[1].rstrip(","))
        other = TURN_BARRIER_IDS[1 - TURN_BARRIER_IDS.index(own)]
        events = " ".join("mma" if k == "wgmma.mma_async" else "commit" if k == "wgmma.commit_group" else
                          k.replace(" ", "") for k in seq if k.endswith(", 256") or k.startswith("wgmma."))
        pattern = rf"bar.sync{own},256( mma)+ commit( mma)+ commit bar.arrive{other},256"
        assert re.fullmatch(pattern, events), f"{variant.name}: {events}"


def _lse_first(variant: Variant) -> bool:
    from mmsparse.attention.config import head_dim_pad
    from mmsparse.kernels.constants import MASK_BITS, MASK_DENSE, MASK_SEGMENTS
    from mmsparse.kernels.rules import lse_in_scores

    mode = {"bits": MASK_BITS, "codes": MASK_SEGMENTS, "dense": MASK_DENSE}[variant.mask]
    return lse_in_scores(mode, variant.causal, head_dim_pad(variant.head_dim))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind in ("dkdv", "dq_writer") and _lse_first(v)],
                         ids=lambda v: v.name)
def test_lse_is_in_the_scores_before_their_matmul(ptx_dir, variant):
    """Where ``rules.lse_in_scores`` holds, the dK/dV kernels issue S^T onto -lse / scale: no shared-memory load (of
    lse) stands between a matmul's wait and the exponentials that follow it (the dQ-writer kernel ran 1.04-1.06x
    faster once that load moved before the matmul)."""
    from tests.kernels.ptx_loops import shared_loads_before_exponentials

    ptx = _compiled(ptx_dir, variant, ".ptx").read_text()
    assert "ex2.approx" in ptx, variant.name
    assert shared_loads_before_exponentials(ptx) == 0, variant.name


_SECTION_DIVISIONS = 2


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind in ("dkdv", "dq_writer") and not v.arrival],
                         ids=lambda v: v.name)
def test_dkdv_steps_divide_no_integer(ptx_dir, variant):
    """The dK/dV kernels (two-pass, D=256 and the dQ writer's) walk their list entries by a counter
    (``common.next_entry``), not ``i % n_total``: a remainder by a runtime value is an integer division a step
    (``MUFU.RCP`` and its fix-up in the SASS, about 2.5% of the D=64 pass's warp stall samples on an H200; the
    two-pass backward ran 1.003-1.032x without it)."""
    ptx = _compiled(ptx_dir, variant, ".ptx").read_text()
    divisions = re.findall(r"\b(?:rem|div)\.[su](?:32|64)\b", ptx)
    # in sections of heads, the program's place and head, worked out once before any step
    # (dkdv_rows._heads_in_sections: its launch position by the section's programs, then by its heads)
    allowed = _SECTION_DIVISIONS if variant.head_section > 1 else 0
    assert len(divisions) == allowed, f"{variant.name}: {len(divisions)} integer divisions"


# ---------------------------------------------------------------------------------------------------------------
# The child: compile, don't launch


def _compile_launch(name: str, out: Path, kernel, args, kwargs) -> None:
    """What ``kernel[grid](*args, **kwargs)`` would compile, built for sm_90 instead of launched; its PTX to
    ``out/<name>.ptx``, ptxas's report (registers, spills, warnings) to ``out/<name>.ptxas.txt``."""
    import contextlib
    import io

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from mmsparse.runtime.launch import PINNED_OPTIONS

    kwargs = {**PINNED_OPTIONS, **kwargs}  # as FastKernel launches it
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # ptxas's -v report (knobs.nvidia.dump_ptxas_log)
        compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    ptx = compiled.asm["ptx"]
    assert "wgmma" in ptx, name  # the Hopper matmuls, not a fallback
    (out / f"{name}.ptx").write_text(ptx)
    (out / f"{name}.ptxas.txt").write_text(log.getvalue() + f"\nshared memory: {compiled.metadata.shared} bytes\n")
    print(name, "compiled", flush=True)


def _mask_info(mask: str, causal: bool, seq: int, window: bool):
    import torch

    from mmsparse.mask.build import build_mask_info
    from mmsparse.mask.info import MaskInfo

    lens = [[150, 150, seq - 300]]
    w = 100 if window else None
    if mask == "dense":
        return MaskInfo.from_dense(torch.rand(1, seq, seq) < 0.5, causal, w)
    # Pair type 2 (causal within a pair) makes the segment-code mask; a 0/1 topology the bit mask.
    topology = [[2, 1, 0], [0, 2, 1], [1, 0, 2]] if mask == "codes" else [[1, 1, 0], [0, 1, 1], [1, 0, 1]]
    return build_mask_info(topology, lens, seq, seq, causal, torch.device("cpu"), window=w)


def _main(out: Path, only: str = "") -> None:
    import torch
    from triton import knobs

    from mmsparse.attention import gluon_launch
    from mmsparse.attention.kernel_args import kernel_args
    from mmsparse.kernels.constants import MASK_BITS, MASK_DENSE, MASK_SEGMENTS
    from mmsparse.mask.add_order import adds_shortest_first, lists_add_ranks
    from mmsparse.runtime.arrival import KeysArrival

    current = {}

    class Compile:
        def __init__(self, launcher):
            self.kernel = launcher.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: _compile_launch(current["name"], out, self.kernel, args, kwargs)

    knobs.nvidia.dump_ptxas_log = True
    gluon_launch._FWD, gluon_launch._DQ, gluon_launch._DKDV, gluon_launch._DKDV_D256, gluon_launch._DQ_WRITER = (
        Compile(gluon_launch._FWD), Compile(gluon_launch._DQ), Compile(gluon_launch._DKDV),
        Compile(gluon_launch._DKDV_D256), Compile(gluon_launch._DQ_WRITER))
    modes = {"bits": MASK_BITS, "codes": MASK_SEGMENTS, "dense": MASK_DENSE}
    batch, heads, seq = 1, 4, 384
    infos = {}
    for variant in VARIANTS:
        if only not in variant.name:
            continue
        kv_heads = heads // variant.group
        key = (variant.mask, variant.causal, variant.window)
        if key not in infos:
            infos[key] = _mask_info(variant.mask, variant.causal, seq, variant.window)
        info = infos[key]
        assert info.mode == modes[variant.mask], variant.name
        q = torch.randn(batch, heads, seq, variant.head_dim, dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, seq, variant.head_dim, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        rows = torch.zeros(batch, heads, seq)
        tile = _tile(variant)
        current["name"] = variant.name
        by_key = variant.kind in ("dkdv", "dq_writer")
        info.prepare([(tile.block_m, tile.block_n, by_key)])
        mask = (kernel_args(info).tile(tile.block_m, tile.block_n, by_key), info.mode, info.causal)
        assert (info.window is not None) == variant.window, variant.name
        if variant.kind in ("fwd", "fwd_short"):
            gluon_launch.run_forward(q, k, v, *mask, 1.0, tile, variant.window)
        elif variant.kind == "dq":
            gluon_launch.run_dq(q, k, v, q.clone(), rows, rows, torch.empty_like(q), *mask, 1.0, 1.0, tile,
                                variant.window)
        elif variant.kind == "dq_writer":
            order = None
            shortest_first = adds_shortest_first(info.mode, info.causal)  # as the backward launches it
            if variant.ordered:
                counts, indices = mask[0][0][3], mask[0][0][4]
                query_blocks = -(-seq // tile.block_m)
                order = (torch.zeros(batch * heads * query_blocks, dtype=torch.int32),
                         lists_add_ranks(counts, indices, query_blocks, 132 // variant.head_section, shortest_first),
                         query_blocks)
            gluon_launch.run_bwd_dq_writer(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)),
                                           torch.zeros(q.shape), *mask, 1.0, 1.0, tile, variant.window, order=order,
                                           shortest_first=shortest_first, head_section=variant.head_section)
        elif variant.head_dim == 256:
            gluon_launch.run_dkdv_d256(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)),
                                       *mask, 1.0, 1.0, tile, variant.window)
        else:
            arrival = KeysArrival(torch.zeros(1, dtype=torch.int32), 3, 256, lambda: None) if variant.arrival else None
            gluon_launch.run_dkdv(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)), *mask,
                                  1.0, 1.0, tile, variant.window, arrival=arrival)


if __name__ == "__main__":
    # python tests/kernels/test_gluon_compiles.py DIR [SUBSTRING]: the variants whose name contains SUBSTRING
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd() / "gluon-ptx"
    target.mkdir(parents=True, exist_ok=True)
    _main(target, sys.argv[2] if len(sys.argv) > 2 else "")
