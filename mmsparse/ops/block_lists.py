"""Block lists straight from the per-token bits: two launches, no host synchronisation, no tile-map temporaries.

1. ``block_summary_kernel`` reduces each query block and each key block to a few int32 words (``SUM[b, blk]``):
   query block: OR of its rows' bits, AND over its real rows (those < seq_q), first row position, and (causal)
   per segment t the last row position that sees t; key block: OR of its bits, a flag set when some column is
   padding or past seq_k, its last column, and (causal) per segment t its first column.
2. ``block_lists_kernel`` classifies BR row blocks against CB column blocks at a time from those summaries and
   writes, per row block, the full column blocks in ascending order, then the partial ones: a first pass counts
   the full tiles, a second writes each id at its place (a cumulative sum over the chunk).

A tile is full when no segment among its keys is unseen by one of its real rows, none of its columns is padding,
and (causal) its last column is visible from its first row; a full tile is always live. It is live when some
pair is allowed: some segment shared by a row and a key (causal: seen by a row at or after the segment's first
column in the tile). The result equals ``lists_from_classes(*classify_blocks_from_bits(...))`` on the used prefix
of each row; entries past ``counts.sum(-1)`` are left unwritten.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..blocks import BlockLists, cdiv
from .common import interpreter_active
from .launch import FastKernel

_NEG = tl.constexpr(-(2**31) + 1)  # below every position
_POS = tl.constexpr(2**31 - 1)  # above every position

# Elements of the largest tile a program holds (e.g. [BR, CB, K]): modest on a GPU (registers), large in the
# interpreter, where every tile op is one numpy call and fewer, larger programs are much faster.
_GPU_TILE = 4096
_INTERPRETER_TILE = 1 << 16
_GPU_CHUNK = 256  # column blocks per step on a GPU: one step for S = 16k at 64-wide tiles


@triton.jit(do_not_specialize=["stride_qb", "stride_kb", "stride_pb", "stride_sb", "seq_q", "seq_k", "n_q", "n_k"])
def block_summary_kernel(
    Q_BITS, K_BITS, PAST, SUM,
    stride_qb, stride_kb, stride_pb, stride_sb,
    seq_q, seq_k, n_q, n_k, bit_mask,
    BM: tl.constexpr, BN: tl.constexpr, GQ: tl.constexpr, GK: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    """Program (g, b) summarises query blocks g*GQ .. g*GQ+GQ-1 and key blocks g*GK .. g*GK+GK-1 of sample b
    into ``SUM[b, blk]`` and ``SUM[b, n_q + blk]`` (W words each)."""
    i_g, i_b = tl.program_id(0), tl.program_id(1)
    b64 = i_b.to(tl.int64)  # B * S token bits may pass 2^31
    offs_t = tl.arange(0, K)
    p_sum = SUM + i_b * stride_sb
    if i_g * GQ < n_q:
        offs_qb = i_g * GQ + tl.arange(0, GQ)  # [GQ]
        offs_m = offs_qb[:, None] * BM + tl.arange(0, BM)[None, :]  # [GQ, BM]
        m_q = offs_m < seq_q
        b_q = tl.load(Q_BITS + b64 * stride_qb + offs_m, mask=m_q, other=0)  # [GQ, BM]; bits >= k meet no key
        b_see = (b_q[:, :, None] >> offs_t[None, None, :]) & 1  # [GQ, BM, K]
        p_s = p_sum + offs_qb * W
        m_s = offs_qb < n_q
        # OR, and AND over the real rows, bit by bit; the bits are distinct, so their sum is their OR.
        tl.store(p_s, tl.sum(tl.max(b_see, 1) << offs_t[None, :], 1), mask=m_s)
        tl.store(p_s + 1, tl.sum(tl.min(tl.where(m_q[:, :, None], b_see, 1), 1) << offs_t[None, :], 1), mask=m_s)
        if IS_CAUSAL:
            past = tl.load(PAST + i_b * stride_pb)
            tl.store(p_s + 2, past + offs_qb * BM, mask=m_s)
            b_last = tl.max(tl.where(b_see != 0, past + offs_m[:, :, None], _NEG), 1)  # [GQ, K]
            tl.store(p_s[:, None] + 3 + offs_t[None, :], b_last, mask=m_s[:, None])
    if i_g * GK < n_k:
        offs_kb = i_g * GK + tl.arange(0, GK)  # [GK]
        offs_n = offs_kb[:, None] * BN + tl.arange(0, BN)[None, :]  # [GK, BN]
        b_k = tl.load(K_BITS + b64 * stride_kb + offs_n, mask=offs_n < seq_k, other=0) & bit_mask  # [GK, BN]
        b_has = (b_k[:, :, None] >> offs_t[None, None, :]) & 1  # [GK, BN, K]
        p_s = p_sum + (n_q + offs_kb) * W
        m_s = offs_kb < n_k
        tl.store(p_s, tl.sum(tl.max(b_has, 1) << offs_t[None, :], 1), mask=m_s)
        tl.store(p_s + 1, tl.max((b_k == 0).to(tl.int32), 1), mask=m_s)  # a padding column, or one past seq_k
        if IS_CAUSAL:
            tl.store(p_s + 2, offs_kb * BN + BN - 1, mask=m_s)  # a block running past seq_k is dirty anyway
            b_first = tl.min(tl.where(b_has != 0, offs_n[:, :, None], _POS), 1)  # [GK, K]
            tl.store(p_s[:, None] + 3 + offs_t[None, :], b_first, mask=m_s[:, None])


@triton.jit
def _classify(r_or, r_x, r_edge, r_pos, p_col, offs_c, m_r, n_c, K: tl.constexpr, W: tl.constexpr,
              IS_CAUSAL: tl.constexpr, BY_KEY: tl.constexpr, LIVE: tl.constexpr):
    """(full, live) bool ``[BR, CB]`` of row blocks (summaries ``r_*``: [BR, 1], [BR, 1, K]) against column
    blocks offs_c; live only when LIVE (full otherwise)."""
    m_c = offs_c < n_c
    p_c = p_col + offs_c * W  # [CB]
    c_or = tl.load(p_c, mask=m_c, other=0)[None, :]  # [1, CB]
    c_x = tl.load(p_c + 1, mask=m_c, other=0)[None, :]
    if BY_KEY:
        q_or, q_and, k_or, k_dirty = c_or, c_x, r_or, r_x
    else:
        q_or, q_and, k_or, k_dirty = r_or, r_x, c_or, c_x
    m_rc = m_r[:, None] & m_c[None, :]  # [BR, CB]
    full = (((k_or & ~q_and) | k_dirty) == 0) & m_rc
    live = full
    if IS_CAUSAL:
        c_edge = tl.load(p_c + 2, mask=m_c, other=0)[None, :]
        if BY_KEY:
            full = full & (r_edge <= c_edge)
        else:
            full = full & (c_edge <= r_edge)
        if LIVE:
            offs_t = tl.arange(0, K)
            c_pos = tl.load(p_c[:, None] + 3 + offs_t[None, :], mask=m_c[:, None], other=0)[None, :, :]  # [1, CB, K]
            if BY_KEY:
                see = c_pos >= r_pos  # [BR, CB, K]
            else:
                see = r_pos >= c_pos
            live = (tl.max(see.to(tl.int32), 2) != 0) & m_rc
    elif LIVE:
        live = ((q_or & k_or) != 0) & m_rc
    return full, live


@triton.jit
def store_chunk(p_idx, offs_c, full, live, i_full, i_part):
    """Write one chunk of column blocks (offs_c, classes [BR, CB]) into each row's list: full ones at i_full on,
    partial ones at i_part on (the row's full count past its start); returns the advanced positions."""
    part = live & ~full
    b_f, b_p = full.to(tl.int32), part.to(tl.int32)  # [BR, CB]
    pos = tl.where(full, i_full[:, None] + tl.cumsum(b_f, 1), i_part[:, None] + tl.cumsum(b_p, 1)) - 1
    tl.store(p_idx + pos, offs_c[None, :], mask=full | part)
    return i_full + tl.sum(b_f, 1), i_part + tl.sum(b_p, 1)


@triton.jit(do_not_specialize=["stride_sb", "stride_cb", "stride_ib", "stride_ir", "n_q", "n_k"])
def block_lists_kernel(
    SUM, COUNTS, INDICES,
    stride_sb, stride_cb, stride_ib, stride_ir,
    n_q, n_k,
    BR: tl.constexpr, CB: tl.constexpr, K: tl.constexpr, W: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BY_KEY: tl.constexpr,
):
    """Program (g, b) writes ``COUNTS[b, r]`` and ``INDICES[b, r, :n_full + n_part]`` of the row blocks
    r = g*BR .. g*BR+BR-1 (key blocks when BY_KEY) of sample b, walking the column blocks CB at a time."""
    i_g, i_b = tl.program_id(0), tl.program_id(1)
    p_sum = SUM + i_b * stride_sb
    if BY_KEY:
        n_r, n_c, p_row, p_col = n_k, n_q, p_sum + n_q * W, p_sum
    else:
        n_r, n_c, p_row, p_col = n_q, n_k, p_sum, p_sum + n_q * W
    offs_r = i_g * BR + tl.arange(0, BR)  # [BR]
    m_r = offs_r < n_r
    p_r = p_row + offs_r * W
    r_or = tl.load(p_r, mask=m_r, other=0)[:, None]  # [BR, 1]
    r_x = tl.load(p_r + 1, mask=m_r, other=0)[:, None]
    r_edge, r_pos = r_or, r_or
    if IS_CAUSAL:
        offs_t = tl.arange(0, K)
        r_edge = tl.load(p_r + 2, mask=m_r, other=0)[:, None]
        r_pos = tl.load(p_r[:, None] + 3 + offs_t[None, :], mask=m_r[:, None], other=0)[:, None, :]  # [BR, 1, K]
    offs_cb = tl.arange(0, CB)

    n_full = tl.zeros([BR], dtype=tl.int32)
    for c0 in range(0, n_c, CB):
        full, _ = _classify(r_or, r_x, r_edge, r_pos, p_col, c0 + offs_cb, m_r, n_c, K, W, IS_CAUSAL, BY_KEY, False)
        n_full += tl.sum(full.to(tl.int32), 1)

    p_idx = INDICES + i_b.to(tl.int64) * stride_ib + offs_r.to(tl.int64)[:, None] * stride_ir  # [BR, 1]
    i_full, i_part = tl.zeros([BR], dtype=tl.int32), n_full
    for c0 in range(0, n_c, CB):
        offs_c = c0 + offs_cb
        full, live = _classify(r_or, r_x, r_edge, r_pos, p_col, offs_c, m_r, n_c, K, W, IS_CAUSAL, BY_KEY, True)
        i_full, i_part = store_chunk(p_idx, offs_c, full, live, i_full, i_part)
    p_cnt = COUNTS + i_b * stride_cb + offs_r * 2
    tl.store(p_cnt, n_full, mask=m_r)
    tl.store(p_cnt + 1, i_part - n_full, mask=m_r)


_SUMMARY, _LISTS = FastKernel(block_summary_kernel), FastKernel(block_lists_kernel)


def allocate_lists(
    bm: int, seq_q: int, seq_k: int, block_m: int, block_n: int, by_key: bool, device: torch.device
) -> tuple[int, int, int, int, torch.Tensor, torch.Tensor]:
    """(n_q, n_k, rows, columns, counts ``[Bm, rows, 2]``, indices ``[Bm, rows, columns]``) of block lists at a
    tile: rows are the query blocks, or the key blocks when by_key. Uninitialised: the builders write them."""
    n_q, n_k = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    n_r, n_c = (n_k, n_q) if by_key else (n_q, n_k)
    counts = torch.empty((bm, n_r, 2), dtype=torch.int32, device=device)
    indices = torch.empty((bm, n_r, n_c), dtype=torch.int32, device=device)
    return n_q, n_k, n_r, n_c, counts, indices


def kernels_run_on(device: torch.device) -> bool:
    """Whether these kernels take tensors of ``device``: CUDA, or the CPU when Triton's interpreter is on."""
    return device.type == "cuda" or interpreter_active()


def build_block_lists(
    q_bits: torch.Tensor,
    k_bits: torch.Tensor,
    num_segments: int,
    block_m: int,
    block_n: int,
    causal: bool,
    q_start: torch.Tensor,
    by_key: bool = False,
    tile_elems: int | None = None,
    fit: bool | None = None,
    summaries: dict[tuple[int, int], torch.Tensor] | None = None,
) -> BlockLists:
    """Block lists of a topology mask at tile ``block_m`` x ``block_n``.

    Args:
        q_bits: int32 ``[Bm, Sq]`` row bits of the queries (at positions q_start .. q_start + Sq - 1).
        k_bits: int32 ``[Bm or 1, Sk]`` one-hot column bits of the keys (0 for padding); may be an expanded view.
        num_segments: k <= 32; bits from k up are ignored.
        causal: also require key position <= query position.
        q_start: int32 ``[1]`` or ``[Bm]``, the position of each sample's first query.
        by_key: per key block its query blocks instead of per query block its key blocks.
        tile_elems, fit: override the program sizes (see :func:`_program_sizes`; tests use small tiles to cover
            several chunks and row groups).
        summaries: optional cache of the block summaries per tile, for lists of one mask (the dK/dV lists and
            the dQ lists of one tile share them: one launch and one allocation fewer).

    Returns:
        :class:`BlockLists` with counts ``[Bm, R, 2]`` and indices ``[Bm, R, C]`` ((R, C) = (NQ, NK), or (NK, NQ)
        when by_key) on the input device.
    """
    bm, seq_q, seq_k = q_bits.shape[0], q_bits.shape[1], k_bits.shape[1]
    if not 1 <= num_segments <= 32:
        raise ValueError(f"num_segments must be in [1, 32]; got {num_segments}")
    if k_bits.shape[0] not in (1, bm) or q_start.numel() not in (1, bm):
        raise ValueError(f"q_bits has {bm} rows but k_bits has {k_bits.shape[0]} and q_start {q_start.numel()}")
    dev = q_bits.device
    q_bits, k_bits = (t if t.stride(1) == 1 else t.contiguous() for t in (q_bits, k_bits))
    if q_start.dtype != torch.int32 or q_start.device != dev or q_start.dim() != 1:
        q_start = q_start.to(device=dev, dtype=torch.int32).reshape(-1)
    n_q, n_k, n_r, n_c, counts, indices = allocate_lists(bm, seq_q, seq_k, block_m, block_n, by_key, dev)
    if n_r == 0 or n_c == 0:
        return BlockLists(counts.zero_(), indices)

    k = max(2, 1 << (num_segments - 1).bit_length())  # segments rounded up to a power of two
    w = 3 + k if causal else 2
    interpret = dev.type != "cuda"
    elems = tile_elems or (_INTERPRETER_TILE if interpret else _GPU_TILE)
    gq, gk, cb, br = _program_sizes(n_q, n_k, n_r, n_c, block_m, block_n, k, causal, elems,
                                    interpret if fit is None else fit)
    summary = None if summaries is None else summaries.get((block_m, block_n))
    if summary is None:
        summary = torch.empty((bm, n_q + n_k, w), dtype=torch.int32, device=dev)
        _SUMMARY[(max(cdiv(n_q, gq), cdiv(n_k, gk)), bm)](
            q_bits, k_bits, q_start, summary,
            q_bits.stride(0) if q_bits.shape[0] > 1 else 0, k_bits.stride(0) if k_bits.shape[0] > 1 else 0,
            q_start.stride(0) if q_start.shape[0] > 1 else 0, summary.stride(0),
            seq_q, seq_k, n_q, n_k, -1 if num_segments == 32 else (1 << num_segments) - 1,
            BM=block_m, BN=block_n, GQ=gq, GK=gk, K=k, W=w, IS_CAUSAL=causal,
        )
        if summaries is not None:
            summaries[(block_m, block_n)] = summary
    _LISTS[(cdiv(n_r, br), bm)](
        summary, counts, indices,
        summary.stride(0), counts.stride(0), indices.stride(0), indices.stride(1),
        n_q, n_k,
        BR=br, CB=cb, K=k, W=w, IS_CAUSAL=causal, BY_KEY=by_key,
    )
    return BlockLists(counts, indices)


@functools.lru_cache(maxsize=1024)
def _program_sizes(
    n_q: int, n_k: int, n_r: int, n_c: int, block_m: int, block_n: int, k: int, causal: bool, elems: int, fit: bool
) -> tuple[int, int, int, int]:
    """(GQ, GK, CB, BR): powers of two whose tiles ([GQ, BM, K], [GK, BN, K], [BR, CB, K]) hold at most about
    ``elems`` elements. ``fit``: no larger than the lengths need (the interpreter, which compiles nothing);
    otherwise fixed per tile shape, so that a new length never compiles a new kernel."""

    def size(n: int, limit: int) -> int:
        if fit:
            limit = min(limit, 1 << (n - 1).bit_length())
        return 1 << max(limit, 1).bit_length() - 1

    per_col = max(k if causal else 1, 4)  # [BR, CB] index and pointer tiles take more registers than their size
    cb = size(n_c, elems // per_col if fit else min(elems // per_col, _GPU_CHUNK))
    return size(n_q, elems // (block_m * k)), size(n_k, elems // (block_n * k)), cb, size(n_r, elems // (cb * per_col))
