"""Block lists of a segment-code mask (:mod:`mmsparse.segments`): exact, on the device, no host synchronisation.

Each side (queries, keys) is cut into *runs*: maximal stretches of tokens with one code. A tile's rows meet a
few runs and its columns a few more; every (query, key) pair of the tile lies in exactly one (row run, column
run) pair, and the pair type of that run pair decides all of its pairs at once:

- another doc, NONE, or padding: none allowed;
- FULL: all allowed;
- CAUSAL (or any type when the call is causal): all allowed when the run pair's last key is at or before its
  first query, some when its first key is at or before its last query, none otherwise.

A tile is full when every run pair it meets allows all of its pairs and its key block lies inside the keys; live
when some run pair allows some pair. Tiles whose query and key blocks hold disjoint doc ranges are empty without
looking at their runs (the cross-sample tiles of a pack). The cost per tile is the product of the runs its row
and column blocks meet: 1 to 4 for segments longer than a tile, more for tiny segments.

Runs are built with a few torch ops per side (``torch.cumsum`` over the code changes, scatters into ``[B, S]``
buffers): metadata is O(S) plus the lists.
"""

from __future__ import annotations

import torch
import triton

from ..blocks import BlockLists, cdiv
from ..kernels.tl.segment_lists import segment_lists_kernel
from ..segments import SEG_BITS
from .block_lists import allocate_lists
from .launch import FastKernel


def code_runs(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of each row of codes int32 ``[B, S]`` (S >= 1).

    Returns:
        ``(run_of_token, starts, run_codes)``: int32 ``[B, S]`` run index of each token; int32 ``[B, S + 2]``
        where run r covers tokens ``starts[r] .. starts[r + 1] - 1`` (``starts[n_runs] = S``); int32
        ``[B, S + 2]`` the code of each run. Entries past the last run are S (starts) or unused.
    """
    bsz, seq = codes.shape
    change = torch.ones((bsz, seq), dtype=torch.bool, device=codes.device)
    torch.ne(codes[:, 1:], codes[:, :-1], out=change[:, 1:])
    run = torch.cumsum(change, dim=1, dtype=torch.int32) - 1
    slot = torch.where(change, run, seq + 1)  # every non-first token of a run writes the spare slot S + 1
    pos = torch.arange(seq, device=codes.device, dtype=torch.int32).expand(bsz, seq)
    starts = torch.full((bsz, seq + 2), seq, dtype=torch.int32, device=codes.device)
    starts.scatter_(1, slot.to(torch.int64), pos)
    run_codes = torch.zeros((bsz, seq + 2), dtype=torch.int32, device=codes.device)
    run_codes.scatter_(1, slot.to(torch.int64), codes.expand(bsz, seq).to(torch.int32))
    return run, starts, run_codes


def block_summary(codes: torch.Tensor, run: torch.Tensor, block: int) -> torch.Tensor:
    """int32 ``[B, blocks, 4]``: each block's first and last run and its lowest and highest doc (the words
    ``_classify_runs`` reads at offsets 0-3)."""
    bsz, seq = codes.shape
    n = cdiv(seq, block)
    first = run[:, ::block]
    last = run[:, torch.clamp(torch.arange(1, n + 1, device=run.device) * block, max=seq) - 1]
    docs = codes >> SEG_BITS
    padded = torch.nn.functional.pad(docs, (0, n * block - seq), mode="replicate") if n * block != seq else docs
    docs = padded.view(bsz, n, block)
    return torch.stack([first, last, docs.amin(-1), docs.amax(-1)], dim=-1).to(torch.int32).contiguous()



_LISTS = FastKernel(segment_lists_kernel)


class CodeRuns:
    """The runs of one side's codes, built once per mask and shared by every tile's lists."""

    __slots__ = ("codes", "run", "starts", "run_codes", "_summaries")

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes
        self.run, self.starts, self.run_codes = code_runs(codes)
        self._summaries: dict[int, torch.Tensor] = {}

    def summary(self, block: int) -> torch.Tensor:
        s = self._summaries.get(block)
        if s is None:
            s = self._summaries[block] = block_summary(self.codes, self.run, block)
        return s


def build_segment_lists(
    q_runs: CodeRuns, k_runs: CodeRuns, table: torch.Tensor, block_m: int, block_n: int, causal: bool,
    q_start: torch.Tensor, by_key: bool = False, fit: bool | None = None,
) -> BlockLists:
    """Block lists of a segment-code mask at tile ``block_m`` x ``block_n``.

    Args:
        q_runs, k_runs: the runs of the query codes ``[Bm, Sq]`` and key codes ``[Bm or 1, Sk]``.
        table: int8 ``[k + 1, k + 1]`` pair table.
        causal: also require key position <= query position everywhere.
        q_start: int32 ``[1]`` or ``[Bm]``, the position of each sample's first query.
        by_key: per key block its query blocks instead of per query block its key blocks.
        fit: program sizes no larger than the lengths need (default: under the interpreter).

    Returns:
        :class:`BlockLists` with counts ``[Bm, R, 2]`` and indices ``[Bm, R, C]``.
    """
    bm, seq_q = q_runs.codes.shape
    seq_k = k_runs.codes.shape[1]
    dev = q_runs.codes.device
    n_q, n_k, n_r, n_c, counts, indices = allocate_lists(bm, seq_q, seq_k, block_m, block_n, by_key, dev)
    if n_r == 0 or n_c == 0:
        return BlockLists(counts.zero_(), indices)
    q_sum, k_sum = q_runs.summary(block_m), k_runs.summary(block_n)
    fit = dev.type != "cuda" if fit is None else fit
    br = 4 if not fit else min(64, triton.next_power_of_2(n_r))
    cb = 64 if not fit else min(256, triton.next_power_of_2(n_c))
    shared_k = k_runs.codes.shape[0] == 1
    _LISTS[(cdiv(n_r, br), bm)](
        q_sum, k_sum, q_runs.starts, q_runs.run_codes, k_runs.starts, k_runs.run_codes, table, q_start,
        counts, indices,
        q_sum.stride(0), 0 if shared_k else k_sum.stride(0), q_runs.starts.stride(0),
        0 if shared_k else k_runs.starts.stride(0), q_start.stride(0) if q_start.shape[0] > 1 else 0,
        counts.stride(0), indices.stride(0), indices.stride(1), table.stride(0),
        seq_q, seq_k, n_q, n_k,
        BM=block_m, BN=block_n, BR=br, CB=cb, IS_CAUSAL=causal, BY_KEY=by_key,
    )
    return BlockLists(counts, indices)
