"""The ordered one-pass backward's turns on each dQ tile (``gluon.dkdv`` with ``ORDERED``).

Each consumer warpgroup adds its half of dQ's columns into a query block's float32 rows (:mod:`.dq_adds`). With
``ORDERED`` a warpgroup adds only once the same warpgroup of every key block ranked before its own at that query
block has (:mod:`mmsparse.mask.add_order`): an int32 semaphore per (batch, q head, query block, warpgroup) counts
those adds. The two column halves never meet, so the warpgroups keep their own turns and neither waits for the
other. As the ``tl`` kernel's turns (``tl.backward.wait_turn``), and FlashAttention-3's deterministic dQ:

- wait: every thread of the warpgroup polls the semaphore with ``ld.acquire.gpu`` until it equals the rank, so
  each thread's adds are ordered after the earlier key blocks' (no barrier needed after it);
- pass: once the warpgroup's threads have issued their adds (the warpgroup barrier), one thread makes them visible
  at GPU scope (``fence.acq_rel.gpu``) and counts them (``red.relaxed.gpu`` add of 1), CUTLASS's ``arrive_inc``.

A program waits only for key blocks of its own (batch, kv head) with a lower index, launched before it (the key
block is the grid's fastest axis): no wait can hang on a block that is not resident.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..lists import visit_slot
from .common import thread_barrier

# Labels inside braces are local to the block: the asm may be inlined several times in one kernel.
_WAIT_ASM = gl.constexpr("""{
\t.reg .pred mms_not_yet;
\t.reg .b32 mms_count;
\tmms_poll:
\tld.acquire.gpu.global.b32 mms_count, [$1];
\tsetp.ne.s32 mms_not_yet, mms_count, $2;
\t@mms_not_yet bra mms_poll;
\t}
\tmov.u32 $0, 0;""")
# One thread per warpgroup (thread 0 of its 128) counts the warpgroup's adds.
_PASS_ASM = gl.constexpr("""{
\t.reg .pred mms_first;
\t.reg .b32 mms_tid;
\tmov.u32 mms_tid, %tid.x;
\tand.b32 mms_tid, mms_tid, 127;
\tsetp.eq.u32 mms_first, mms_tid, 0;
\t@mms_first fence.acq_rel.gpu;
\t@mms_first red.relaxed.gpu.global.add.s32 [$1], 1;
\t}
\tmov.u32 $0, 0;""")


@gluon.jit
def turn_semaphore(order, i, row0, WG: gl.constexpr, BM: gl.constexpr):
    """``(semaphore pointer, rank)`` of step i's dQ tile for warpgroup WG: ``order`` is ``(rank_ptr, sem_ptr0,
    n_full, n_total, n_qb)``, the key block's list ranks, the group's first head's semaphores, the list's full
    blocks and length, and the query blocks per head; the step's head is i // n_total, its list entry the one
    visited at step i % n_total (``lists.visit_slot``, descending), its query block row0 // BM."""
    rank_ptr, sem_ptr0, n_full, n_total, n_qb = order
    slot = visit_slot(i % n_total, n_full, n_total, True)
    g = i // n_total
    sem = sem_ptr0 + ((g * n_qb + row0 // BM) * 2 + WG).to(gl.int64)
    return sem, gl.load(rank_ptr + slot)


@gluon.jit
def wait_turn(sem, rank):
    """Wait until the semaphore at ``sem`` counts ``rank`` adds (every thread, acquire)."""
    gl.inline_asm_elementwise(_WAIT_ASM, "=r,l,r", [sem, rank], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pass_turn(sem):
    """Count this warpgroup's add at ``sem`` once all its threads have issued theirs (released at GPU scope)."""
    thread_barrier()
    gl.inline_asm_elementwise(_PASS_ASM, "=r,l", [sem], dtype=gl.int32, is_pure=False, pack=1)
