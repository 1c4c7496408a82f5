"""Block lists straight from the per-token bits: two launches, no tile-map temporaries, and no host
synchronisation unless the lists are large enough to be packed (:func:`write_lists`).

1. ``block_summary_kernel`` reduces each query block and each key block to a few int32 words (``SUM[b, blk]``):
   query block: OR of its rows' bits, AND over its real rows (those < seq_q), first row position, and (causal)
   per segment t the last row position that sees t; key block: OR of its bits, a flag set when some column is
   padding or past seq_k, its last column, and (causal) per segment t its first column; with a window, both
   sides also keep their first and last position.
2. ``block_lists_kernel`` classifies BR row blocks against CB column blocks at a time from those summaries and
   writes, per row block, the full column blocks in ascending order, then the partial ones: a first pass counts
   the full tiles, a second writes each id at its place (a cumulative sum over the chunk). Packed lists count
   full and partial tiles in one launch, and write them in another once the host has scanned the counts.

A tile is full when no segment among its keys is unseen by one of its real rows, none of its columns is padding,
and (causal) its last column is visible from its first row; a full tile is always live. It is live when some
pair is allowed: some segment shared by a row and a key (causal: seen by a row at or after the segment's first
column in the tile). A window then cuts them by position (``blocks.band_classes``). The result equals
``lists_from_classes(*classify_blocks_from_bits(...))`` row by row (``BlockLists.padded``); slots past a row's
count are left unwritten.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..kernels.constants import COUNT_WORDS, LISTS_COUNT, LISTS_DENSE, LISTS_WRITE
from ..kernels.tl.bit_lists import block_lists_kernel, block_summary_kernel
from ..runtime.launch import FastKernel, interpreter_active
from .blocks import BlockLists, cdiv, index_dtype
from .list_order import write_launch_order

# Elements of the largest tile a program holds (e.g. [BR, CB, K]): modest on a GPU (registers), large in the
# interpreter, where every tile op is one numpy call and fewer, larger programs are much faster.
_GPU_TILE = 4096
_INTERPRETER_TILE = 1 << 16
_GPU_CHUNK = 256  # column blocks per step on a GPU: one step for S = 16k at 64-wide tiles

_SUMMARY, _LISTS = FastKernel(block_summary_kernel), FastKernel(block_lists_kernel)


# Lists whose fixed slots (C a row) would take more bytes than this are packed end to end instead (CSR): one
# read-back of the live-tile total per build, and a 1M-token mask's lists shrink to the live tiles. The default of
# KernelConfig.compact_bytes, which a call passes down.
COMPACT_BYTES = 32 << 20
_INT32_MAX = 2**31 - 1


def write_lists(launch: Callable[[int, torch.Tensor, torch.Tensor], None], mask_batch: int, n_r: int, n_c: int,
                device: torch.device, compact: bool | None = None, compact_bytes: int = COMPACT_BYTES) -> BlockLists:
    """Allocate and fill :class:`BlockLists` of ``mask_batch`` samples, ``n_r`` rows and ``n_c`` columns through a list
    kernel: ``launch(phase, counts, indices)`` runs it once (``kernels.constants.LISTS_*``).

    compact: pack the lists (count, scan, read the total back, write); default: when fixed slots would take more
    than ``compact_bytes``.
    """
    fixed = index_dtype(n_c, False)
    counts = torch.empty((mask_batch, n_r, COUNT_WORDS), dtype=torch.int32, device=device)
    if n_r == 0 or n_c == 0:
        counts.zero_()
        write_launch_order(counts)
        return BlockLists(counts, torch.empty((mask_batch, 0), dtype=fixed, device=device))
    if compact is None:
        compact = mask_batch * n_r * n_c * fixed.itemsize > compact_bytes
    dtype = index_dtype(n_c, compact)
    if not compact:
        if n_r * n_c > _INT32_MAX:
            raise ValueError(f"{n_r} x {n_c} tiles of fixed-slot block lists pass 2^31 entries: build them compact")
        indices = torch.empty((mask_batch, n_r * n_c), dtype=dtype, device=device)
        launch(LISTS_DENSE, counts, indices)
        write_launch_order(counts)
        return BlockLists(counts, indices)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"block lists of {n_r} x {n_c} tiles are packed, which reads their length back to the "
                           "host: build the mask before capturing the CUDA graph (call it once first, or "
                           "mmsparse.attention.kernel_args.prepare)")
    launch(LISTS_COUNT, counts, counts.new_empty((mask_batch, 0), dtype=dtype))
    sizes = counts[..., :2].sum(-1, dtype=torch.int64)
    ends = sizes.cumsum(1)
    counts[..., 2] = ends - sizes
    total = int(ends[:, -1].max())  # the one read-back: the packed lists' length
    if total > _INT32_MAX:
        raise ValueError(f"a sample's block lists hold {total} tiles, past 2^31: use larger tiles or shorter samples")
    indices = torch.empty((mask_batch, max(total, 1)), dtype=dtype, device=device)
    launch(LISTS_WRITE, counts, indices)
    write_launch_order(counts)
    return BlockLists(counts, indices)


def kernel_window(window: int | None) -> int:
    """A window as the kernels' int32 argument: 0 without one (never read), else capped at 2^31 - 1 (positions
    are below it, so a larger window keeps every key, as the capped one does)."""
    return 0 if window is None else min(int(window), _INT32_MAX)


def no_launch(phase: int, counts: torch.Tensor, indices: torch.Tensor) -> None:
    """The launch of lists with no row or no column: nothing to write."""


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
    compact: bool | None = None,
    compact_bytes: int = COMPACT_BYTES,
    window: int | None = None,
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
        compact: packed (CSR) lists or fixed slots; default by size, above ``compact_bytes`` (:func:`write_lists`).
        window: also require key position > query position - window (None: no window).

    Returns:
        :class:`BlockLists` with R = NQ rows of NK columns, or NK rows of NQ when by_key, on the input device.
    """
    mask_batch, seq_q, seq_k = q_bits.shape[0], q_bits.shape[1], k_bits.shape[1]
    if not 1 <= num_segments <= 32:
        raise ValueError(f"num_segments must be in [1, 32]; got {num_segments}")
    if k_bits.shape[0] not in (1, mask_batch) or q_start.numel() not in (1, mask_batch):
        raise ValueError(f"q_bits has {mask_batch} rows but k_bits has {k_bits.shape[0]} and q_start {q_start.numel()}")
    dev = q_bits.device
    q_bits, k_bits = (t if t.stride(1) == 1 else t.contiguous() for t in (q_bits, k_bits))
    if q_start.dtype != torch.int32 or q_start.device != dev or q_start.dim() != 1:
        q_start = q_start.to(device=dev, dtype=torch.int32).reshape(-1)
    n_q, n_k = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    n_r, n_c = (n_k, n_q) if by_key else (n_q, n_k)
    if n_r == 0 or n_c == 0:
        return write_lists(no_launch, mask_batch, n_r, n_c, dev)

    k = max(2, 1 << (num_segments - 1).bit_length())  # segments rounded up to a power of two
    w = (3 + k if causal else 2) + (2 if window is not None else 0)  # a window adds each block's first/last position
    interpret = dev.type != "cuda"
    elems = tile_elems or (_INTERPRETER_TILE if interpret else _GPU_TILE)
    gq, gk, cb, br = _program_sizes(n_q, n_k, n_r, n_c, block_m, block_n, k, causal, elems,
                                    interpret if fit is None else fit)
    summary = None if summaries is None else summaries.get((block_m, block_n))
    if summary is None:
        summary = torch.empty((mask_batch, n_q + n_k, w), dtype=torch.int32, device=dev)
        _SUMMARY[(max(cdiv(n_q, gq), cdiv(n_k, gk)), mask_batch)](
            q_bits, k_bits, q_start, summary,
            q_bits.stride(0) if q_bits.shape[0] > 1 else 0, k_bits.stride(0) if k_bits.shape[0] > 1 else 0,
            q_start.stride(0) if q_start.shape[0] > 1 else 0, summary.stride(0),
            seq_q, seq_k, n_q, n_k, -1 if num_segments == 32 else (1 << num_segments) - 1,
            BM=block_m, BN=block_n, GQ=gq, GK=gk, K=k, W=w, IS_CAUSAL=causal, HAS_WINDOW=window is not None,
        )
        if summaries is not None:
            summaries[(block_m, block_n)] = summary

    def launch(phase: int, counts: torch.Tensor, indices: torch.Tensor) -> None:
        _LISTS[(cdiv(n_r, br), mask_batch)](
            summary, counts, indices, summary.stride(0), counts.stride(0), indices.stride(0), n_q, n_k,
            kernel_window(window), BR=br, CB=cb, K=k, W=w, IS_CAUSAL=causal, HAS_WINDOW=window is not None,
            BY_KEY=by_key, PHASE=phase,
        )

    return write_lists(launch, mask_batch, n_r, n_c, dev, compact, compact_bytes)


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
