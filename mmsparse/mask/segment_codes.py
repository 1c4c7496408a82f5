"""Segment codes: the mask of any topology (pair types 0/1/2, up to 4095 segments) and of packed samples.

Each token carries one int32 code, ``(doc << 12) | seg``: ``doc`` is the sample the token belongs to in a packed
sequence (0 without packing) and ``seg`` its topology segment. Padding tokens carry :func:`pad_code`, whose
segment is the pair table's padding row and column (NONE). A query at position i may see a key at position j when

    doc(i) == doc(j)  and  table[seg(i), seg(j)] is FULL, or CAUSAL with j <= i

(and j <= i everywhere when the call is causal). ``table`` is the topology's ``[k + 1, k + 1]`` int8 pair table
(:meth:`mmsparse.mask.topology.Topology.pair_table`). Codes are O(S); the table is O(k^2), shared by every sample.

Docs rise along a packed sequence and padding comes last (its doc is the largest), so a tile whose query and key
blocks hold disjoint doc ranges is empty: the block lists skip the cross-sample tiles of a pack in O(1) each.
"""

from __future__ import annotations

import torch

from ..kernels.constants import SEG_BITS

MAX_DOCS = (1 << (31 - SEG_BITS)) - 1  # samples per pack: docs 0 .. MAX_DOCS - 1; MAX_DOCS is padding's
PAD_DOC = MAX_DOCS


def pad_code(num_segments: int) -> int:
    """The code of a padding token: the last doc, the padding segment."""
    return (PAD_DOC << SEG_BITS) | num_segments


def token_codes(seg_lens: torch.Tensor, num_segments: int, seq_len: int, packed: bool) -> torch.Tensor:
    """Per-token codes of each row of lengths.

    Args:
        seg_lens: int ``[B, k]`` (one sample per row, doc 0) or, when ``packed``, ``[N, k]``: N samples laid end to
            end in one row (sample n is doc n).
        num_segments: k.
        seq_len: S; tokens past a row's total are padding.

    Returns:
        int32 ``[B, S]`` (``[1, S]`` when packed) on seg_lens' device.
    """
    k = num_segments
    dev = seg_lens.device
    lens = seg_lens.to(torch.int64)
    if packed:
        lens = lens.reshape(1, -1)  # runs of every sample in order: run r is doc r // k, segment r % k
    runs = lens.shape[1]
    r = torch.arange(runs + 1, device=dev, dtype=torch.int64)
    run_codes = ((r // k) << SEG_BITS) | (r % k) if packed else r.clamp(max=k)
    # searchsorted gives `runs` past the last end. No in-place write: traced, equal lengths then make equal graph
    # nodes, which layers over the same lengths share
    run_codes = torch.where(r == runs, pad_code(k), run_codes)
    ends = torch.cumsum(lens, dim=-1)
    pos = torch.arange(seq_len, device=dev, dtype=torch.int64).expand(lens.shape[0], seq_len)
    run = torch.searchsorted(ends.contiguous(), pos.contiguous(), right=True)
    return run_codes[run].to(torch.int32)


def query_codes(codes: torch.Tensor, seq_q: int, q_start: torch.Tensor | None, num_segments: int) -> torch.Tensor:
    """The codes of the queries: the last ``seq_q`` positions, or ``q_start[b] + i`` per sample (int ``[B]``);
    positions outside the keys are padding."""
    seq_k = codes.shape[1]
    if q_start is None:
        return codes[:, seq_k - seq_q:].contiguous()
    q_start = q_start.to(device=codes.device, dtype=torch.int64).reshape(-1)
    codes = codes.expand(q_start.shape[0], -1)
    pos = q_start[:, None] + torch.arange(seq_q, device=codes.device)
    inside = (pos >= 0) & (pos < seq_k)
    gathered = codes.gather(1, pos.clamp(0, max(seq_k - 1, 0)))
    return torch.where(inside, gathered, pad_code(num_segments)).to(torch.int32)


def decode(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc, segment) of each code, int64."""
    codes = codes.to(torch.int64)
    return codes >> SEG_BITS, codes & ((1 << SEG_BITS) - 1)
