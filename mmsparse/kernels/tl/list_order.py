"""The launch order of a grid over block lists: each sample's rows ranked longest list first (``mask.list_order``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def list_order_kernel(COUNTS, ORDER, n_rows, E: tl.constexpr, CHUNK: tl.constexpr):
    """``ORDER[b, rank] = row`` for ``E`` rows of sample ``program_id(1)`` per program: row r of the ``n_rows`` rows
    of ``COUNTS`` (int32 ``[Bm, n_rows, 3]``: full, partial, start) ranks by its list's length, longest first, ties
    by row: its rank is the number of the sample's rows whose list is longer, or as long and before it. The other
    rows are compared in chunks of ``CHUNK``, so one launch ranks any number of rows (16k rows: 2.7e8 comparisons,
    microseconds)."""
    b64 = tl.program_id(1).to(tl.int64)
    counts = COUNTS + b64 * n_rows * 3
    offs = tl.program_id(0) * E + tl.arange(0, E)
    live = offs < n_rows
    own = tl.load(counts + offs * 3, mask=live, other=0) + tl.load(counts + offs * 3 + 1, mask=live, other=0)
    rank = tl.zeros([E], tl.int32)
    for start in range(0, n_rows, CHUNK):
        other = start + tl.arange(0, CHUNK)
        inside = other < n_rows
        length = (tl.load(counts + other * 3, mask=inside, other=0)
                  + tl.load(counts + other * 3 + 1, mask=inside, other=0))[None, :]
        before = (length > own[:, None]) | ((length == own[:, None]) & (other[None, :] < offs[:, None]))
        rank += tl.sum((before & inside[None, :]).to(tl.int32), axis=1)
    tl.store(ORDER + b64 * n_rows + rank, offs, mask=live)
