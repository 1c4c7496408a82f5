"""The mask of one call: built once per (topology, lengths, device) and cached. One class per kind:

- :class:`BitMask`: per-token row and column bit vectors (0/1 topologies of at most 32 segments);
- :class:`CodeMask`: per-token segment codes and the pair table (any topology, packed samples:
  :mod:`mmsparse.mask.segment_codes`);
- :class:`DenseMask`: the user's bool mask, on the arbitrary-mask path.

The token-level part is O(S) (the dense mask aside). Their common base, :class:`MaskInfo`, builds block lists
lazily for each tile asked for. ``kernel_tensors`` / :func:`mask_from_kernel_tensors` carry a mask across the torch
custom-op boundary as plain tensors (the call's plan carries its kind and scalars). Nothing here knows the
attention kernels' signatures: :mod:`mmsparse.attention.kernel_args` turns a mask into their arguments.
"""

from __future__ import annotations

import torch

from ..kernels.constants import MASK_BITS, MASK_DENSE, MASK_SEGMENTS
from ..runtime.launch import stream_key
from .bit_lists import COMPACT_BYTES, build_block_lists, kernels_run_on
from .blocks import BlockLists, classify_blocks_from_bits, classify_blocks_from_mask, lists_from_classes, pool_classes
from .cache import CACHE
from .code_blocks import classify_blocks_from_codes
from .code_lists import CodeRuns, build_segment_lists
from .segment_codes import decode, query_codes, token_codes
from .token_bits import launch_token_bits
from .topology import Topology, allowed_by_type

TileKey = tuple[int, int, bool]  # (block_m, block_n, by_key) of one set of block lists


class MaskInfo:
    """What every mask kind shares: seq_q queries (at positions q_start .. q_start + seq_q - 1; by default the last
    seq_q) over keys 0 .. seq_k - 1, with ``window`` only the keys past the query's position minus the window, and
    block lists built once per tile. ``batch`` is 1 when the whole batch shares the mask.

    Build one with :meth:`from_topology`, :meth:`from_segments` or :meth:`from_dense` (or a kind's constructor).
    A subclass gives its token-level tensors, its tile classification, its device-side list builder and the
    tensors its kernels read.
    """

    mode: int  # the kernels' MASK_MODE
    num_segments: int = 0  # the segments of a topology mask; 0 for a dense mask, which has none
    # Traced: the values the mask was built from as flat ints, where they are all host values (mmsparse.mask.kept);
    # None: a length tensor, or not traced.
    host_values: list[int] | None = None

    def __init__(self, seq_q: int, seq_k: int, causal: bool, like: torch.Tensor,
                 q_start: torch.Tensor | None = None, sample_len: int | None = None,
                 window: int | None = None) -> None:
        self.seq_q, self.seq_k = seq_q, seq_k
        self.causal = causal
        self.window = window  # sliding window (keys past query - window), or None
        # Tokens per sample of a pack, on average: rows see at most their sample, so short samples mean short
        # block lists (the forward picks its tile by it). None: not a pack.
        self.sample_len = sample_len
        self.batch = like.shape[0]
        self.device = like.device
        # int32 [1 or Bm]: the position of each sample's first query; by default the last seq_q positions.
        if q_start is None:
            self.q_start = _default_q_start(seq_k - seq_q, self.device)
        else:
            self.q_start = q_start.to(device=self.device, dtype=torch.int32).reshape(-1)
        self._classes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lists: dict[TileKey, BlockLists] = {}
        # What it holds grows as kernels build lists, possibly in another thread than one measuring it: each growth
        # bumps the version (after the entry is in), and a size measured at an older version is measured again.
        self._version = 0
        self._measured = (-1, 0)  # (version, bytes)
        # The kernels' view of this mask (an mmsparse.attention.kernel_args.KernelArgs), made on first use and kept as
        # long as the mask; opaque here.
        self.kernel_args: object | None = None

    # the kinds' part ---------------------------------------------------------------------------------------------

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The token-level tensors the mask is made of (the first-query positions included)."""
        raise NotImplementedError

    def same_tensors(self) -> MaskInfo:
        """A mask of this kind over the same token-level tensors, with no block list built yet (a CUDA stream
        other than the building one gets its own: see :mod:`mmsparse.mask.cache`)."""
        raise NotImplementedError

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors the kernels read, as the custom ops take them: three (a kind repeats one where it reads fewer)
        and the first-query positions. :func:`mask_from_kernel_tensors` makes a mask of them again."""
        raise NotImplementedError

    def _classify(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _build_lists(self, block_m: int, block_n: int, by_key: bool, compact_bytes: int,
                     compact: bool | None = None) -> BlockLists | None:
        """The block lists built on the device straight from the token-level tensors, or None where they come
        from :meth:`classes` (dense masks; CPU tensors without Triton's interpreter)."""
        return None

    # shared --------------------------------------------------------------------------------------------------------

    @classmethod
    def from_topology(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None, window: int | None = None,
    ) -> BitMask:
        """A :class:`BitMask` (see there)."""
        return BitMask.from_topology(topology, seg_lens, seq_q, seq_k, causal, q_start, window)

    @classmethod
    def from_segments(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None, packed: bool = False, window: int | None = None,
    ) -> CodeMask:
        """A :class:`CodeMask` (see there)."""
        return CodeMask.from_segments(topology, seg_lens, seq_q, seq_k, causal, q_start, packed, window)

    def sharing_built(self) -> MaskInfo:
        """A mask over the same token-level tensors that shares what is built so far (block lists, tile classes)
        and keeps what it builds later to itself: a CUDA-graph capture's. Work captured in a graph runs only when
        the graph replays, so lists built during a capture must not be reachable from the eager calls."""
        copy = self.same_tensors()
        copy._classes.update(self._classes)
        copy._lists.update(self._lists)
        return copy

    @classmethod
    def from_dense(cls, mask: torch.Tensor, causal: bool, window: int | None = None) -> DenseMask:
        """A :class:`DenseMask` (see there)."""
        return DenseMask.from_dense(mask, causal, window)

    def _held(self) -> list[torch.Tensor]:
        """The device tensors a kind keeps besides its token-level ones and the shared tables (the list
        builders' summaries)."""
        return []

    def _grew(self) -> None:
        """Called once a new entry is in one of the tables: the next :attr:`nbytes` measures again."""
        self._version += 1

    def held_tensors(self) -> list[torch.Tensor]:
        """Every device tensor the mask holds now: token-level, summaries, tile classes and block lists."""
        held = [*self.tensors(), *self._held()]
        held += [t for pair in list(self._classes.values()) for t in pair]
        return held + [t for lists in list(self._lists.values()) for t in (lists.counts, lists.indices)]

    @property
    def nbytes(self) -> int:
        """Device bytes the mask holds now: its token-level tensors, block lists, tile classes and the list builders'
        summaries (each storage once). Measured again only after the mask has grown.

        Another thread may add lists while this runs: each table is read through one ``list(...)`` call, a copy
        made in one step (no Python code runs during it, so no other thread does), never by iterating the live
        table."""
        version = self._version
        if self._measured[0] == version:
            return self._measured[1]
        held = self.held_tensors()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        size = sum(storages.values())
        self._measured = (version, size)
        return size

    def classes(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(live, full) bool ``[Bm, NQ, NK]`` at this tile."""
        key = (block_m, block_n)
        # A window cuts tiles by their own positions (blocks.band_classes), as the list builders do: not pooled.
        finer = [k for k in self._classes if block_m % k[0] == 0 and block_n % k[1] == 0 and k != key
                 and self.window is None]
        if key not in self._classes and finer:  # a coarser tile is a union of finer ones: pool, don't recompute
            fine_m, fine_n = finer[0]
            self._classes[key] = pool_classes(*self._classes[finer[0]], block_m // fine_m, block_n // fine_n)
            self._grew()
        if key not in self._classes:
            self._classes[key] = self._classify(block_m, block_n)
            self._grew()
        return self._classes[key]

    def lists(self, block_m: int, block_n: int, by_key: bool = False,
              compact_bytes: int = COMPACT_BYTES, compact: bool | None = None) -> BlockLists:
        """Per query block its key blocks, or (by_key) per key block its query blocks. Topology masks: built by
        Triton kernels straight from the token-level tensors; dense masks, or CPU tensors without Triton's
        interpreter: reduced from :meth:`classes` in torch. ``compact_bytes``: above it a bit mask's lists take
        the compact layout (:func:`mmsparse.mask.bit_lists.build_block_lists`); ``compact`` False: fixed slots
        whatever their size (lists whose size must follow from the shapes alone: a traced graph's)."""
        key = (block_m, block_n, by_key)
        if key not in self._lists and kernels_run_on(self.device):
            built = self._build_lists(block_m, block_n, by_key, compact_bytes, compact)
            if built is not None:
                self._lists[key] = built
                self._grew()
        if key not in self._lists:
            live, full = self.classes(block_m, block_n)
            if by_key:
                live, full = live.transpose(1, 2), full.transpose(1, 2)
            self._lists[key] = lists_from_classes(live, full)
            self._grew()
        return self._lists[key]

    def built_lists(self, block_m: int, block_n: int, by_key: bool = False) -> BlockLists:
        """The block lists at a tile that :meth:`prepare` (or :meth:`lists`) built: a launch only reads them, so
        that everything it reads was written on the current stream before it."""
        lists = self.lists_built(block_m, block_n, by_key)
        if lists is None:
            raise RuntimeError(f"the block lists at tile {block_m}x{block_n}{' by key' if by_key else ''} were not "
                               "built before the launch: plan the call and prepare its lists first")
        return lists

    def lists_built(self, block_m: int, block_n: int, by_key: bool = False) -> BlockLists | None:
        """The block lists at a tile if built already, else None (nothing is built)."""
        return self._lists.get((block_m, block_n, by_key))

    def prepare(self, tiles: list[TileKey], compact_bytes: int = COMPACT_BYTES) -> MaskInfo:
        """Build the block lists at ``tiles`` now, e.g. every kernel's before timing or CUDA-graph capture
        (``mmsparse.attention.kernel_args.prepare`` names them for a kernel config; a call's plan names its own)."""
        if isinstance(self, DenseMask) or not kernels_run_on(self.device):  # the lists come from classes()
            for block_m, block_n, _ in sorted(tiles, key=lambda k: k[0] * k[1]):  # finest first: the rest pool it
                self.classes(block_m, block_n)
        for block_m, block_n, by_key in tiles:
            self.lists(block_m, block_n, by_key, compact_bytes)
        return self


class BitMask(MaskInfo):
    """Row bits ``[Bm, Sq]`` and column bits ``[Bm or 1, Sk]`` (int32): a query sees a key when they share a bit
    (:mod:`mmsparse.mask.topology`)."""

    mode = MASK_BITS

    def __init__(self, q_bits: torch.Tensor, k_bits: torch.Tensor, num_segments: int, causal: bool,
                 q_start: torch.Tensor | None = None, window: int | None = None) -> None:
        super().__init__(q_bits.shape[1], k_bits.shape[1], causal, q_bits, q_start, window=window)
        self.q_bits, self.k_bits, self.num_segments = q_bits, k_bits, num_segments
        self._summaries: dict[tuple[int, int], torch.Tensor] = {}  # per tile, shared by that tile's lists

    @classmethod
    def from_topology(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None, window: int | None = None,
    ) -> BitMask:
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
        return cls(q_bits, col_bits, topology.num_segments, causal, q_start, window)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q_bits, self.k_bits, self.q_start

    def _held(self) -> list[torch.Tensor]:
        return list(self._summaries.values())

    def same_tensors(self) -> BitMask:
        return BitMask(self.q_bits, self.k_bits, self.num_segments, self.causal, self.q_start, self.window)

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_bits, self.k_bits, self.q_bits, self.q_start

    def _classify(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return classify_blocks_from_bits(self.q_bits, self.k_bits, self.num_segments, block_m, block_n, self.causal,
                                         self.q_start, self.window)

    def _build_lists(self, block_m: int, block_n: int, by_key: bool, compact_bytes: int,
                     compact: bool | None = None) -> BlockLists:
        return build_block_lists(self.q_bits, self.k_bits, self.num_segments, block_m, block_n, self.causal,
                                 self.q_start, by_key, summaries=self._summaries, compact=compact,
                                 compact_bytes=compact_bytes, window=self.window)


class CodeMask(MaskInfo):
    """Query and key segment codes (:mod:`mmsparse.mask.segment_codes`: document and segment of each token) and the
    k x k pair table of NONE/FULL/CAUSAL: any topology, and packs of samples that see only themselves."""

    mode = MASK_SEGMENTS

    def __init__(self, q_codes: torch.Tensor, k_codes: torch.Tensor, table: torch.Tensor, num_segments: int,
                 causal: bool, q_start: torch.Tensor | None = None, sample_len: int | None = None,
                 window: int | None = None) -> None:
        super().__init__(q_codes.shape[1], k_codes.shape[1], causal, q_codes, q_start, sample_len, window)
        self.q_codes, self.k_codes, self.table, self.num_segments = q_codes, k_codes, table, num_segments
        self._runs: tuple[CodeRuns, CodeRuns] | None = None  # the codes' runs, for every tile

    @classmethod
    def from_segments(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None, packed: bool = False, window: int | None = None,
    ) -> CodeMask:
        """seg_lens: int ``[Bm, k]`` per sample, or with ``packed`` ``[N, k]``: N samples end to end in one
        sequence, each seeing only itself."""
        k_codes = token_codes(seg_lens, topology.num_segments, seq_k, packed)
        q_codes = query_codes(k_codes, seq_q, q_start, topology.num_segments)
        if q_start is not None:
            k_codes = k_codes.expand(q_codes.shape[0], -1)
        return cls(q_codes, k_codes, topology.pair_table(k_codes.device), topology.num_segments, causal, q_start,
                   sample_len=seq_k // max(seg_lens.shape[0], 1) if packed else None, window=window)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q_codes, self.k_codes, self.table, self.q_start

    def _held(self) -> list[torch.Tensor]:
        runs = self._runs
        if runs is None:
            return []
        return [t for side in runs for t in (side.codes, side.run, side.starts, side.run_codes,
                                              *list(side._summaries.values()))]

    def same_tensors(self) -> CodeMask:
        return CodeMask(self.q_codes, self.k_codes, self.table, self.num_segments, self.causal, self.q_start,
                        self.sample_len, self.window)

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_codes, self.k_codes, self.table, self.q_start

    def _classify(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # from the codes' runs: O(S + tiles x runs), no S x S mask
        return classify_blocks_from_codes(self.q_codes, self.k_codes, self.table, block_m, block_n, self.causal,
                                          self.q_start, self.window)

    def _build_lists(self, block_m: int, block_n: int, by_key: bool, compact_bytes: int,
                     compact: bool | None = None) -> BlockLists:
        if self._runs is None:
            k_codes = self.k_codes if self.k_codes.stride(0) != 0 else self.k_codes[:1]
            q_runs = CodeRuns(self.q_codes)
            same = _same_view(self.q_codes, k_codes)  # self-attention: the queries' codes are the keys'
            self._runs = (q_runs, q_runs if same else CodeRuns(k_codes))
        return build_segment_lists(*self._runs, self.table, block_m, block_n, self.causal, self.q_start, by_key,
                                   compact=compact, compact_bytes=compact_bytes, window=self.window)

    def code_mask(self) -> torch.Tensor:
        """The dense bool ``[Bm, Sq, Sk]`` by the rule of :mod:`mmsparse.mask.segment_codes` in torch (O(S^2): tests and
        small sizes)."""
        q_doc, q_seg = decode(self.q_codes)
        k_doc, k_seg = decode(self.k_codes)
        types = self.table.to(torch.int64)[q_seg[:, :, None], k_seg[:, None, :]]
        q_pos = self.q_start.to(torch.int64).reshape(-1, 1, 1) + torch.arange(self.seq_q, device=self.device)[:, None]
        k_pos = torch.arange(self.seq_k, device=self.device)
        mask = (q_doc[:, :, None] == k_doc[:, None, :]) & allowed_by_type(types, q_pos, k_pos)
        if self.window is not None:
            mask = mask & (k_pos > q_pos - self.window)
        return mask & (k_pos <= q_pos) if self.causal else mask


class DenseMask(MaskInfo):
    """The user's bool mask ``[Bm, Sq, Sk]`` over the query rows."""

    mode = MASK_DENSE

    def __init__(self, dense: torch.Tensor, causal: bool, q_start: torch.Tensor | None = None,
                 window: int | None = None) -> None:
        super().__init__(dense.shape[1], dense.shape[2], causal, dense, q_start, window=window)
        self.dense = dense

    @classmethod
    def from_dense(cls, mask: torch.Tensor, causal: bool, window: int | None = None) -> DenseMask:
        """mask: bool ``[Bm, Sq, Sk]`` over the query rows, on the target device."""
        return cls(mask.contiguous(), causal, window=window)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.dense, self.q_start

    def same_tensors(self) -> DenseMask:
        return DenseMask(self.dense, self.causal, self.q_start, self.window)

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dense, self.dense, self.dense, self.q_start

    def _classify(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return classify_blocks_from_mask(self.dense, block_m, block_n, self.causal, self.q_start, self.window)


def mask_from_kernel_tensors(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], mode: int, causal: bool,
                             num_segments: int, window: int | None) -> MaskInfo:
    """A mask of :meth:`MaskInfo.kernel_tensors`, with no list built yet (a custom op's, which builds one tile's)."""
    first, second, third, q_start = tensors
    if mode == MASK_BITS:
        return BitMask(first, second, num_segments, causal, q_start, window)
    if mode == MASK_SEGMENTS:
        return CodeMask(first, second, third, num_segments, causal, q_start, window=window)
    if mode == MASK_DENSE:
        return DenseMask(third, causal, q_start, window)
    raise ValueError(f"no mask of mode {mode}")


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same elements the same way."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _default_q_start(q_start: int, device: torch.device) -> torch.Tensor:
    """int32 ``[1]`` holding ``q_start`` on ``device``, shared by the masks that need it (the kernels only read it):
    a mask built for new lengths skips one allocation and fill. One per CUDA stream: another stream could read it
    before the fill, and its memory could go back to the filling stream's pool while the other still reads it."""
    # Traced: a graph op, and no guard on the cache's entries. Captured: filled when the graph replays (not for
    # eager masks), and in the graph's own memory (the cache may drop its entry before a replay).
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((1,), q_start, dtype=torch.int32, device=device)
    key = ("q_start", device, q_start, stream_key(device))
    t = CACHE.value(key)
    if t is None:
        t = CACHE.store_value(key, torch.full((1,), q_start, dtype=torch.int32, device=device))
    return t
