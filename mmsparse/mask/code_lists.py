"""Block lists of a segment-code mask (:mod:`mmsparse.mask.segment_codes`): exact, on the device, no host
synchronisation but the packed lists' one (``bit_lists.write_lists``).

Each side (queries, keys) is cut into *runs*: maximal stretches of tokens with one code. A tile's rows meet a
few runs and its columns a few more; every (query, key) pair of the tile lies in exactly one (row run, column
run) pair, and the pair type of that run pair decides all of its pairs at once:

- another doc, NONE, or padding: none allowed;
- FULL: all allowed;
- CAUSAL (or any type when the call is causal): all allowed when the run pair's last key is at or before its
  first query, some when its first key is at or before its last query, none otherwise;
- with a window W on top: all allowed only if its first key is past its last query minus W, some only if its last
  key is past its first query minus W.

A tile is full when every run pair it meets allows all of its pairs and its key block lies inside the keys; live
when some run pair allows some pair. Tiles whose query and key blocks hold disjoint doc ranges are empty without
looking at their runs (the cross-sample tiles of a pack). The cost per tile is the product of the runs its row
and column blocks meet: 1 to 4 for segments longer than a tile, more for tiny segments.

Runs are built by one launch per side (a program walks each row), each block size's summary by one more:
metadata is O(S) plus the lists.
"""

from __future__ import annotations

import torch

from ..kernels.tl.code_lists import code_runs_kernel, run_summary_kernel, segment_lists_kernel
from ..runtime.launch import FastKernel
from .bit_lists import COMPACT_BYTES, kernel_window, no_launch, write_lists
from .blocks import BlockLists, cdiv, next_power_of_2

# Tokens a step of the runs kernel (one program per row walks the row): 64k tokens in 16 steps.
_RUN_CHUNK_GPU, _RUN_CHUNK_INTERPRETER = 4096, 1024
_SUMMARY_TOKENS = 4096  # tokens a summary program reads ([G, BLOCK])


def code_runs(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of each row of codes int32 ``[B, S]`` (S >= 1), one launch.

    Returns:
        ``(run_of_token, starts, run_codes)``: int32 ``[B, S]`` run index of each token; int32 ``[B, S + 2]``
        where run r covers tokens ``starts[r] .. starts[r + 1] - 1`` (``starts[n_runs] = S``); int32
        ``[B, S + 2]`` the code of each run. Entries past ``starts[n_runs]`` are unwritten.
    """
    bsz, seq = codes.shape
    if codes.stride(1) != 1:  # the kernel steps a row by 1
        codes = codes.contiguous()
    run = torch.empty((bsz, seq), dtype=torch.int32, device=codes.device)
    starts = torch.empty((bsz, seq + 2), dtype=torch.int32, device=codes.device)
    run_codes = torch.empty_like(starts)
    chunk = _RUN_CHUNK_GPU if codes.device.type == "cuda" else _RUN_CHUNK_INTERPRETER
    _RUNS[(bsz,)](codes, run, starts, run_codes, codes.stride(0), run.stride(0), starts.stride(0), seq, CHUNK=chunk)
    return run, starts, run_codes


def block_summary(codes: torch.Tensor, run: torch.Tensor, block: int) -> torch.Tensor:
    """int32 ``[B, blocks, 4]``: each block's first and last run and its lowest and highest doc (the words
    ``_classify_runs`` reads at offsets 0-3), one launch."""
    bsz, seq = codes.shape
    if codes.stride(1) != 1:  # the kernel steps a row by 1
        codes = codes.contiguous()
    n = cdiv(seq, block)
    out = torch.empty((bsz, n, 4), dtype=torch.int32, device=codes.device)
    g = max(1, min(_SUMMARY_TOKENS // block, next_power_of_2(n)))
    _SUMMARY[(cdiv(n, g), bsz)](codes, run, out, codes.stride(0), run.stride(0), out.stride(0), seq, n,
                                BLOCK=block, G=g)
    return out


_RUNS, _SUMMARY, _LISTS = FastKernel(code_runs_kernel), FastKernel(run_summary_kernel), FastKernel(segment_lists_kernel)


class CodeRuns:
    """The runs of one side's codes, built once per mask and shared by every tile's lists."""

    __slots__ = ("codes", "run", "starts", "run_codes", "_summaries")

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes if codes.stride(1) == 1 else codes.contiguous()  # the kernels step a row by 1
        self.run, self.starts, self.run_codes = code_runs(self.codes)
        self._summaries: dict[int, torch.Tensor] = {}

    def summary(self, block: int) -> torch.Tensor:
        s = self._summaries.get(block)
        if s is None:
            s = self._summaries[block] = block_summary(self.codes, self.run, block)
        return s


def build_segment_lists(
    q_runs: CodeRuns, k_runs: CodeRuns, table: torch.Tensor, block_m: int, block_n: int, causal: bool,
    q_start: torch.Tensor, by_key: bool = False, fit: bool | None = None, compact: bool | None = None,
    compact_bytes: int = COMPACT_BYTES,
    window: int | None = None,
) -> BlockLists:
    """Block lists of a segment-code mask at tile ``block_m`` x ``block_n``.

    Args:
        q_runs, k_runs: the runs of the query codes ``[Bm, Sq]`` and key codes ``[Bm or 1, Sk]``.
        table: int8 ``[k + 1, k + 1]`` pair table.
        causal: also require key position <= query position everywhere.
        q_start: int32 ``[1]`` or ``[Bm]``, the position of each sample's first query.
        by_key: per key block its query blocks instead of per query block its key blocks.
        fit: program sizes no larger than the lengths need (default: under the interpreter).
        compact: packed (CSR) lists or fixed slots; default by size, above ``compact_bytes``
            (``bit_lists.write_lists``).
        window: also require key position > query position - window (None: no window).

    Returns:
        :class:`BlockLists` of R = NQ rows (NK when by_key).
    """
    mask_batch, seq_q = q_runs.codes.shape
    seq_k = k_runs.codes.shape[1]
    dev = q_runs.codes.device
    n_q, n_k = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    n_r, n_c = (n_k, n_q) if by_key else (n_q, n_k)
    if n_r == 0 or n_c == 0:
        return write_lists(no_launch, mask_batch, n_r, n_c, dev)
    q_sum, k_sum = q_runs.summary(block_m), k_runs.summary(block_n)
    fit = dev.type != "cuda" if fit is None else fit
    br = 4 if not fit else min(64, next_power_of_2(n_r))
    cb = 64 if not fit else min(256, next_power_of_2(n_c))
    shared_k = k_runs.codes.shape[0] == 1

    def launch(phase: int, counts: torch.Tensor, indices: torch.Tensor) -> None:
        _LISTS[(cdiv(n_r, br), mask_batch)](
            q_sum, k_sum, q_runs.starts, q_runs.run_codes, k_runs.starts, k_runs.run_codes, table, q_start,
            counts, indices,
            q_sum.stride(0), 0 if shared_k else k_sum.stride(0), q_runs.starts.stride(0),
            0 if shared_k else k_runs.starts.stride(0), q_start.stride(0) if q_start.shape[0] > 1 else 0,
            counts.stride(0), indices.stride(0), table.stride(0),
            seq_q, seq_k, n_q, n_k, kernel_window(window),
            BM=block_m, BN=block_n, BR=br, CB=cb, IS_CAUSAL=causal, HAS_WINDOW=window is not None, BY_KEY=by_key,
            PHASE=phase,
        )

    return write_lists(launch, mask_batch, n_r, n_c, dev, compact, compact_bytes)
