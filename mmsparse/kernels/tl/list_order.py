"""The launch order of a grid over block lists: their entries ranked longest first (``mask.list_order``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def list_order_kernel(COUNTS, ORDER, n_entries, E: tl.constexpr, CHUNK: tl.constexpr):
    """``ORDER[rank] = entry`` for ``E`` entries per program: entry i of the ``n_entries`` rows of ``COUNTS`` (int32
    ``[n_entries, 3]``: full, partial, start) ranks by its list's length, longest first, ties by entry: its rank is
    the number of entries whose list is longer, or as long and before it. Every other entry is compared in chunks
    of ``CHUNK``, so one launch ranks any number of entries (at 16k entries, 2.7e8 comparisons: microseconds)."""
    offs = tl.program_id(0) * E + tl.arange(0, E)
    live = offs < n_entries
    own = tl.load(COUNTS + offs * 3, mask=live, other=0) + tl.load(COUNTS + offs * 3 + 1, mask=live, other=0)
    rank = tl.zeros([E], tl.int32)
    for start in range(0, n_entries, CHUNK):
        other = start + tl.arange(0, CHUNK)
        inside = other < n_entries
        length = (tl.load(COUNTS + other * 3, mask=inside, other=0)
                  + tl.load(COUNTS + other * 3 + 1, mask=inside, other=0))[None, :]
        before = (length > own[:, None]) | ((length == own[:, None]) & (other[None, :] < offs[:, None]))
        rank += tl.sum((before & inside[None, :]).to(tl.int32), axis=1)
    tl.store(ORDER + rank, offs, mask=live)
