"""Tile classes (empty / full / partial) of a segment-code mask, in plain torch from the codes' runs.

The rule is :mod:`mmsparse.mask.segment_codes`'. Each side's tokens are cut into *pieces*: maximal stretches with one
code inside one block (a run of equal codes, split at block edges). Every (query, key) pair of a tile lies in exactly
one (query piece, key piece) pair, and that piece pair's type decides all of its pairs at once:

- another doc, NONE, or padding: none allowed;
- FULL: all allowed;
- CAUSAL (or any type when the call is causal): all allowed when the piece pair's last key is at or before its
  first query, some when its first key is at or before its last query, none otherwise;
- with a window W on top: all allowed only if its first key is past its last query minus W, some only if its last
  key is past its first query minus W (a piece pair's key-minus-query distances are one run of integers).

Only pieces of the same sample and doc are paired, so a pack's cross-sample tiles cost nothing. The cost is O(S)
for the pieces plus the piece pairs: per tile, the product of the runs its two blocks meet. No S x S tensor.
This is the torch counterpart of the Triton builder (:mod:`mmsparse.mask.code_lists`) and its test oracle; it
also counts the allowed pairs (a picture's density) the same way, from the runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from .blocks import cdiv
from .segment_codes import SEG_BITS
from .topology import CAUSAL, NONE

_DOC_SPAN = 1 << (31 - SEG_BITS)  # docs per sample, padding's included: (sample, doc) -> one int64 key
_SEG_MASK = (1 << SEG_BITS) - 1
_PAIRS_PER_STEP = 1 << 22  # piece pairs per step: bounds the temporaries (tens of bytes a pair)


class _Pieces(NamedTuple):
    """Pieces of one side, int64 each: batch row, block, first and last position, code."""

    row: torch.Tensor
    block: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    code: torch.Tensor


def _pieces(codes: torch.Tensor, block: int, offset: torch.Tensor | None = None) -> _Pieces:
    """The pieces of int32 codes ``[B, S]`` at blocks of ``block`` tokens, in row-major token order; positions
    are shifted by ``offset`` (int64 ``[B]``, the first query's position) when given."""
    bsz, seq = codes.shape
    pos = torch.arange(seq, device=codes.device)
    starts = torch.ones((bsz, seq), dtype=torch.bool, device=codes.device)
    starts[:, 1:] = (codes[:, 1:] != codes[:, :-1]) | (pos[1:] % block == 0)
    row, first = starts.nonzero(as_tuple=True)
    # A piece ends where the next one starts, or at the end of its row.
    nxt = torch.cat([first[1:], first.new_zeros(1)])
    same_row = torch.cat([row[1:] == row[:-1], row.new_zeros(1, dtype=torch.bool)])
    last = torch.where(same_row, nxt, seq) - 1
    code = codes[row, first].to(torch.int64)
    blk = first // block
    if offset is not None:
        first, last = first + offset[row], last + offset[row]
    return _Pieces(row, blk, first, last, code)


def _piece_pairs(
    q: _Pieces, k: _Pieces, table: torch.Tensor, causal: bool
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every (query piece, key piece) pair of one sample and one doc, padding left out, in steps of at most about
    ``_PAIRS_PER_STEP`` pairs (so that the temporaries stay small on long sequences).

    Yields:
        ``(qi, ki, allowed, ordered)``: the pieces' indices, whether the pair type allows anything, and whether it
        allows only keys at or before the query (CAUSAL, or any type of a causal call).
    """
    pad_seg = table.shape[0] - 1
    types = table.to(torch.int64)
    q_key, k_key = q.row * _DOC_SPAN + (q.code >> SEG_BITS), k.row * _DOC_SPAN + (k.code >> SEG_BITS)
    k_order = torch.argsort(k_key, stable=True)  # then a query piece's partners are one contiguous range
    sorted_keys = k_key[k_order]
    real_q = ((q.code & _SEG_MASK) != pad_seg).nonzero().flatten()
    lo = torch.searchsorted(sorted_keys, q_key[real_q], right=False)
    count = torch.searchsorted(sorted_keys, q_key[real_q], right=True) - lo
    ends = torch.cumsum(count, 0)
    total = int(ends[-1]) if ends.numel() else 0
    # Step boundaries in query pieces: each step takes the pieces whose pairs end in the next _PAIRS_PER_STEP.
    marks = torch.arange(_PAIRS_PER_STEP, max(total, _PAIRS_PER_STEP), _PAIRS_PER_STEP, device=ends.device)
    cuts = torch.searchsorted(ends, marks, right=True).tolist()
    for a, b in zip([0, *cuts], [*cuts, real_q.numel()]):
        if a == b:
            continue
        n = count[a:b]
        qi = real_q[a:b].repeat_interleave(n)
        offset = torch.arange(qi.numel(), device=qi.device) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
        ki = k_order[lo[a:b].repeat_interleave(n) + offset]
        kind = types[q.code[qi] & _SEG_MASK, k.code[ki] & _SEG_MASK]
        yield qi, ki, kind != NONE, (kind == CAUSAL) | causal


def _as_starts(q_start: int | torch.Tensor, bsz: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(q_start, device=device).to(torch.int64).reshape(-1).expand(bsz)


def _block_doc(p: _Pieces, rows: int, blocks: int) -> torch.Tensor:
    """int64 ``[rows * blocks]``: the one doc of each block, or -1 where a block holds several (or none)."""
    index = p.row * blocks + p.block
    doc = p.code >> SEG_BITS
    low = torch.full((rows * blocks,), _DOC_SPAN, dtype=torch.int64, device=doc.device)
    high = torch.full((rows * blocks,), -1, dtype=torch.int64, device=doc.device)
    low.scatter_reduce_(0, index, doc, "amin")
    high.scatter_reduce_(0, index, doc, "amax")
    return torch.where(low == high, low, -1)


def classify_blocks_from_codes(
    q_codes: torch.Tensor,
    k_codes: torch.Tensor,
    table: torch.Tensor,
    block_m: int,
    block_n: int,
    causal: bool,
    q_start: int | torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact live/full maps of the tiles of a segment-code mask.

    Args:
        q_codes: int32 ``[Bm or 1, Sq]`` codes of the queries (positions ``q_start .. q_start + Sq - 1``).
        k_codes: int32 ``[Bm or 1, Sk]`` codes of the keys (positions ``0 .. Sk - 1``).
        table: int8 ``[k + 1, k + 1]`` pair table (last row and column: padding, NONE).
        block_m, block_n: the tile.
        causal: also require key position <= query position everywhere.
        q_start: position of the first query, an int or int ``[1 or Bm]`` per sample.
        window: also require key position > query position - window (None: no window).

    Returns:
        ``(live, full)``, bool ``[Bm, NQ, NK]`` on q_codes' device. A tile is full when every pair is allowed and
        its key block lies inside the keys.
    """
    seq_q, seq_k = q_codes.shape[1], k_codes.shape[1]
    dev = q_codes.device
    starts = torch.as_tensor(q_start, device=dev).reshape(-1)
    bsz = max(q_codes.shape[0], k_codes.shape[0], starts.shape[0])
    nq, nk = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    live = torch.zeros((bsz, nq, nk), dtype=torch.bool, device=dev)
    if nq == 0 or nk == 0:
        return live, live.clone()
    q = _pieces(q_codes.expand(bsz, -1), block_m, _as_starts(q_start, bsz, dev))
    k = _pieces(k_codes.expand(bsz, -1), block_n)
    broken = torch.zeros_like(live)  # some pair of the tile's piece pairs is not allowed
    for qi, ki, allowed, ordered in _piece_pairs(q, k, table, causal):
        some = allowed & (~ordered | (k.first[ki] <= q.last[qi]))
        every = allowed & (~ordered | (k.last[ki] <= q.first[qi]))
        if window is not None:
            some &= k.last[ki] > q.first[qi] - window
            every &= k.first[ki] > q.last[qi] - window
        tile = (q.row[qi] * nq + q.block[qi]) * nk + k.block[ki]
        live.view(-1)[tile[some]] = True
        broken.view(-1)[tile[~every]] = True
    # Full: both blocks hold one doc, the same (so every piece pair of the tile was paired), and none broke.
    q_doc, k_doc = _block_doc(q, bsz, nq).view(bsz, nq, 1), _block_doc(k, bsz, nk).view(bsz, 1, nk)
    inside = torch.arange(1, nk + 1, device=dev) * block_n <= seq_k  # a key block past the keys is never full
    return live, live & ~broken & (q_doc == k_doc) & (q_doc >= 0) & inside


def count_pairs_from_codes(
    q_codes: torch.Tensor, k_codes: torch.Tensor, table: torch.Tensor, causal: bool, q_start: int | torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Allowed (query, key) pairs of each sample of a segment-code mask (arguments as for
    :func:`classify_blocks_from_codes`), in O(S + run pairs).

    Returns:
        int64 ``[Bm]``.
    """
    seq_q, seq_k = q_codes.shape[1], k_codes.shape[1]
    dev = q_codes.device
    bsz = max(q_codes.shape[0], k_codes.shape[0], torch.as_tensor(q_start).reshape(-1).shape[0])
    total = torch.zeros(bsz, dtype=torch.int64, device=dev)
    if seq_q == 0 or seq_k == 0:
        return total
    q = _pieces(q_codes.expand(bsz, -1), seq_q, _as_starts(q_start, bsz, dev))  # one block a side: pieces are runs
    k = _pieces(k_codes.expand(bsz, -1), seq_k)
    for qi, ki, allowed, ordered in _piece_pairs(q, k, table, causal):
        q0, q1, k0, k1 = q.first[qi], q.last[qi], k.first[ki], k.last[ki]
        pairs = torch.where(ordered, _keys_up_to(q0, q1, k0, k1, 0), (q1 - q0 + 1) * (k1 - k0 + 1))
        if window is not None:  # less the pairs whose key is at or before query - window
            pairs = pairs - _keys_up_to(q0, q1, k0, k1, -window)
        total.index_add_(0, q.row[qi], pairs * allowed)
    return total


def _keys_up_to(q0: torch.Tensor, q1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, shift: int) -> torch.Tensor:
    """Pairs (i, j) with q0 <= i <= q1, k0 <= j <= k1 and j <= i + shift, elementwise (int64 bounds)."""
    q0, q1 = q0 + shift, q1 + shift
    n_k = k1 - k0 + 1
    # Query i sees keys k0 .. min(i, k1): a ramp 1, 2, ... while i <= k1, then all n_k keys.
    lo, hi = torch.maximum(q0, k0), torch.minimum(q1, k1)
    ramp_n = (hi - lo + 1).clamp(min=0)
    ramp = ramp_n * (lo - k0 + 1) + ramp_n * (ramp_n - 1) // 2
    flat = (q1 - torch.maximum(q0, k1 + 1) + 1).clamp(min=0) * n_k
    return ramp + flat
