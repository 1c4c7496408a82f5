"""Hopper one-pass backward in Gluon on FlashAttention-3/4's SM90 schedule: dK and dV per key block, dQ added into
a float32 accumulator by a warp of its own (the "dQ writer"), for head dims up to 128.

Partitions of one CTA (128 keys, ``[B, Hkv]`` x key blocks, as ``gluon.dkdv``):

- two MMA warpgroups (the default partition and worker 0), each owning 64 keys and their dK, dV accumulators in
  registers; they walk the key block's query list, for every head of the GQA group, as one flat sequence of steps;
- the producer warp (worker 1, ``gluon.dkdv``'s): K and V once, then Q and dO by TMA and the lse, delta,
  query-index and (partial blocks) query-bit rows through a ring of ``STAGES`` stages; dK and dV by TMA at the end;
- the dQ writer warp (worker 2): owns the one float32 dQ staging buffer (``[BM, D]``, a ``[BM, D/2]`` half per
  MMA warpgroup) and issues the TMA bulk reduce-adds (``cp.reduce.async.bulk.tensor``) into dQ.

A step of MMA warpgroup w (FlashAttention-4's ``mma_one_m_block`` with ``SdP_swapAB`` and RS dK/dV matmuls): issue
S^T = K_w Q^T (onto -lse / scale, and the mask bias in a partial block: ``rules.lse_in_scores``) and dP^T = V_w dO^T;
P^T = exp2(S^T scale) once S^T is done; dV += P^T dO with P^T in registers (RS); dS^T = P^T (dP^T - delta) once
dP^T is done; stage dS^T in the warpgroup's shared tile and meet the other warpgroup there (``_DS_FULL``); issue
dQ[:, w D/2 : (w+1) D/2] = dS K over both warpgroups' keys (both staged tiles, SS) and dK += dS^T Q with dS^T in
registers (RS); once dV and dQ are done, hand dQ's half to the writer through its staging half (a full/empty
mbarrier pair per half) while dK runs; release the stage once dK is done. Every wgmma issued in a step is waited
for in that step (one in flight across the loop's back edge makes ptxas serialize them all, C7512), so a stage is
held for one step only, unlike ``gluon.dkdv``'s software pipeline (two steps): 3 stages leave the producer two steps
of slack.

Past 64 query rows a step (BM = 128) a warpgroup takes all the stage's rows at once where lse is in S^T's initial
value (``_whole_step``: one 64 x BM S^T and dP^T in flight together, dS^T made before dV's matmul is issued), and
elsewhere in halves of 64 (``_halved_step``: segment codes with the causal flag, whose whole step spilled).

The MMA warpgroups never wait for a reduce-add: the writer waits for each half to be read
(``cp.async.bulk.wait_group.read``) and only then frees it, and a warpgroup waits on that barrier one whole step
after it filled the half.

Shared memory a CTA (bytes; ``dq_writer_shared_bytes`` in ``mmsparse/attention/config.py`` counts the tiles, and
its slack the barriers and the key block's runs; a CTA may take 232,448 on an H100 or H200):

====================================  ==================  ==================  ==================
what                                  D=128, BM=64        D=64, BM=64         D=64, BM=128
====================================  ==================  ==================  ==================
K and V, 128 keys                     65,536              32,768              32,768
Q and dO, per stage                   32,768              16,384              32,768
lse, delta, query rows, bits / stage  1,024               1,024               2,048
dS^T, both warpgroups (bf16)          16,384              16,384              32,768
dQ staging, ``[BM, D]`` float32       32,768              16,384              32,768
barriers                              < 200               < 200               < 200
key block's runs (segment codes)      576                 576                 576
2 stages                              182,272             100,352             167,936
3 stages (D=128's)                    216,064             117,760             202,752
4 stages (D=64's)                     249,856 (no)        135,168             237,568 (no)
====================================  ==================  ==================  ==================

The numerics are ``gluon.dkdv``'s, and the ``tl`` one-pass kernel's (``tl.backward._dkdv_tiles``) but for the
order of one float32 add: p in float32, the token mask (0 or -inf) and -lse / scale as S^T's initial value (where
``rules.lse_in_scores`` holds: p = exp2((S^T - lse / scale) scale) rather than exp2(S^T scale - lse)), dV from p
rounded to the input dtype, dS rounded to the input
dtype, dK and dQ times the softmax scale. No dropout: that stays with the ``tl`` kernel. Not deterministic: the
reduce-adds of the key blocks into one dQ tile land in any order, unless ``ORDERED``.

``ORDERED`` (deterministic=True with ``KernelConfig.ordered_dq_writer``): the adds into each query block land in the
order of ``mask.add_order``. The writer waits (an acquire load) until the block's counter reads its entry's rank,
issues the adds, frees the halves once read, waits for the adds to be written and counts one (a release); the MMA
warpgroups and the producer take every head of a list entry in turn (``HEADS_INNER``: one rank serves a GQA group),
and the programs start in the ranks' launch order (shortest list first where ``SHORTEST_FIRST``:
``dkdv_rows.key_block_lists``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..constants import DYNAMIC_ARGS, MASK_SEGMENTS
from ..lists import WORDS_PER_ROW, block_id
from ..rules import lse_in_scores
from .common import (
    WG_ROWS,
    count_slot,
    invalidate_ring,
    issue_scores,
    key_step_zero,
    next_entry,
    opaque_zero,
    probabilities,
    scores_init,
    tma_atomic_add,
    wait_for_arrival,
)
from .dkdv import WG_KEYS, key_block_producer, stage_gradients
from .dkdv_rows import allocate_query_stages, key_block_lists
from .dq_adds import issue_dq
from .key_runs import block_runs, key_values

_MASK_SEGMENTS = gl.constexpr(MASK_SEGMENTS)
BLOCK_N = 2 * WG_KEYS.value  # keys per CTA
# Worker partitions: the second MMA warpgroup, the producer warp, the dQ writer warp.
WORKER_WARPS = gl.constexpr([4, 1, 1])
# Registers a thread of each worker. The two one-warp workers share a warpgroup of the launch's count (Triton pads
# it to one), so the default warpgroup gets 3 x 168 - 240 - 24 = 240, as the second MMA warpgroup.
WORKER_REGS = gl.constexpr([240, 24, 24])
# Past 64 query rows a step the producer warp loads and stores a stage's rows this many at a time (one a lane): at
# 128 rows, whole, they spilled at its 24 registers (``dkdv_rows.stage_query_blocks``).
PRODUCER_ROW_PART = gl.constexpr(32)
# The dS^T hand-over between the MMA warpgroups (``ds_bars``): both staged this step's dS^T; both of their dQ
# matmuls have read both tiles (a tile may then take the next step's dS^T).
_DS_FULL, _DS_READ = gl.constexpr(0), gl.constexpr(1)


@gluon.jit
def _mma_warpgroup(WG: gl.constexpr, buffers, barriers, dq_ring, n_full, n_total, col0, mask_args, qk_scale,
                   sm_scale, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
                   MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                   HEADS_INNER: gl.constexpr, key_runs=None):
    """MMA warpgroup WG, keys col0 + 64 WG ..: dK and dV over every step, and its half of dQ's columns of each step
    handed to the writer (:func:`_mma_steps`); then dK and dV staged for the producer's stores. ``key_runs``: None,
    or (segment codes) the key block's ``(key shifts, runs)`` (:func:`.key_runs.block_runs`): where its runs fit
    the rows' words the steps read those, else the pair table, each in a loop of its own (``gluon.dkdv``'s
    consumer says why)."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    ds_smem, ds_bars, dq_stage, dq_full, dq_empty = dq_ring
    kv_bar, ready, empty, done = barriers
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    q_bits_ptr, k_bits_ptr, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window = mask_args
    offs_n = col0 + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, st_layout))
    args = (buffers, barriers, dq_ring, n_full, n_total, mask_args, qk_scale, sm_scale, offs_n)
    if key_runs is None:
        k_bits = key_values(offs_n, k_bits_ptr, seq_k, None, WG * WG_KEYS, MASK_MODE)
        dk, dv = _mma_steps(WG, args, k_bits, None, GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL,
                            HAS_WINDOW, HEADS_INNER)
    elif key_runs[1] > 0:
        k_bits = key_values(offs_n, k_bits_ptr, seq_k, key_runs, WG * WG_KEYS, MASK_MODE)
        dk, dv = _mma_steps(WG, args, k_bits, key_runs, GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL,
                            HAS_WINDOW, HEADS_INNER)
    else:
        k_bits = key_values(offs_n, k_bits_ptr, seq_k, None, WG * WG_KEYS, MASK_MODE)
        dk, dv = _mma_steps(WG, args, k_bits, None, GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL,
                            HAS_WINDOW, HEADS_INNER)
    if GROUP * n_total > 0:
        mbarrier.wait(ds_bars.index(_DS_READ), (GROUP * n_total - 1) & 1)  # the other warpgroup's last dQ read our K
    stage_gradients(WG, k_smem, v_smem, dk, dv, sm_scale, done)


@gluon.jit
def _mma_steps(WG: gl.constexpr, args, k_bits, key_runs, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
               BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr,
               HAS_WINDOW: gl.constexpr, HEADS_INNER: gl.constexpr):
    """:func:`_mma_warpgroup`'s steps (the module's docstring has the order of a step). ``k_bits`` and
    ``key_runs``: the partial steps' mask (``common.scores_init``). Returns ``(dk, dv)`` with nothing in flight."""
    buffers, barriers, dq_ring, n_full, n_total, mask_args, qk_scale, sm_scale, offs_n = args
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    kv_bar, ready, empty, done = barriers
    ds_smem, ds_bars, dq_stage, dq_full, dq_empty = dq_ring
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    N: gl.constexpr = HEAD_DIM_PAD // 2  # dQ's columns a warpgroup computes

    dk = gl.zeros([WG_KEYS, HEAD_DIM_PAD], gl.float32, acc_layout)
    dv = gl.zeros([WG_KEYS, HEAD_DIM_PAD], gl.float32, acc_layout)
    st_zero = gl.zeros([WG_KEYS, BM], gl.float32, st_layout)
    total = GROUP * n_total
    inv_qk_scale = 1.0 / qk_scale
    LSE_FIRST: gl.constexpr = lse_in_scores(MASK_MODE, IS_CAUSAL, HEAD_DIM_PAD)
    WHOLE_STEPS: gl.constexpr = BM > WG_ROWS and LSE_FIRST
    stage = STAGES - 1  # count_slot's predecessor of stage 0
    phase = 1
    it = -1  # next_entry's predecessor of entry 0
    head = GROUP - 1  # with HEADS_INNER: the step's head, before step 0 the last
    mbarrier.wait(kv_bar, 0)
    for i in range(total):
        # Nothing in flight on entry.
        stage, phase = count_slot(stage, phase, STAGES)
        if HEADS_INNER:
            it, head = _entry_heads_inner(it, head, GROUP)
        else:
            it = next_entry(it, n_total, GROUP)
        mbarrier.wait(ready.index(stage), phase)
        if WHOLE_STEPS:
            dk, dv = _whole_step(WG, i, it, stage, n_full, offs_n, k_bits, mask_args, qk_scale, inv_qk_scale, sm_scale,
                                 dk, dv, buffers, barriers, dq_ring, HEAD_DIM_PAD, BM, MASK_MODE, IS_CAUSAL, HAS_WINDOW,
                                 LSE_FIRST, key_runs)
        elif BM > WG_ROWS:
            dk, dv = _halved_step(WG, i, it, stage, n_full, offs_n, k_bits, mask_args, qk_scale, inv_qk_scale,
                                  sm_scale, dk, dv, buffers, barriers, dq_ring, HEAD_DIM_PAD, BM, MASK_MODE, IS_CAUSAL,
                                  HAS_WINDOW, LSE_FIRST, key_runs)
        else:
            first = key_step_zero(HEAD_DIM_PAD)  # past D=64 the tiles' descriptors are made in each step
            k_step = k_smem.index(WG + first)
            v_step = v_smem.index(WG + first)
            ds_step = ds_smem.index(WG + first)
            st0, partial = scores_init(it, n_full, rows_smem.index(stage), qbits_smem.index(stage), offs_n, k_bits,
                                       mask_args, st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW, key_runs)
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            lse_s = lse_smem.index(stage)
            st = issue_scores(k_step, q_s, st0, partial, lse_s, inv_qk_scale, cols, LSE_FIRST)
            dpt = warpgroup_mma(v_step, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st,))
            pt = probabilities(st, lse_s, qk_scale, cols, LSE_FIRST)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt,))
            delta = delta_smem.index(stage).load(cols)
            dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            # The tile takes dS^T_i once both warpgroups' dQ_{i-1} have read it (a fresh barrier: step 0 waits for
            # nothing).
            mbarrier.wait(ds_bars.index(_DS_READ), (i & 1) ^ 1)
            ds_step.store(dst)
            fence_async_shared()  # the generic-proxy stores, before the async proxy (wgmma) reads them
            mbarrier.arrive(ds_bars.index(_DS_FULL))  # a warpgroup barrier, then one arrival
            dst_op = gl.convert_layout(dst, op_layout)
            dk, dv = _dq_and_release(WG, i, stage, dst_op, q_s, dk, dv, pt_op, k_smem, dq_ring, empty, sm_scale, BM, N,
                                     first)
    return dk, dv


@gluon.jit
def _entry_heads_inner(it, head, GROUP: gl.constexpr):
    """Step i's (list entry, head) from step i-1's, where every head of an entry takes its step before the next
    entry's (``HEADS_INNER``): counted, not divided (as :func:`.common.next_entry`)."""
    head = head + 1
    if GROUP > 1:
        wrap = head == GROUP
        it = gl.where(wrap, it + 1, it)
        head = gl.where(wrap, 0, head)
    else:
        it = it + 1
        head = 0
    return it, head


@gluon.jit
def _whole_step(WG: gl.constexpr, i, it, stage, n_full, offs_n, k_bits, mask_args, qk_scale, inv_qk_scale, sm_scale,
                dk, dv, buffers, barriers, dq_ring, HEAD_DIM_PAD: gl.constexpr, BM: gl.constexpr,
                MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                LSE_FIRST: gl.constexpr, key_runs=None):
    """Step i of MMA warpgroup WG past BM = 64 (stage ``stage``, list entry ``it``) with lse in S^T's initial value
    (``LSE_FIRST``): S^T and dP^T of all BM rows issued together (64 x BM each, the mask's bias built before, while
    only dK and dV hold registers), P^T once S^T is done, then dS^T = P^T (dP^T - delta) with delta read once dP^T is
    done, and only then dV += P^T dO (RS), so that P^T's float32 values die into their bf16 operand instead of being
    held beside it; then the 64-row step's hand-over, dQ matmul, staging and release. Returns ``(dk, dv)`` with
    nothing in flight.

    Its register peak, P^T, dP^T, delta, dK and dV (224 a thread), fits the 240 without a spill in the step loop
    under Triton 3.6, 3.7.1 and 3.9. Under 3.9, in the 64-row step's order (dV issued before dS^T is made) and with
    its descriptors hoisted, the step spilled 200-692 B; dS^T first, 112-460 B; its descriptors made in each step
    as well (``common.opaque_zero``), none.
    An initial value on dP^T (-delta) issued while S^T is in flight made ptxas wait for S^T first (C7517). Whole
    steps for the full blocks beside halved ones for the partial blocks, one runtime branch in the loop, made
    ptxas 3.6 keep the two branches' wgmma descriptors in uniform registers written in one branch only: the other
    read stale ones (an out-of-bounds shared read on the GPU)."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    kv_bar, ready, empty, done = barriers
    ds_smem, ds_bars, dq_stage, dq_full, dq_empty = dq_ring
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    N: gl.constexpr = HEAD_DIM_PAD // 2
    z = opaque_zero()
    k_w = k_smem.index(WG + z)
    v_w = v_smem.index(WG + z)
    ds_w = ds_smem.index(WG + z)
    q_s = q_smem.index(stage)
    do_s = do_smem.index(stage)
    lse_s = lse_smem.index(stage)
    st_zero = gl.zeros([WG_KEYS, BM], gl.float32, st_layout)
    st0, partial = scores_init(it, n_full, rows_smem.index(stage), qbits_smem.index(stage), offs_n, k_bits, mask_args,
                               st_zero, MASK_MODE, IS_CAUSAL, HAS_WINDOW, key_runs)
    st = issue_scores(k_w, q_s, st0, partial, lse_s, inv_qk_scale, cols, LSE_FIRST)
    dpt = warpgroup_mma(v_w, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st,))
    pt = probabilities(st, lse_s, qk_scale, cols, LSE_FIRST)
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    delta = delta_smem.index(stage).load(cols)
    dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    pt_op = gl.convert_layout(pt.to(dtype), op_layout)
    dv = warpgroup_mma(pt_op, do_s, dv, is_async=True)
    # The tile takes dS^T_i once both warpgroups' dQ_{i-1} have read it (step 0 waits for nothing).
    mbarrier.wait(ds_bars.index(_DS_READ), (i & 1) ^ 1)
    ds_w.store(dst)
    fence_async_shared()  # the generic-proxy stores, before the async proxy (wgmma) reads them
    mbarrier.arrive(ds_bars.index(_DS_FULL))  # a warpgroup barrier, then one arrival
    dst_op = gl.convert_layout(dst, op_layout)
    return _dq_and_release(WG, i, stage, dst_op, q_s, dk, dv, pt_op, k_smem, dq_ring, empty, sm_scale, BM, N)


@gluon.jit
def _halved_step(WG: gl.constexpr, i, it, stage, n_full, offs_n, k_bits, mask_args, qk_scale, inv_qk_scale, sm_scale,
                 dk, dv, buffers, barriers, dq_ring, HEAD_DIM_PAD: gl.constexpr, BM: gl.constexpr,
                 MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                 LSE_FIRST: gl.constexpr, key_runs=None):
    """Step i of MMA warpgroup WG past BM = 64 (stage ``stage``, list entry ``it``) where lse is subtracted after
    S^T's matmul (segment codes with the causal flag): the stage's BM query rows as halves of 64 (``WG_ROWS``), each
    a 64-row step's S^T, dP^T, P^T, dV, dS^T and dK (so that only a half's S^T and dP^T, 64 x 64, are held: a
    :func:`_whole_step` with lse loaded after S^T's wait spilled 100-176 B, 20-24 words a step in the pair table's
    loop), dS^T of each half stored in its column half of the
    warpgroup's ``[64, BM]`` tile; then, as a 64-row step, one hand-over, one dQ matmul of all BM rows, one staging
    of dQ's half for the writer and one release of the stage. Returns ``(dk, dv)`` with nothing in flight.

    The register peak is a 64-row step's: a half's dV and dK are waited for before the next half's S^T and dP^T are
    issued (left in flight across the next half's mask and matmul issue, they spilled a word in the segment-code
    mask variant). The matmuls' shared-memory descriptors of K, V and the dS^T tiles are made in each step
    (``common.opaque_zero``): hoisted out of the loop (the dQ matmul's alone are 24 64-bit values at BM = 128) they
    crowded the loop so that the thread id, held across it for the epilogue, spilled."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = buffers
    kv_bar, ready, empty, done = barriers
    ds_smem, ds_bars, dq_stage, dq_full, dq_empty = dq_ring
    HALF: gl.constexpr = WG_ROWS
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM_PAD, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    N: gl.constexpr = HEAD_DIM_PAD // 2  # dQ's columns a warpgroup computes
    keys: gl.constexpr = gl.SliceLayout(1, st_layout)
    offs_n = gl.convert_layout(offs_n, keys)
    k_bits = gl.convert_layout(k_bits, keys)
    z = opaque_zero()
    k_w = k_smem.index(WG + z)
    v_w = v_smem.index(WG + z)
    ds_w = ds_smem.index(WG + z)
    q_s = q_smem.index(stage)
    do_s = do_smem.index(stage)
    st_zero = gl.zeros([WG_KEYS, HALF], gl.float32, st_layout)
    for h in gl.static_range(BM // HALF):
        st0, partial = scores_init(it, n_full, rows_smem.index(stage).slice(h * HALF, HALF),
                                   qbits_smem.index(stage).slice(h * HALF, HALF), offs_n, k_bits, mask_args, st_zero,
                                   MASK_MODE, IS_CAUSAL, HAS_WINDOW, key_runs)
        q_h = q_s.slice(h * HALF, HALF, dim=0)
        do_h = do_s.slice(h * HALF, HALF, dim=0)
        lse_h = lse_smem.index(stage).slice(h * HALF, HALF)
        st = issue_scores(k_w, q_h, st0, partial, lse_h, inv_qk_scale, cols, LSE_FIRST)
        dpt = warpgroup_mma(v_w, do_h.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st,))
        pt = probabilities(st, lse_h, qk_scale, cols, LSE_FIRST)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do_h, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        delta = delta_smem.index(stage).slice(h * HALF, HALF).load(cols)
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        if h == 0:
            # The tile takes dS^T_i once both warpgroups' dQ_{i-1} have read it (step 0 waits for nothing).
            mbarrier.wait(ds_bars.index(_DS_READ), (i & 1) ^ 1)
        ds_w.slice(h * HALF, HALF, dim=1).store(dst)
        dst_op = gl.convert_layout(dst, op_layout)
        if h < BM // HALF - 1:
            dk = warpgroup_mma(dst_op, q_h, dk, is_async=True)
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
    fence_async_shared()  # the generic-proxy stores, before the async proxy (wgmma) reads them
    mbarrier.arrive(ds_bars.index(_DS_FULL))  # a warpgroup barrier, then one arrival
    return _dq_and_release(WG, i, stage, dst_op, q_s.slice(BM - HALF, HALF, dim=0), dk, dv, pt_op, k_smem, dq_ring,
                           empty, sm_scale, BM, N)


@gluon.jit
def _dq_and_release(WG: gl.constexpr, i, stage, dst_op, q_rows, dk, dv, pt_op, k_smem, dq_ring, empty, sm_scale,
                    BM: gl.constexpr, N: gl.constexpr, first=None):
    """The end of every step of MMA warpgroup WG, once it has staged its dS^T_i and arrived on ``_DS_FULL``: wait
    for the other warpgroup's; issue dQ's columns over both staged tiles and dK += dS^T Q (``q_rows``: the Q rows
    ``dst_op`` spans); once dV (``pt_op``'s matmul) and dQ are done, free the tiles for the next dS^T and stage dQ's
    half for the writer; once dK is done, release the stage. ``first``: the index of warpgroup 0's K and dS^T
    tiles (None: ``common.opaque_zero()``, made here). Returns ``(dk, dv)`` with nothing in flight."""
    ds_smem, ds_bars, dq_stage, dq_full, dq_empty = dq_ring
    mbarrier.wait(ds_bars.index(_DS_FULL), i & 1)  # both warpgroups' dS^T_i are staged
    if first is None:
        dq = issue_dq(ds_smem, k_smem, BM, WG * N, N, opaque_zero())
    else:
        dq = issue_dq(ds_smem, k_smem, BM, WG * N, N, first)
    dk = warpgroup_mma(dst_op, q_rows, dk, is_async=True)
    # Of dV, dQ (two groups), dK: all but dK are done.
    dv, pt_op, dq = warpgroup_mma_wait(1, deps=(dv, pt_op, dq))
    mbarrier.arrive(ds_bars.index(_DS_READ))
    # The writer has read this half's previous contents (a whole step ago; step 0 waits for nothing).
    mbarrier.wait(dq_empty.index(WG), (i & 1) ^ 1)
    dq_stage.index(WG).store(dq * sm_scale)
    fence_async_shared()  # before the writer's TMA (async proxy) reads the half
    mbarrier.arrive(dq_full.index(WG))
    dk, dst_op = warpgroup_mma_wait(0, deps=(dk, dst_op))
    mbarrier.arrive(empty.index(stage))
    return dk, dv


@gluon.jit
def _dq_writer(dq_desc, bh0, dq_stage, dq_full, dq_empty, idx_ptr, n_total, order_args, GROUP: gl.constexpr,
               BM: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, ORDERED: gl.constexpr):
    """Each step's dQ rows (query block ``idx_ptr[it]`` of the group's head g; ``bh0``: the group's first batch *
    Hq + head in the descriptor's ``[B * Hq, Sq, D]``): each MMA warpgroup's half added by one TMA bulk reduce-add
    once staged, and freed once the reduce has read it. ``ORDERED``: the adds into one query block land in the
    order of ``mask.add_order`` (``order_args``: :func:`_count_add`'s counters, this list's ranks and the query
    blocks a head)."""
    counters, rank_ptr, query_blocks = order_args
    i = 0
    if ORDERED:  # every head of an entry in turn (HEADS_INNER), as the MMA warpgroups take them
        for it in range(n_total):
            rank = gl.load(rank_ptr + it)
            for g in range(GROUP):
                _add_step(dq_desc, bh0 + g, dq_stage, dq_full, dq_empty, idx_ptr, it, i,
                          counters + (bh0 + g).to(gl.int64) * query_blocks, rank, BM, HEAD_DIM_PAD, True)
                i += 1
    else:
        for g in range(GROUP):
            for it in range(n_total):
                _add_step(dq_desc, bh0 + g, dq_stage, dq_full, dq_empty, idx_ptr, it, i, counters, 0, BM,
                          HEAD_DIM_PAD, False)
                i += 1


@gluon.jit
def _add_step(dq_desc, bh, dq_stage, dq_full, dq_empty, idx_ptr, it, i, head_counters, rank, BM: gl.constexpr,
              HEAD_DIM_PAD: gl.constexpr, ORDERED: gl.constexpr):
    """The writer's step i: list entry ``it``'s query block of head ``bh`` (batch * Hq + head), both halves added
    once staged and freed once read; with ``ORDERED`` first waited for until its counter (``head_counters`` plus
    the block) reads ``rank``, and counted once written."""
    N: gl.constexpr = HEAD_DIM_PAD // 2
    m = block_id(idx_ptr, it)
    row0 = m * BM
    if ORDERED:
        wait_for_arrival(head_counters + m, rank)
    for w in gl.static_range(2):
        mbarrier.wait(dq_full.index(w), i & 1)
        half = dq_stage.index(w)
        tma_atomic_add(dq_desc, [bh, row0, w * N], half.reshape([1, BM, N]))
    # Half 0 is read first (bulk groups complete in order): free it without waiting for half 1.
    tma.store_wait(1)
    mbarrier.arrive(dq_empty.index(0))
    tma.store_wait(0)
    mbarrier.arrive(dq_empty.index(1))
    if ORDERED:
        _count_add(head_counters + m)  # once written: the halves were freed once read


@gluon.jit
def _count_add(counter):
    """Once this warp's bulk reduce-adds have landed in global memory (``cp.async.bulk.wait_group`` without
    ``.read``: written, not only read from shared memory), count one more add of the query block: a release at
    GPU scope by lane 0, after every lane (the issuing one among them) has passed the wait and ordered the async
    proxy's writes before its own (FlashAttention-3's deterministic dQ semaphore)."""
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .b32 lane;\n\tcp.async.bulk.wait_group 0;\n\t"
        "fence.proxy.async.global;\n\tbar.warp.sync -1;\n\tmov.u32 lane, %laneid;\n\t"
        "setp.eq.u32 first, lane, 0;\n\t@first red.release.gpu.global.add.s32 [$1], 1;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit(do_not_specialize=DYNAMIC_ARGS)
def attention_bwd_dq_writer_gluon(
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, DQ, Q_BITS, K_BITS, MASK, COUNTS, INDICES,
    stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
    seq_q, seq_k, Q_START, stride_qstart_b, window, qk_scale, sm_scale, COUNTERS, RANKS, query_blocks,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
    BM: gl.constexpr, STAGES: gl.constexpr, MASK_MODE: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
    ORDERED: gl.constexpr = False, SHORTEST_FIRST: gl.constexpr = False, HEADS_SECTION: gl.constexpr = 1,
):
    """One CTA per (128-key block, batch * kv head); arguments as ``gluon.dkdv.attention_dkdv_gluon``'s (Q, K, V,
    dO, dK and dV as ``host_tma`` descriptors), and DQ, the ``host_tma.head_rows_descriptor``
    (``[B * Hq, Sq, D]``, ``[1, BM, HEAD_DIM_PAD / 2]`` boxes) of a float32 ``[B, Hq, Sq, D]`` buffer zeroed by the
    launcher, which dQ times the softmax scale is added into. ``ORDERED`` (deterministic): COUNTERS, a zeroed int32
    ``[B * Hq, query_blocks]``, counts the adds into each query block, and RANKS (``mask.add_order.dq_add_ranks``,
    the layout of INDICES) gives each list entry its turn; without it neither is read. ``SHORTEST_FIRST``: the
    programs start shortest list first (``mask.add_order.adds_shortest_first``; the ranks' launch order).
    ``HEADS_SECTION``: the programs take each key block for that many (batch, KV head)s in turn
    (``dkdv_rows.key_block_lists``; the ranks' groups hold that many times fewer rows)."""
    gl.static_assert(STAGES >= 2, "the producer refills a stage while the MMA warpgroups work on another")
    gl.static_assert(HEAD_DIM_PAD <= 128, "two 64 x D float32 accumulators a warpgroup: D=256 is gluon.dkdv_d256's")
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, HEAD_DIM_PAD], dtype)
    b, hk, col0, n_full, n_total, idx_ptr, mask_args = key_block_lists(
        COUNTS, INDICES, Q_BITS, K_BITS, MASK, Q_START, stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q,
        stride_cnt_b, stride_idx_b, seq_q, seq_k, stride_qstart_b, window, NUM_KV_HEADS, 2 * WG_KEYS,
        SHORTEST_FIRST=SHORTEST_FIRST, HEADS_SECTION=HEADS_SECTION)

    k_smem = gl.allocate_shared_memory(dtype, [2, WG_KEYS, HEAD_DIM_PAD], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, WG_KEYS, HEAD_DIM_PAD], kv_layout)
    q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem = allocate_query_stages(
        dtype, STAGES, BM, HEAD_DIM_PAD, MASK_MODE)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, BM], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, WG_KEYS, BM], ds_layout)  # dS^T of each MMA warpgroup
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_DIM_PAD // 2], gl.float32)
    dq_stage = gl.allocate_shared_memory(gl.float32, [2, BM, HEAD_DIM_PAD // 2], stage_layout)  # the writer's
    mma_runs: gl.constexpr = None  # the partial steps' mask without the key block's runs (:mod:`.key_runs`)
    producer_runs: gl.constexpr = None
    if MASK_MODE == _MASK_SEGMENTS:
        mma_runs, producer_runs = block_runs(mask_args, col0, 2 * WG_KEYS)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # _DS_FULL, _DS_READ
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # a staging half filled (per warpgroup)
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # a staging half read by its reduce
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=2)  # both MMA warpgroups have staged dK and dV
    for j in gl.static_range(2):
        mbarrier.init(ds_bars.index(j), count=2)  # one arrival per MMA warpgroup
        mbarrier.init(dq_full.index(j), count=1)  # its warpgroup
        mbarrier.init(dq_empty.index(j), count=1)  # the writer
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups release a stage
    fence_async_shared()  # the inits, before the producer's TMA copies signal the barriers

    buffers = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, rows_smem, qbits_smem)
    barriers = (kv_bar, ready, empty, done)
    dq_ring = (ds_smem, ds_bars, dq_stage, dq_full, dq_empty)
    bh0 = b * NUM_HEADS + hk * GROUP  # the group's first head in the dQ descriptor's [B * Hq] rows
    order_args = (COUNTERS, RANKS, query_blocks)  # read only when ORDERED
    if ORDERED:
        # the list's ranks sit where its ids do (counts' third word: the list's start)
        list_start = gl.load(COUNTS + b.to(gl.int64) * stride_cnt_b + (col0 // (2 * WG_KEYS)) * WORDS_PER_ROW + 2)
        order_args = (COUNTERS, RANKS + b.to(gl.int64) * stride_idx_b + list_start, query_blocks)
    gl.warp_specialize(
        [
            (_mma_warpgroup, (0, buffers, barriers, dq_ring, n_full, n_total, col0, mask_args, qk_scale, sm_scale,
                              GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, ORDERED, mma_runs)),
            (_mma_warpgroup, (1, buffers, barriers, dq_ring, n_full, n_total, col0, mask_args, qk_scale, sm_scale,
                              GROUP, HEAD_DIM_PAD, BM, STAGES, MASK_MODE, IS_CAUSAL, HAS_WINDOW, ORDERED, mma_runs)),
            (key_block_producer, (LSE, DELTA, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc), buffers, barriers,
                                  idx_ptr, n_full, n_total, col0, b, hk, mask_args, NUM_HEADS, GROUP, BM, STAGES,
                                  MASK_MODE, PRODUCER_ROW_PART if BM > WG_ROWS else 0, None, False, ORDERED,
                                  producer_runs)),
            (_dq_writer, (DQ, bh0, dq_stage, dq_full, dq_empty, idx_ptr, n_total, order_args, GROUP, BM,
                          HEAD_DIM_PAD, ORDERED)),
        ],
        WORKER_WARPS,
        WORKER_REGS,
    )
    # Every partition has returned: no barrier is waited on or signalled again.
    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(done)
    invalidate_ring(ready, STAGES)
    invalidate_ring(empty, STAGES)
    invalidate_ring(ds_bars, 2)
    invalidate_ring(dq_full, 2)
    invalidate_ring(dq_empty, 2)
