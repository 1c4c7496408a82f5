"""tl kernel of one step of a sum over token rows gathered from several sources (context parallelism's dK/dV
return: a rank's own contributions, then each peer's, summed in a fixed order)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_tokens", "src_tokens"])
def add_token_rows_kernel(
    ACC, SRC, INDEX, OUT, n_tokens, src_tokens,
    WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):
    """Program (i, r): tokens i*BLOCK .. of row r (a batch x head). Token t takes ``SRC[r, INDEX[t], :]`` (nothing
    where ``INDEX[t]`` is -1) in float32, added to ``ACC[r, t, :]`` unless ``FIRST``; the sum goes to ``ACC``, or
    (``LAST``) to ``OUT`` in OUT's dtype. ACC and OUT: ``[rows, n_tokens, WIDTH]``; SRC: ``[rows, src_tokens,
    WIDTH]``; all contiguous."""
    i, r = tl.program_id(0), tl.program_id(1)
    t = i * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, WIDTH_PAD)
    inside = t < n_tokens
    index = tl.load(INDEX + t, mask=inside, other=-1)
    row = r.to(tl.int64)
    keep = (index >= 0)[:, None] & (d < WIDTH)[None, :]
    source = SRC + (row * src_tokens + index.to(tl.int64))[:, None] * WIDTH + d[None, :]
    total = tl.load(source, mask=keep, other=0.0).to(tl.float32)
    here = (row * n_tokens + t.to(tl.int64))[:, None] * WIDTH + d[None, :]
    store = inside[:, None] & (d < WIDTH)[None, :]
    if not FIRST:
        total += tl.load(ACC + here, mask=store, other=0.0)
    if LAST:
        tl.store(OUT + here, total.to(OUT.dtype.element_ty), mask=store)
    else:
        tl.store(ACC + here, total, mask=store)
