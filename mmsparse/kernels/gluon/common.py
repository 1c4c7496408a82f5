"""What the three Gluon passes share: the program's block list and mask bundle, the token mask of a partial tile,
the producer's K/V ring, and the start-up and tear-down they have in common (the ring's shared tiles and barriers,
the resident tiles' loads).

The mask bundle is a tuple that every pass unpacks by these names, never reads by position::

    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args

(``q_bits_ptr``/``k_bits_ptr`` hold bits or segment codes, ``mask_ptr`` the dense mask or the pair table: see
:func:`mmsparse.kernels.rules.allowed_pairs`).

Barrier lifetimes: a kernel initialises only the barriers its variant uses, fences the inits before any TMA copy
can signal them, and invalidates every one of them once ``gl.warp_specialize`` has returned. Past a barrier's last
use Triton's shared-memory allocator may give its bytes to other values (among them those passed into the
partitions); PTX allows that only after the barrier is invalidated.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

from ..constants import MASK_DENSE
from ..lists import WORDS_PER_ROW, block_id
from ..rules import allowed_pairs
from .key_runs import allowed_by_runs

# Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; later releases
# call them async_load / async_store (same arguments) and make the old names raise or drop them.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed likewise (a CTA-wide barrier)


def _tma_reduce_add_builtin():
    """Triton 3.6 and 3.7 have the builder's bulk tensor reduction (``cp.reduce.async.bulk.tensor``) but no Gluon
    wrapper for it; 3.8 adds ``tma.async_atomic_add``, which calls the same builder method."""
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def async_atomic_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    return async_atomic_add


# A TMA bulk reduce-add of a shared tile into global memory through a descriptor (one bulk group; tma.store_wait
# waits for it like for a store).
tma_atomic_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_builtin()

WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one m64 wgmma)
# The warp roles of every pass: the default partition and the second consumer are a warpgroup each; the producer is
# one warp that only issues TMA copies.
WORKER_WARPS = gl.constexpr([4, 1])
# Registers per thread once the partitions have set their own: the consumers hold the fp32 accumulators, the
# producer almost nothing (2 x 128 x 240 + 32 x 24 fit an SM's 64K).
WORKER_REGS = gl.constexpr([240, 24])
BLOCK_M = 2 * WG_ROWS.value  # query rows per CTA in the forward and dQ passes
# Named hardware barriers (bar.sync / bar.arrive with an id; 16 per CTA) that a kernel uses itself. Triton's warp
# specialisation takes id 0 (the default warpgroup's barriers), 1 (the partitions' start and end) and 2 + i (worker
# partition i's; a one-warp partition uses bar.warp.sync instead), so the ids from 2 + len(WORKER_WARPS) are free.
FIRST_FREE_BARRIER_ID = 2 + len(WORKER_WARPS.value)
_MASK_DENSE = gl.constexpr(MASK_DENSE)
# Up to this head dim a resident A operand's wgmma descriptors may be hoisted out of the consumers' loops; past it
# they are recomputed in each iteration (:func:`resident_tile`).
HOISTED_DESCRIPTORS_MAX_D = gl.constexpr(128)


def named_barrier_asm(op: str, barrier_id: int | None, threads: int) -> gl.constexpr:
    """The PTX of :func:`named_barrier`: ``bar.sync`` (wait until ``threads`` threads arrived, counting this one) or
    ``bar.arrive`` (count this thread, don't wait) on barrier ``barrier_id`` (None: the id is the asm's operand $1,
    for :func:`named_barrier_at`)."""
    free = barrier_id is None or FIRST_FREE_BARRIER_ID <= barrier_id < 16
    if op not in ("sync", "arrive") or not free or threads % 32:
        raise ValueError(f"named barrier: op sync or arrive, id in {FIRST_FREE_BARRIER_ID}..15, threads a multiple "
                         f"of 32; got {op!r}, {barrier_id}, {threads}")
    return gl.constexpr(f"bar.{op} {'$1' if barrier_id is None else barrier_id}, {threads};\n\tmov.u32 $0, 0;")


@gluon.jit
def named_barrier(ASM: gl.constexpr):
    """Run the named-barrier instruction ``ASM`` (:func:`named_barrier_asm`) once in every thread. It is inline
    assembly with a side effect, which the compiler keeps in place: not hoisted, merged or dropped (the value it
    has to return is unused)."""
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def named_barrier_at(ASM: gl.constexpr, barrier_id):
    """:func:`named_barrier` with the id in a register: ``ASM`` from ``named_barrier_asm(op, None, threads)``, the id
    a warp-uniform int32."""
    gl.inline_asm_elementwise(ASM, "=r,r", [barrier_id], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def box(smem):
    """A ``[rows, D_pad]`` shared tile seen as the ``[1, 1, rows, D_pad]`` box of a host ``box_descriptor``."""
    return smem.reshape([1, 1, smem.shape[0], smem.shape[1]])


@gluon.jit
def wait_for_arrival(flag_ptr, epoch):
    """Spin until the int32 at ``flag_ptr`` reads ``epoch`` or more (an acquire load at GPU scope; the flag is
    written by a stream memory operation once the keys' copies have landed, with no SM), then order this thread's
    later TMA loads (the async proxy) after that acquire."""
    seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flag_ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)
    while seen < epoch:
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [flag_ptr],
                                         dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def opaque_zero():
    """A zero that LLVM cannot see through (side-effecting asm: neither hoisted nor folded, so nothing derived from
    it is loop-invariant): a shared tile indexed with it inside a loop has its wgmma descriptors made where it is
    used (a few integer adds) instead of hoisted out of the loop and held in registers across it."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def key_step_zero(HEAD_DIM_PAD: gl.constexpr):
    """The index offset of a dK/dV loop's K, V and dS^T tiles in each step: 0 up to D=64, else :func:`opaque_zero`,
    so that past D=64 their wgmma descriptors are made in each step. Hoisted out of the loop beside dK and dV (128
    registers a thread at D=128), they made the loop spill: 204-304 B in the dQ-writer kernel under Triton 3.6 and
    3.7, 140-168 B in the two-pass dK/dV kernel under 3.9."""
    zero = 0
    if HEAD_DIM_PAD > 64:
        zero = opaque_zero()
    return zero


@gluon.jit
def resident_tile(smem, WG: gl.constexpr, HEAD_DIM_PAD: gl.constexpr):
    """Warpgroup WG's tile of a resident ``[2, rows, D_pad]`` allocation (Q, dO), as the A operand of a wgmma inside
    a loop. Past HOISTED_DESCRIPTORS_MAX_D its index goes through a zero that LLVM cannot see through, so the tile's
    shared-memory descriptors are remade in each iteration (a few integer adds) instead of hoisted out of the loop:
    at D=256 they are 16 64-bit values per operand, 32 registers held across the loop, and ptxas spilled them and
    their neighbours inside the loop rather than recompute them."""
    index = WG
    if HEAD_DIM_PAD > HOISTED_DESCRIPTORS_MAX_D:
        index = WG + opaque_zero()
    return smem.index(index)


@gluon.jit
def program_lists(b, blk, COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b,
                  stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b, seq_q, seq_k,
                  stride_qstart_b, window):
    """One program's block list and mask bundle (``tl.common.program_setup`` for the Gluon kernels): ``(n_full,
    n_total, idx_ptr, mask_args)`` for batch b; the list of row (or key) block blk starts with its n_full full
    blocks."""
    b64 = b.to(gl.int64)  # B samples' lists of up to 2^31 entries each
    cnt_ptr = COUNTS + b64 * stride_cnt_b + blk * WORDS_PER_ROW
    n_full = gl.load(cnt_ptr)
    n_total = n_full + gl.load(cnt_ptr + 1)
    idx_ptr = INDICES + b64 * stride_idx_b + gl.load(cnt_ptr + 2)  # the list starts at counts' third word
    mask_args = (Q_BITS + b64 * stride_qbits_b, K_BITS + b64 * stride_kbits_b, MASK + b64 * stride_mask_b,
                 stride_mask_q, seq_q, seq_k, gl.load(Q_START + b * stride_qstart_b), window)
    return n_full, n_total, idx_ptr, mask_args


@gluon.jit
def masked_scores(s, offs_m, q_bits, n_blk, mask_args, BN: gl.constexpr, MASK_MODE: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """The exact token mask of one partial [rows, keys] score tile (key block ``n_blk``): disallowed scores ->
    -inf. ``q_bits`` are the rows' bits or codes (a dense mask reads none)."""
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    offs_n = n_blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    k_bits = offs_n  # a stand-in: a dense mask reads no bits
    if MASK_MODE != _MASK_DENSE:
        k_bits = gl.load(k_bits_ptr + offs_n, mask=offs_n < seq_k, other=0)
    allowed = allowed_pairs(gl.expand_dims(offs_m, 1), gl.expand_dims(offs_n, 0), gl.expand_dims(q_bits, 1),
                            gl.expand_dims(k_bits, 0), mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window,
                            MASK_MODE, IS_CAUSAL, HAS_WINDOW)
    return gl.where(allowed, s, float("-inf"))


@gluon.jit
def transposed_mask_bias(offs_n, k_bits, rows_s, qbits_s, mask_args, cols: gl.constexpr, MASK_MODE: gl.constexpr,
                         IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, key_runs=None):
    """The dK/dV passes' exact token mask of one partial [keys, queries] tile
    (:func:`mmsparse.kernels.rules.allowed_pairs`) as the initial value of S^T: 0 where allowed, -inf elsewhere
    (p = exp2(-inf) = 0). The bits of keys and queries past the end are 0. With ``key_runs`` (segment codes in a
    kernel by key block whose key block's runs fit the rows' words: :mod:`.key_runs`) ``qbits_s`` holds the rows'
    words and ``k_bits`` the keys' shifts into them."""
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    offs_m = rows_s.load(cols)
    q_bits = offs_m  # a stand-in: a dense mask reads no bits
    if MASK_MODE != _MASK_DENSE:
        q_bits = qbits_s.load(cols)
    if key_runs is None:
        allowed = allowed_pairs(gl.expand_dims(offs_m, 0), gl.expand_dims(offs_n, 1), gl.expand_dims(q_bits, 0),
                                gl.expand_dims(k_bits, 1), mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window,
                                MASK_MODE, IS_CAUSAL, HAS_WINDOW)
    else:
        allowed = allowed_by_runs(gl.expand_dims(offs_m, 0), gl.expand_dims(offs_n, 1), gl.expand_dims(q_bits, 0),
                                  gl.expand_dims(k_bits, 1), q_start, window, IS_CAUSAL, HAS_WINDOW)
    return gl.where(allowed, 0.0, float("-inf"))


@gluon.jit
def scores_init(it, n_full, rows_s, qbits_s, offs_n, k_bits, mask_args, st_zero, MASK_MODE: gl.constexpr,
                IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, key_runs=None):
    """The accumulator the dK/dV passes issue S^T = K Q^T onto (list entry ``it``, the query indices and bits in
    the stage's ``rows_s`` and ``qbits_s``): the mask bias in the partial blocks (it >= n_full), nothing in
    the full ones: ``(initial value, use_acc)``. Built before the matmuls are issued, while only dK and dV hold
    registers: as a where() on P^T it spilled at D=128, BM=64. ``key_runs``: :func:`transposed_mask_bias`'s."""
    cols: gl.constexpr = gl.SliceLayout(0, st_zero.type.layout)
    partial = it >= n_full
    st0 = st_zero
    if partial:
        st0 = transposed_mask_bias(offs_n, k_bits, rows_s, qbits_s, mask_args, cols, MASK_MODE, IS_CAUSAL, HAS_WINDOW,
                                   key_runs)
    return st0, partial


@gluon.jit
def count_slot(stage, phase, STAGES: gl.constexpr):
    """The ring stage after ``stage`` and the parity of its ready barrier (``phase``: the parity of ``stage``'s).
    Counted rather than taken as ``i % STAGES`` where STAGES is not a power of two (``COUNTED`` in ``gluon.dkdv``'s
    consumer): from the remainder of i, LLVM's loop strength reduction builds the stage's shared addresses as a
    multiple of i minus a multiple of ``i // STAGES``, which the tests' PTX reader (``tests/kernels/ptx_barriers.py``)
    cannot bound; a counter modulo STAGES it can. A power of two keeps the mask and shift of i (the counters are then
    dead and dropped: the loop compiles as before)."""
    stage = (stage + 1) % STAGES
    return stage, phase ^ (stage == 0).to(gl.int32)


@gluon.jit
def next_entry(it, n_total, GROUP: gl.constexpr):
    """Step i's list entry, ``i % n_total``, from step i-1's (-1 before step 0): counted rather than divided. A
    remainder by the runtime list length is an integer division every step (``MUFU.RCP`` and its fix-up in the SASS:
    about 2.5% of the D=64 dK/dV pass's warp stall samples on an H200). With one head a group the steps are the
    entries."""
    it = it + 1
    if GROUP > 1:
        it = gl.where(it == n_total, 0, it)
    return it


@gluon.jit
def issue_scores(k_tile, q_tile, st0, partial, lse_s, inv_qk_scale, cols: gl.constexpr, LSE_FIRST: gl.constexpr):
    """Issue S^T = K Q^T onto ``st0`` (the mask's bias in a partial block, else zeros: ``common.scores_init``),
    -lse / scale added to it first where ``LSE_FIRST`` (``lse_s``: the stage's lse row)."""
    if LSE_FIRST:
        st0 = st0 - gl.expand_dims(lse_s.load(cols) * inv_qk_scale, 0)
        st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st0, is_async=True)
    else:
        st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st0, use_acc=partial, is_async=True)
    return st


@gluon.jit
def probabilities(st, lse_s, qk_scale, cols: gl.constexpr, LSE_FIRST: gl.constexpr):
    """P^T = exp2(S^T scale - lse) in float32, of a done S^T from :func:`issue_scores`."""
    if LSE_FIRST:
        pt = gl.exp2(st * qk_scale)
    else:
        # read once the matmul is done: held across its wait, lse made ptxas spill at D=128
        pt = gl.exp2(gl.fma(st, qk_scale, -gl.expand_dims(lse_s.load(cols), 0)))  # explicit FMA, as the tl kernels
    return pt


@gluon.jit
def allocate_kv_ring(dtype: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr, HEAD_DIM_PAD: gl.constexpr):
    """The K/V ring's shared tiles of the forward and the dQ pass: ``(k_smem, v_smem)``, ``[STAGES, BN,
    HEAD_DIM_PAD]`` each."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM_PAD], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM_PAD], layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, HEAD_DIM_PAD], layout)
    return k_smem, v_smem


@gluon.jit
def allocate_barriers(STAGES: gl.constexpr, RELEASES: gl.constexpr = 1):
    """The barriers of the forward and the dQ pass: ``(resident, k_ready, v_ready, kv_empty)``, the resident tiles'
    (Q, and dO in the dQ pass) and the K/V ring's (:func:`init_barriers`), ``RELEASES`` release barriers a stage (2:
    its K and its V apart, :func:`stream_kv_ring`)."""
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    resident = gl.allocate_shared_memory(gl.int64, [1], layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    kv_empty = gl.allocate_shared_memory(gl.int64, [RELEASES * STAGES, 1], layout)
    return resident, k_ready, v_ready, kv_empty


@gluon.jit
def init_barriers(resident, k_ready, v_ready, kv_empty, STAGES: gl.constexpr, RELEASES: gl.constexpr = 1):
    """Initialise :func:`allocate_barriers`' barriers: the resident tiles landed (the producer's TMA, one arrival),
    and the ring's (:func:`init_kv_ring`). The caller fences the inits before any TMA copy can signal them."""
    mbarrier.init(resident, count=1)
    init_kv_ring(k_ready, v_ready, kv_empty, STAGES, RELEASES)


@gluon.jit
def invalidate_barriers(resident, k_ready, v_ready, kv_empty, STAGES: gl.constexpr, RELEASES: gl.constexpr = 1):
    """Invalidate :func:`init_barriers`' barriers once the partitions have joined."""
    mbarrier.invalidate(resident)
    invalidate_kv_ring(k_ready, v_ready, kv_empty, STAGES, RELEASES)


@gluon.jit
def init_kv_ring(k_ready, v_ready, kv_empty, STAGES: gl.constexpr, RELEASES: gl.constexpr = 1):
    """The ring's barriers: K and V of a stage landed (the producer's TMA), and ``RELEASES`` a stage released by
    both consumer warpgroups: 1, the stage; 2, its K and its V apart (:func:`stream_kv_ring`); 0, none (the
    forward's named releases are hardware barriers)."""
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        for r in gl.static_range(RELEASES):
            mbarrier.init(kv_empty.index(r * STAGES + i), count=2)


@gluon.jit
def invalidate_ring(bars, COUNT: gl.constexpr):
    """Invalidate the COUNT barriers of a ``[COUNT, 1]`` allocation once nothing waits on or arrives at them again:
    an mbarrier's bytes may hold other values only after it is invalidated."""
    for i in gl.static_range(COUNT):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def invalidate_kv_ring(k_ready, v_ready, kv_empty, STAGES: gl.constexpr, RELEASES: gl.constexpr = 1):
    """Invalidate the ring's barriers (:func:`init_kv_ring`) once the partitions have joined."""
    invalidate_ring(k_ready, STAGES)
    invalidate_ring(v_ready, STAGES)
    invalidate_ring(kv_empty, RELEASES * STAGES)


@gluon.jit
def load_resident_halves(a_desc, a_smem, b_desc, b_smem, bar, b, h, row0, ROWS: gl.constexpr):
    """The producer's start in the dQ and dK/dV passes: the two tiles that stay resident (Q and dO; K and V), rows
    row0 .. row0 + 2 ROWS - 1 of head h of batch b, each in two ``ROWS``-row halves (one per consumer warpgroup),
    all four signalled on ``bar``."""
    mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma_load(a_desc, [b, h, row0 + half * ROWS, 0], bar, box(a_smem.index(half)))
        tma_load(b_desc, [b, h, row0 + half * ROWS, 0], bar, box(b_smem.index(half)))


@gluon.jit
def stream_kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, idx_ptr, n_total, b, hk,
                   BN: gl.constexpr, STAGES: gl.constexpr, V_APART: gl.constexpr = False):
    """The producer's loop: K and V (kv head hk of batch b) of every listed key block into the stage ring (the
    forward and the dQ pass share it), each stage refilled once both consumer warpgroups released it at
    ``kv_empty`` s. With ``V_APART`` (the forward: 2 releases a stage, :func:`init_kv_ring`) a stage's K is released
    there and its V at STAGES + s: K is done with once the block's scores are, a step before V, so the next block's
    K loads a step earlier, which a ring of 2 stages needs to keep its loads off the matmuls' path."""
    for it in range(n_total):
        stage = it % STAGES
        n_blk = block_id(idx_ptr, it)
        # A fresh barrier counts as phase 1 completed: the first pass over the ring does not wait.
        mbarrier.wait(kv_empty.index(stage), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma_load(k_desc, [b, hk, n_blk * BN, 0], k_ready.index(stage), box(k_smem.index(stage)))
        if V_APART:
            mbarrier.wait(kv_empty.index(STAGES + stage), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma_load(v_desc, [b, hk, n_blk * BN, 0], v_ready.index(stage), box(v_smem.index(stage)))
