"""The token mask of a segment-code mask's partial steps in the kernels by key block, from the key block's runs.

With segment codes the mask of a partial [keys, queries] tile is a pair-table lookup per pair
(``rules.allowed_pairs``): in the MMA warpgroups' loop a gather and its address per pair, 32 a thread and step,
which crowded the loop's registers (the two-pass dK/dV kernel spilled in every step with codes at D=128 and
re-read the thread index). But a key block meets few runs (stretches of one code, ``mask.code_lists``), and every
pair's type is that of its row's code against its key's run's code. So, before the partitions start, the program
finds its keys' runs (:func:`find_key_runs`: each key's run within the block and each run's code, in shared
memory), and for a partial step the producer warp stores one word a row instead of the row's code
(:func:`row_words`): 2 bits a run, whether the row sees the run's keys after its position and whether at or before
it (the pair type of the row's code against the run's). An MMA warpgroup then reads a pair's bits from its row's
word at its key's run, a shift it holds per key (:func:`allowed_by_runs`): a shift, a mask and compares, no load.

A word holds ``RUN_SLOTS`` runs; its two top bits stay 0, and keys past the end shift to them (no pair). A key
block that meets more runs (segments of under about 9 tokens) keeps the pair-table lookup: :func:`find_key_runs`
then returns 0 runs, the MMA warpgroups run a step loop of their own with the gather (one loop holding both kept
the gather's registers and spills in every step), and the producer stores the rows' codes.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..constants import FULL, MASK_DENSE, NONE, SEG_BITS

RUN_SLOTS = gl.constexpr(15)  # runs a row's word holds, 2 bits each: bits 30 and 31 are those of keys past the end
_SLOT_TILE = gl.constexpr(16)  # the run codes' shared tile: RUN_SLOTS rounded up to a power of two
_SEG_BITS = gl.constexpr(SEG_BITS)
_SEG_MASK = gl.constexpr((1 << SEG_BITS) - 1)
_NONE = gl.constexpr(NONE)
_FULL = gl.constexpr(FULL)
_MASK_DENSE = gl.constexpr(MASK_DENSE)


@gluon.jit
def block_runs(mask_args, col0, KEYS: gl.constexpr):
    """In a kernel by key block over segment codes, before its partitions start: the runs of keys ``col0 ..``
    (:func:`find_key_runs`) as ``(key_runs, producer_runs)``: ``(key shifts, n_runs)`` for the MMA warpgroups
    (:func:`key_values`) and ``(run codes, n_runs, pair table, its row stride)`` for the producer
    (``dkdv_rows.stage_query_blocks``)."""
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    key_shifts, run_codes = allocate_key_runs(KEYS)
    n_runs = find_key_runs(k_bits_ptr, col0, seq_k, key_shifts, run_codes, KEYS)
    return (key_shifts, n_runs), (run_codes, n_runs, mask_ptr, stride_mask_q)


@gluon.jit
def key_values(offs_n, k_bits_ptr, seq_k, key_runs, FIRST: gl.constexpr, MASK_MODE: gl.constexpr):
    """What an MMA warpgroup holds of its keys ``offs_n`` (the block's keys FIRST ..) for the partial steps' mask:
    the keys' bits or codes, or with ``key_runs`` (:func:`block_runs`) their shifts into the rows' words
    (``common.transposed_mask_bias``)."""
    k_bits = offs_n  # a stand-in: only the bit and code masks read them
    if MASK_MODE != _MASK_DENSE:
        if key_runs is None:
            k_bits = gl.load(k_bits_ptr + offs_n, mask=offs_n < seq_k, other=0)
        else:
            k_bits = key_runs[0].slice(FIRST, offs_n.shape[0]).load(offs_n.type.layout)
    return k_bits


@gluon.jit
def allocate_key_runs(KEYS: gl.constexpr):
    """``(key_shifts, run_codes)``: shared int32 ``[KEYS]`` (each key's bit offset in a row's word) and
    ``[16]`` (the codes of the block's first runs)."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    key_shifts = gl.allocate_shared_memory(gl.int32, [KEYS], layout)
    run_codes = gl.allocate_shared_memory(gl.int32, [_SLOT_TILE], layout)
    return key_shifts, run_codes


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def find_key_runs(k_codes_ptr, col0, seq_k, key_shifts, run_codes, KEYS: gl.constexpr):
    """Run by the kernel's default warps before the partitions start: the runs of keys ``col0 ..`` (codes at
    ``k_codes_ptr``) into ``key_shifts`` and ``run_codes`` (:func:`allocate_key_runs`). Returns the number of
    runs the words hold: the block's runs where they fit ``RUN_SLOTS``, else 0 (the pair-table lookup)."""
    keys: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # a key a thread
    offs = col0 + gl.arange(0, KEYS, layout=keys)
    inside = offs < seq_k
    codes = gl.load(k_codes_ptr + offs, mask=inside, other=0)
    before = gl.load(k_codes_ptr + offs - 1, mask=inside & (offs > col0), other=0)
    starts = (inside & ((offs == col0) | (codes != before))).to(gl.int32)
    run = gl.associative_scan(starts, 0, _add) - 1
    n_runs = gl.max(run, 0) + 1
    key_shifts.store(gl.where(inside & (run < RUN_SLOTS), 2 * run, 2 * RUN_SLOTS))
    grid: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])  # [runs, keys]: a key a thread
    along: gl.constexpr = gl.SliceLayout(0, grid)
    slots = gl.arange(0, _SLOT_TILE, layout=gl.SliceLayout(1, grid))
    first_key = ((gl.expand_dims(gl.convert_layout(run, along), 0) == gl.expand_dims(slots, 1))
                 & gl.expand_dims(gl.convert_layout(starts, along) != 0, 0))
    codes_along = gl.expand_dims(gl.convert_layout(codes, along), 0)
    run_codes.store(gl.max(gl.where(first_key, codes_along, -1), 1))
    return gl.where(n_runs <= RUN_SLOTS, n_runs, 0)


@gluon.jit
def row_words(codes, inside, run_codes, n_runs, table_ptr, stride_table):
    """The producer's words of rows with segment ``codes`` (``inside``: rows before the end; the others get 0):
    for run j < ``n_runs``, bit 2j says whether the row sees the run's keys after its own position (the pair type
    FULL), bit 2j + 1 whether at or before it (FULL or CAUSAL); across docs neither. ``codes`` is one warp's
    ``[rows]`` tensor."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slot_codes = run_codes.load(layout)
    slots = gl.arange(0, _SLOT_TILE, layout=layout)
    words = gl.zeros_like(codes)
    for j in range(n_runs):
        run_code = gl.max(gl.where(slots == j, slot_codes, -1), 0)
        same_doc = inside & (((codes ^ run_code) >> _SEG_BITS) == 0)
        kind = gl.load(table_ptr + (codes & _SEG_MASK) * stride_table + (run_code & _SEG_MASK), mask=same_doc,
                       other=0).to(gl.int32)
        words = words | (((kind == _FULL).to(gl.int32) | ((kind != _NONE).to(gl.int32) << 1)) << (2 * j))
    return words


@gluon.jit
def allowed_by_runs(offs_m, offs_n, words, shifts, q_start, window, IS_CAUSAL: gl.constexpr,
                    HAS_WINDOW: gl.constexpr):
    """The allowed pairs of a partial [keys, queries] tile from its rows' ``words`` and ``offs_m`` ([1, BM]) and
    its keys' ``shifts`` and ``offs_n`` ([keys, 1]): ``rules.allowed_pairs``'s segment-code rule."""
    kinds = words >> shifts
    at_or_before = offs_n <= q_start + offs_m
    if IS_CAUSAL:
        allowed = at_or_before & ((kinds & 2) != 0)
    else:
        allowed = (kinds & gl.where(at_or_before, 2, 1)) != 0
    if HAS_WINDOW:
        allowed = allowed & (offs_n > q_start + offs_m - window)
    return allowed
