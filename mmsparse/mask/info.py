"""The mask of one call: built once per (topology, lengths, device) and cached.

The token-level part is O(S): per-token bit vectors (0/1 topologies of at most 32 segments), per-token segment codes
and the pair table (any topology, packed samples: :mod:`mmsparse.mask.segments`), or the user's dense mask on the
arbitrary-mask path.
Block lists are built lazily for each tile shape asked for. Nothing here knows the attention kernels' signatures:
:mod:`mmsparse.attention.kernel_args` turns a mask into their arguments.
"""

from __future__ import annotations

import torch

from ..kernels.constants import MASK_BITS, MASK_DENSE, MASK_SEGMENTS
from ..runtime.launch import stream_key
from .block_lists import build_block_lists, kernels_run_on
from .blocks import BlockLists, classify_blocks_from_bits, classify_blocks_from_mask, lists_from_classes, pool_classes
from .code_blocks import classify_blocks_from_codes
from .segment_lists import CodeRuns, build_segment_lists
from .segments import decode, query_codes, token_codes
from .token_bits import launch_token_bits
from .topology import Topology, allowed_by_type

TileKey = tuple[int, int, bool]  # (block_m, block_n, by_key) of one set of block lists


class MaskInfo:
    """Mask description for seq_q queries (at positions q_start .. q_start + seq_q - 1; by default the last seq_q)
    over keys 0 .. seq_k - 1; with ``window`` a key is kept only when its position is past the query's minus the
    window.

    Use :meth:`from_topology` or :meth:`from_dense`. ``batch`` is 1 when the whole batch shares the mask.
    """

    def __init__(
        self,
        mode: int,
        seq_q: int,
        seq_k: int,
        causal: bool,
        q_bits: torch.Tensor | None = None,
        k_bits: torch.Tensor | None = None,
        num_segments: int = 0,
        dense: torch.Tensor | None = None,
        q_start: torch.Tensor | None = None,
        table: torch.Tensor | None = None,
        sample_len: int | None = None,
        window: int | None = None,
    ) -> None:
        self.mode = mode
        self.seq_q, self.seq_k = seq_q, seq_k
        self.causal = causal
        # MASK_BITS: row and column bits; MASK_SEGMENTS: query and key codes, and the pair table
        self.q_bits, self.k_bits, self.num_segments = q_bits, k_bits, num_segments
        self.table = table
        self.dense = dense
        # Tokens per sample of a pack, on average: rows see at most their sample, so short samples mean short
        # block lists (the forward picks its tile by it). None: not a pack.
        self.sample_len = sample_len
        self.window = window  # sliding window (keys past query - window), or None
        ref = dense if mode == MASK_DENSE else q_bits
        self.batch = ref.shape[0]
        self.device = ref.device
        # int32 [1 or Bm]: the position of each sample's first query; by default the last seq_q positions.
        if q_start is None:
            self.q_start = _default_q_start(seq_k - seq_q, self.device)
        else:
            self.q_start = q_start.to(device=self.device, dtype=torch.int32).reshape(-1)
        self._classes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lists: dict[TileKey, BlockLists] = {}
        self._summaries: dict[tuple[int, int], torch.Tensor] = {}  # per tile, shared by that tile's lists
        self._runs: tuple[CodeRuns, CodeRuns] | None = None  # MASK_SEGMENTS: the codes' runs, for every tile
        # The kernels' view of this mask (an mmsparse.attention.kernel_args.KernelArgs), made on first use and kept as
        # long as the mask; opaque here.
        self.kernel_args: object | None = None

    @classmethod
    def from_topology(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None, window: int | None = None,
    ) -> MaskInfo:
        """seg_lens: int ``[Bm, k]`` on the target device, each row summing to at most seq_k. q_start: optional
        int ``[B]``, the position of each sample's first query (decoding over caches of different lengths)."""
        row_bits, col_bits = launch_token_bits(topology, seg_lens, seq_k)
        if q_start is None:
            q_bits = row_bits[:, seq_k - seq_q :].contiguous()
        else:
            q_start = q_start.to(device=row_bits.device, dtype=torch.int64).reshape(-1)
            rows = q_start.shape[0]
            row_bits, col_bits = row_bits.expand(rows, -1), col_bits.expand(rows, -1)  # stride 0 if shared
            pos = q_start[:, None] + torch.arange(seq_q, device=row_bits.device)
            inside = (pos >= 0) & (pos < seq_k)
            q_bits = torch.where(inside, row_bits.gather(1, pos.clamp(0, max(seq_k - 1, 0))), 0).to(torch.int32)
        return cls(MASK_BITS, seq_q, seq_k, causal, q_bits=q_bits, k_bits=col_bits,
                   num_segments=topology.num_segments, q_start=q_start, window=window)

    @classmethod
    def from_segments(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None, packed: bool = False, window: int | None = None,
    ) -> MaskInfo:
        """Segment codes for any topology. seg_lens: int ``[Bm, k]`` per sample, or with ``packed`` ``[N, k]``:
        N samples end to end in one sequence, each seeing only itself."""
        k_codes = token_codes(seg_lens, topology.num_segments, seq_k, packed)
        q_codes = query_codes(k_codes, seq_q, q_start, topology.num_segments)
        if q_start is not None:
            k_codes = k_codes.expand(q_codes.shape[0], -1)
        return cls(MASK_SEGMENTS, seq_q, seq_k, causal, q_bits=q_codes, k_bits=k_codes,
                   num_segments=topology.num_segments, q_start=q_start, table=topology.pair_table(k_codes.device),
                   sample_len=seq_k // max(seg_lens.shape[0], 1) if packed else None, window=window)

    @classmethod
    def from_dense(cls, mask: torch.Tensor, causal: bool, window: int | None = None) -> MaskInfo:
        """mask: bool ``[Bm, Sq, Sk]`` over the query rows, on the target device."""
        mask = mask.contiguous()
        return cls(MASK_DENSE, mask.shape[1], mask.shape[2], causal, dense=mask, window=window)

    def classes(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(live, full) bool ``[Bm, NQ, NK]`` at this tile."""
        key = (block_m, block_n)
        finer = [k for k in self._classes if block_m % k[0] == 0 and block_n % k[1] == 0 and k != key]
        if key not in self._classes and finer:  # a coarser tile is a union of finer ones: pool, don't recompute
            fine_m, fine_n = finer[0]
            self._classes[key] = pool_classes(*self._classes[finer[0]], block_m // fine_m, block_n // fine_n)
        if key not in self._classes:
            if self.mode == MASK_BITS:
                self._classes[key] = classify_blocks_from_bits(
                    self.q_bits, self.k_bits, self.num_segments, block_m, block_n, self.causal, self.q_start,
                    self.window,
                )
            elif self.mode == MASK_SEGMENTS:  # from the codes' runs: O(S + tiles x runs), no S x S mask
                self._classes[key] = classify_blocks_from_codes(self.q_bits, self.k_bits, self.table, block_m, block_n,
                                                                self.causal, self.q_start, self.window)
            else:
                self._classes[key] = classify_blocks_from_mask(self.dense, block_m, block_n, self.causal, self.q_start,
                                                               self.window)
        return self._classes[key]

    def lists(self, block_m: int, block_n: int, by_key: bool = False) -> BlockLists:
        """Per query block its key blocks, or (by_key) per key block its query blocks. Topology masks: built by
        Triton kernels straight from the token bits (two launches); dense masks, or CPU tensors without Triton's
        interpreter: reduced from :meth:`classes` in torch."""
        key = (block_m, block_n, by_key)
        if key not in self._lists and self.mode == MASK_BITS and kernels_run_on(self.device):
            self._lists[key] = build_block_lists(self.q_bits, self.k_bits, self.num_segments, block_m, block_n,
                                                 self.causal, self.q_start, by_key, summaries=self._summaries,
                                                 window=self.window)
        if key not in self._lists and self.mode == MASK_SEGMENTS and kernels_run_on(self.device):
            if self._runs is None:
                k_codes = self.k_bits if self.k_bits.stride(0) != 0 else self.k_bits[:1]
                q_runs = CodeRuns(self.q_bits)
                same = _same_view(self.q_bits, k_codes)  # self-attention: the queries' codes are the keys'
                self._runs = (q_runs, q_runs if same else CodeRuns(k_codes))
            self._lists[key] = build_segment_lists(*self._runs, self.table, block_m, block_n, self.causal,
                                                   self.q_start, by_key, window=self.window)
        if key not in self._lists:
            live, full = self.classes(block_m, block_n)
            if by_key:
                live, full = live.transpose(1, 2), full.transpose(1, 2)
            self._lists[key] = lists_from_classes(live, full)
        return self._lists[key]

    def built_lists(self, block_m: int, block_n: int, by_key: bool = False) -> BlockLists:
        """The block lists at a tile that :meth:`prepare` (or :meth:`lists`) built: a launch only reads them, so
        that everything it reads was written on the current stream before it."""
        lists = self._lists.get((block_m, block_n, by_key))
        if lists is None:
            raise RuntimeError(f"the block lists at tile {block_m}x{block_n}{' by key' if by_key else ''} were not "
                               "built before the launch: plan the call and prepare its lists first")
        return lists

    def prepare(self, tiles: list[TileKey]) -> MaskInfo:
        """Build the block lists at ``tiles`` now, e.g. every kernel's before timing or CUDA-graph capture
        (``mmsparse.attention.kernel_args.prepare`` names them for a kernel config; a call's plan names its own)."""
        if self.mode == MASK_DENSE or not kernels_run_on(self.device):  # the lists come from classes()
            for block_m, block_n, _ in sorted(tiles, key=lambda k: k[0] * k[1]):  # finest first: the rest pool it
                self.classes(block_m, block_n)
        for block_m, block_n, by_key in tiles:
            self.lists(block_m, block_n, by_key)
        return self


    def code_mask(self) -> torch.Tensor:
        """The dense bool ``[Bm, Sq, Sk]`` of a segment-code mask, by the rule of :mod:`mmsparse.mask.segments` in
        torch (O(S^2): tests and small sizes)."""
        q_doc, q_seg = decode(self.q_bits)
        k_doc, k_seg = decode(self.k_bits)
        types = self.table.to(torch.int64)[q_seg[:, :, None], k_seg[:, None, :]]
        q_pos = self.q_start.to(torch.int64).reshape(-1, 1, 1) + torch.arange(self.seq_q, device=self.device)[:, None]
        k_pos = torch.arange(self.seq_k, device=self.device)
        mask = (q_doc[:, :, None] == k_doc[:, None, :]) & allowed_by_type(types, q_pos, k_pos)
        if self.window is not None:
            mask = mask & (k_pos > q_pos - self.window)
        return mask & (k_pos <= q_pos) if self.causal else mask


_Q_STARTS: dict[tuple, torch.Tensor] = {}


def clear_query_starts() -> None:
    """Forget the kept first-query positions (:func:`_default_q_start`)."""
    _Q_STARTS.clear()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same elements the same way."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _default_q_start(q_start: int, device: torch.device) -> torch.Tensor:
    """int32 ``[1]`` holding ``q_start`` on ``device``, shared by the masks that need it (the kernels only read it):
    a mask built for new lengths skips one allocation and fill. One per CUDA stream: another stream could read it
    before the fill, and its memory could go back to the filling stream's pool while the other still reads it."""
    key = (device, q_start, stream_key(device))
    t = _Q_STARTS.get(key)
    if t is None:
        t = torch.full((1,), q_start, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return t  # filled only when the graph replays: not for eager masks
        if len(_Q_STARTS) >= 256:
            _Q_STARTS.clear()
        _Q_STARTS[key] = t
    return t
