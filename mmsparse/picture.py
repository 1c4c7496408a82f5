"""Pictures of a mask's tiles: which tiles the kernels skip, run unmasked (full) or run with the exact mask (partial).

Any mask the kernels run: pair types (``NONE``/``FULL``/``CAUSAL``), any number of segments, packs of samples, a
causal call. Built from the segment codes' runs (:mod:`mmsparse.mask.code_blocks`: O(S) tokens plus the tiles' run
pairs), never from an S x S mask, so it draws masks of any length::

    from mmsparse import tile_map
    tiles = tile_map([[1, 1, 0], [0, 1, 1], [1, 0, 1]], (1024, 8192, 4096), tile=128)
    print(tiles.picture())          # text, at most 64 characters wide
    print(tiles.summary())          # density, full / partial / skipped tiles
    tiles.save_png("mask.png")      # needs matplotlib
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from .checks import check_flag, check_window
from .mask.blocks import cdiv
from .mask.code_blocks import classify_blocks_from_codes, count_pairs_from_codes
from .mask.lengths import SegLensArg, check_rows, is_per_sample, seg_lens_argument, validate_seg_lens
from .mask.segment_codes import MAX_DOCS, token_codes
from .mask.topology import Topology

TileArg = Union[int, tuple[int, int]]

# The classification holds a few [NQ, NK] maps; past this many tiles the tile is too small for the length.
_MAX_TILES = 1 << 28


@dataclass(frozen=True)
class TileMap:
    """The tiles of one mask (self-attention over all S positions).

    Attributes:
        live: bool ``[NQ, NK]``, the tile holds at least one allowed pair (the kernel visits it).
        full: bool ``[NQ, NK]``, every pair is allowed (the kernel runs it without a mask).
        tile: ``(block_m, block_n)``, query rows x key columns per tile.
        seq_len: S.
        density: allowed pairs / S^2.
    """

    live: torch.Tensor
    full: torch.Tensor
    tile: tuple[int, int]
    seq_len: int
    density: float

    def counts(self) -> dict[str, int]:
        """Number of full, partial and skipped tiles."""
        full = int(self.full.sum())
        live = int(self.live.sum())
        return {"full": full, "partial": live - full, "skipped": self.live.numel() - live}

    def summary(self) -> str:
        """One line: density of token pairs and the tile counts."""
        c = self.counts()
        skipped = c["skipped"] / max(self.live.numel(), 1)
        return (f"density {self.density:.3f} of token pairs; tiles: {c['full']} full, {c['partial']} partial, "
                f"{c['skipped']} skipped ({skipped:.1%})")

    def picture(self, width: int = 64) -> str:
        """The tiles as text, one character per tile: '#' full (no mask), '+' partial (exact mask), '.' skipped.

        Args:
            width: the most characters per line. With more key tiles than that, each character stands for
                g x g tiles (g the smallest factor that fits): '#' when all of them are full, '.' when all are
                skipped, '+' otherwise.

        Returns:
            A header line naming the tile and the scale, then one line per row of characters.
        """
        if width < 1:
            raise ValueError(f"width must be at least 1; got {width}")
        nq, nk = self.live.shape
        g = max(1, cdiv(max(nq, nk), width))
        block_m, block_n = self.tile
        if g == 1:
            header = f"block mask at {block_m}x{block_n} tiles ('#' full, '+' partial, '.' skipped):"
        else:
            header = (f"block mask at {block_m}x{block_n} tiles, {g}x{g} tiles per character ('#' all full, '.' all "
                      "skipped, '+' the rest):")
        # Padding past the ragged edge counts as full and not live, so an edge group shows what its tiles are.
        live, full = _pool(self.live, g, False, "any"), _pool(self.full, g, True, "all")
        chars = torch.where(full, ord("#"), torch.where(live, ord("+"), ord(".")))
        return "\n".join([header, *("".join(map(chr, row)) for row in chars.tolist())])

    def save_png(self, path: str | Path, title: str | None = None) -> Path:
        """Draw every tile (no downsampling) into a PNG. Needs matplotlib (``pip install matplotlib``).

        Returns:
            The path written.
        """
        try:  # a bare Figure, not pyplot: the caller's matplotlib backend and open figures stay as they are
            from matplotlib.colors import ListedColormap
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise ImportError("a PNG needs matplotlib: pip install matplotlib (or mmsparse[examples])") from e
        path = Path(path)
        classes = self.live.to(torch.int8) + self.full.to(torch.int8)  # 0 skipped, 1 partial, 2 full
        colors = ["#f2f2f2", "#f4a259", "#2e5e8c"]
        nq, nk = self.live.shape
        fig = Figure(figsize=(6, 6 * max(nq, 1) / max(nk, 1) + 0.8))
        ax = fig.subplots()
        ax.imshow(classes.numpy(), cmap=ListedColormap(colors), vmin=0, vmax=2, interpolation="nearest")
        ax.set_xlabel(f"key tile ({self.tile[1]} keys)")
        ax.set_ylabel(f"query tile ({self.tile[0]} queries)")
        ax.set_title(title or f"S = {self.seq_len}, {self.tile[0]}x{self.tile[1]} tiles; {self.summary()}",
                     fontsize=8, wrap=True)
        ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(colors[::-1], ("full", "partial", "skipped"))],
                  loc="upper right", fontsize=7)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        return path


def _pool(x: torch.Tensor, g: int, fill: bool, how: str) -> torch.Tensor:
    """Reduce g x g groups of a bool ``[R, C]`` map (any/all), padding the ragged edge with ``fill``."""
    if g == 1:
        return x.clone()
    r, c = x.shape
    padded = x.new_full((cdiv(r, g) * g, cdiv(c, g) * g), fill)
    padded[:r, :c] = x
    groups = padded.view(cdiv(r, g), g, cdiv(c, g), g)
    return groups.any(3).any(1) if how == "any" else groups.all(3).all(1)


def parse_tile(tile: Any) -> tuple[int, int]:
    """A tile as ``(block_m, block_n)`` from an int (square), a pair, or a string ``"128"`` / ``"128x64"``."""
    if isinstance(tile, str):
        parts = tile.lower().split("x")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tile must look like 128 or 128x64; got {tile!r}")
        tile = tuple(int(p) for p in parts)
    if isinstance(tile, int) and not isinstance(tile, bool):
        tile = (tile, tile)
    if (not isinstance(tile, (tuple, list)) or len(tile) not in (1, 2)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in tile)):
        raise TypeError(f"tile must be an int or a pair of ints (query rows, key columns); got {tile!r}")
    block_m, block_n = (tile[0], tile[0]) if len(tile) == 1 else tile
    if block_m < 1 or block_n < 1:
        raise ValueError(f"tile sizes must be positive; got {block_m}x{block_n}")
    return block_m, block_n


def tile_map(
    topology: Any, seg_lens: SegLensArg, tile: TileArg = 128, causal: bool = False, packed: bool = False,
    window: int | None = None,
) -> TileMap:
    """Classify the tiles of a topology mask (self-attention over all S positions).

    Args:
        topology: k x k matrix of pair types, as nested lists, a tensor or a :class:`mmsparse.Topology`:
            ``topology[r][c]`` is ``NONE`` (0: segment r's queries never see segment c), ``FULL`` (1: every key of
            c) or ``CAUSAL`` (2: the keys of c at or before the query's position). Any number of segments
            (up to 4095).
        seg_lens: k segment lengths, S = sum(seg_lens); with ``packed``, ``[N, k]``: one row per sample.
        tile: the tile, an int (square) or ``(query rows, key columns)``; the CUDA forward uses 128x64 or
            64x64 tiles, the CPU interpreter 32x16.
        causal: also require key position <= query position, for every pair.
        packed: ``seg_lens`` rows are samples laid end to end (as ``mbs_attention_varlen`` takes them), each
            seeing only itself; S is the total.
        window: a sliding window: keys at positions greater than the query's minus ``window`` only.

    Returns:
        A :class:`TileMap`; ``.picture()`` draws it as text, ``.summary()`` counts, ``.save_png()`` a PNG.
    """
    causal = check_flag("causal", causal)
    packed = check_flag("packed", packed)
    window = check_window(window)
    block_m, block_n = parse_tile(tile)
    topo = Topology(topology)
    lens = _lens_rows(seg_lens, topo.num_segments, packed)
    seq = int(lens.sum())
    if seq == 0:
        raise ValueError(f"seg_lens {lens.tolist() if packed else lens[0].tolist()} sum to 0: there is nothing to "
                         "draw")
    if cdiv(seq, block_m) * cdiv(seq, block_n) > _MAX_TILES:
        raise ValueError(f"{cdiv(seq, block_m)} x {cdiv(seq, block_n)} tiles of {block_m}x{block_n} are too many to "
                         f"classify for S = {seq}: use a larger tile")
    codes = token_codes(lens, topo.num_segments, seq, packed)  # [1, S], on the CPU
    table = topo.pair_table(codes.device)
    live, full = classify_blocks_from_codes(codes, codes, table, block_m, block_n, causal, 0, window)
    density = int(count_pairs_from_codes(codes, codes, table, causal, 0, window)[0]) / seq**2
    return TileMap(live[0], full[0], (block_m, block_n), seq, density)


def _lens_rows(seg_lens: SegLensArg, num_segments: int, packed: bool) -> torch.Tensor:
    """int64 ``[1, k]`` (one sample) or, packed, ``[N, k]`` lengths, checked."""
    seg_lens = seg_lens_argument(seg_lens)
    rows = seg_lens.tolist() if isinstance(seg_lens, torch.Tensor) else seg_lens
    if not packed:
        if is_per_sample(rows):
            raise ValueError(f"seg_lens has {len(rows)} rows: a picture is of one sequence; pass packed=True to draw "
                             "the rows as samples packed end to end, or one row of "
                             f"{num_segments} lengths")
        return torch.tensor([validate_seg_lens(rows, num_segments)], dtype=torch.int64)
    if not isinstance(rows, Sequence) or not is_per_sample(rows):
        raise ValueError(f"packed seg_lens must be [samples, {num_segments}] (one row of {num_segments} lengths per "
                         f"sample); got {seg_lens!r}")
    if len(rows) > MAX_DOCS:
        raise ValueError(f"{len(rows)} samples in one pack; at most {MAX_DOCS} are supported")
    checked = check_rows(rows, num_segments, sum(sum(int(n) for n in r) for r in rows))
    return torch.tensor(checked, dtype=torch.int64)


def tile_picture(
    topology: Any, seg_lens: SegLensArg, tile: TileArg = 128, causal: bool = False, width: int = 64,
    png: str | Path | None = None, packed: bool = False, window: int | None = None,
) -> str:
    """The tile picture of a topology mask as text (see :meth:`TileMap.picture`), optionally also as a PNG.

    Args:
        topology: k x k matrix of pair types ``NONE``/``FULL``/``CAUSAL`` (0/1/2), any number of segments, or a
            :class:`mmsparse.Topology` (see :func:`tile_map`).
        seg_lens: k segment lengths; with ``packed``, ``[N, k]``: one row per sample.
        tile: an int (square tiles) or ``(query rows, key columns)``.
        causal: also require key position <= query position.
        width: the most characters per line; larger maps are downsampled.
        png: a path to also write the full-resolution PNG to (needs matplotlib).
        packed: the rows of ``seg_lens`` are samples laid end to end, each seeing only itself.
        window: a sliding window (see :func:`tile_map`).

    Returns:
        The picture (header line, then the rows) followed by the summary line.
    """
    tiles = tile_map(topology, seg_lens, tile, causal, packed, window)
    if png is not None:
        tiles.save_png(png)
    return f"{tiles.picture(width)}\n{tiles.summary()}"
