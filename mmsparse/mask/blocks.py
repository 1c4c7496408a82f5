"""Block-sparse metadata: which (query block, key block) tiles are empty, full or partial.

A tile is *live* when at least one pair in it is allowed, *full* when every pair is allowed and the key block
lies inside the sequence (then the kernel needs no mask at all), and *partial* otherwise (live, masked).

A sliding window (a key is kept only when its position is past the query's minus W) cuts the tiles by geometry
alone (:func:`band_classes`): a tile wholly before the band is empty, one wholly inside keeps its class, and one
across the band's edge is partial (the kernel masks it exactly).

The lists are built from per-token bit vectors (see :mod:`mmsparse.mask.topology`), so the cost is O(S * k) for the
tokens plus O(blocks * k) for the tiles: no S x S tensor. Everything stays on the input device; only lists large
enough to be packed to their live tiles read one number (their length) back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .list_order import write_launch_order

_FAR = 1 << 40  # a position no token has


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2`` gives it: Triton's is a
    ``constexpr_function`` since 3.5, ~2 us a host call, on the paths that build a mask every step."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# Column block ids fit 16 bits up to 32,767 blocks (2M keys at 64-wide tiles): half the bytes of int32.
_INT16_LIMIT = 2**15 - 1


def index_dtype(columns: int, packed: bool) -> torch.dtype:
    """The dtype of block ids below ``columns``: int16 in packed lists when they fit, else int32. Packed lists are
    the large ones, where the halved bytes keep a 1M-token mask's metadata small; the Gluon forward runs 2-4%
    slower on int16 ids (docs/performance.md, "Block-list memory"), so the fixed-slot lists of every smaller mask
    keep int32."""
    return torch.int16 if packed and columns <= _INT16_LIMIT else torch.int32


@dataclass(frozen=True)
class BlockLists:
    """Per row block, the column blocks to visit: FULL ones first, then PARTIAL ones.

    Attributes:
        counts: int32 ``[Bm, R, 4]`` (``kernels.constants.COUNT_WORDS``): (number of full, number of partial,
            start) of each row block, its list ``indices[b, start : start + full + partial]``; and in the fourth
            word, the launch order: row i holds the row block with the sample's i-th longest list
            (:mod:`mmsparse.mask.list_order`), the one a kernel's i-th program of a head takes.
        indices: int16 or int32 (:func:`index_dtype`) ``[Bm, L]``: column block ids. Either every row owns C
            slots (``start = r * C``, nothing read back to the host), or the lists are packed end to end (CSR:
            live tiles only), which large masks use to keep the metadata small.
    Bm is 1 when the whole batch shares the lists.
    """

    counts: torch.Tensor
    indices: torch.Tensor

    def padded(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts [Bm, R, 2], ids [Bm, R, columns])`` with each row's ids in slots ``0 .. full + partial - 1``
        and -1 after them: the layout-independent form that tests compare."""
        counts = self.counts[..., :2]
        used = counts.sum(-1, keepdim=True).long()
        slot = torch.arange(columns, device=self.counts.device)
        taken = slot < used
        pos = torch.where(taken, self.counts[..., 2:3].long() + slot, 0).flatten(1)
        ids = self.indices.long().gather(1, pos).view(*taken.shape) if self.indices.numel() else pos.view(*taken.shape)
        return counts, torch.where(taken, ids, -1)


def lists_from_classes(live: torch.Tensor, full: torch.Tensor) -> BlockLists:
    """Turn bool ``[Bm, R, C]`` live/full tile maps into :class:`BlockLists` over the last dim (C slots a row)."""
    mask_batch, rows, cols = live.shape
    rank = (~full).to(torch.int8) + (~live).to(torch.int8)  # 0 full, 1 partial, 2 empty
    indices = torch.argsort(rank, dim=-1, stable=True).to(index_dtype(cols, False)).reshape(mask_batch, rows * cols)
    starts = torch.arange(rows, device=live.device, dtype=torch.int64).expand(mask_batch, rows) * cols
    # the fourth word, the launch order, is written next
    counts = torch.stack([full.sum(-1), (live & ~full).sum(-1), starts, starts], dim=-1).to(torch.int32).contiguous()
    write_launch_order(counts)
    return BlockLists(counts, indices.contiguous())


def _bits_to_flags(bits: torch.Tensor, num_segments: int) -> torch.Tensor:
    """int32 ``[Bm, S]`` -> bool ``[Bm, S, k]``: bit t of each token."""
    t = torch.arange(num_segments, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> t) & 1).bool()


def _pad_rows(x: torch.Tensor, total: int, value: bool) -> torch.Tensor:
    if x.shape[1] == total:
        return x
    pad = x.new_full((x.shape[0], total - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def classify_blocks_from_bits(
    q_bits: torch.Tensor,
    k_bits: torch.Tensor,
    num_segments: int,
    block_m: int,
    block_n: int,
    causal: bool,
    q_start: int | torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact live/full maps of the tiles of a topology mask (with a window: :func:`band_classes`).

    Args:
        q_bits: int32 ``[Bm, Sq]`` row bits of the query tokens (positions q_start .. q_start + Sq - 1).
        k_bits: int32 ``[Bm, Sk]`` one-hot column bits of the key tokens (0 for padding).
        num_segments: k, the number of bits in use.
        block_m, block_n: the tile.
        causal: also require ``j <= q_start + i``.
        q_start: position of the first query: Sk - Sq, or int ``[Bm]`` per sample.
        window: also require key position > query position - window (None: no window).

    Returns:
        ``(live, full)``, bool ``[Bm, NQ, NK]``.
    """
    mask_batch = q_bits.shape[0]
    sq, sk = q_bits.shape[1], k_bits.shape[1]
    nq, nk = cdiv(sq, block_m), cdiv(sk, block_n)
    dev = q_bits.device
    q_flags = _bits_to_flags(q_bits, num_segments)  # [Bm, Sq, k]
    k_flags = _bits_to_flags(k_bits, num_segments)  # [Bm, Sk, k]

    # Live: some segment t with a row that sees t at or after (causal) a column of segment t.
    # Without causal the positions collapse to 1 (rows) and 0 (columns), so "exists" is all that counts.
    q_start = _as_positions(q_start, dev)  # [1 or Bm, 1]
    if causal:
        q_pos = q_start + torch.arange(nq * block_m, device=dev, dtype=torch.int64)  # [1 or Bm, NQ*BM]
        k_pos = torch.arange(nk * block_n, device=dev, dtype=torch.int64)
    else:
        q_pos = torch.ones(1, nq * block_m, device=dev, dtype=torch.int64)
        k_pos = torch.zeros(nk * block_n, device=dev, dtype=torch.int64)
    q_flags_p = _pad_rows(q_flags, nq * block_m, False)
    k_flags_p = _pad_rows(k_flags, nk * block_n, False)
    last_row = torch.where(q_flags_p, q_pos[:, :, None], -_FAR).view(mask_batch, nq, block_m, -1).amax(2)
    first_col = torch.where(k_flags_p, k_pos[None, :, None], _FAR).view(mask_batch, nk, block_n, -1).amin(2)
    live = (last_row[:, :, None, :] >= first_col[:, None, :, :]).any(-1)

    # Full: every in-range row sees every segment present in the key block, the key block is all real tokens,
    # and (causal) its last column is visible from the block's first row.
    rows_see_all = _pad_rows(q_flags, nq * block_m, True).view(mask_batch, nq, block_m, -1).all(2)  # [Bm, NQ, k]
    present = first_col < _FAR  # [Bm, NK, k]
    keys_clean = k_flags_p.any(-1).view(mask_batch, nk, block_n).all(-1)  # [Bm, NK]
    unseen = (present[:, None, :, :] & ~rows_see_all[:, :, None, :]).any(-1)
    full = live & ~unseen & keys_clean[:, None, :]
    if causal:
        last_col = torch.clamp(torch.arange(1, nk + 1, device=dev) * block_n, max=sk) - 1
        first_row = q_start + torch.arange(nq, device=dev) * block_m  # [1 or Bm, NQ]
        full &= last_col[None, None, :] <= first_row[:, :, None]
    return band_classes(live, full, block_m, block_n, sq, sk, q_start, window)


def band_classes(
    live: torch.Tensor, full: torch.Tensor, block_m: int, block_n: int, seq_q: int, seq_k: int,
    q_start: int | torch.Tensor, window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Live/full maps ``[Bm, NQ, NK]`` cut to the window's band (key position > query position - window), from
    the tiles' positions alone (clipped to seq_q and seq_k): a tile whose positions all lie before the band is
    empty, one whose positions all lie in it keeps its class, one across the band's edge is not full. The last
    are masked exactly by the kernel; if the topology leaves such a tile no allowed pair in the band, it costs a
    visit but changes nothing. A causal test keeps this exact: a tile's key-minus-query distances are one run of
    integers, so a tile that meets both the band and the causal half-plane holds a pair allowed by both."""
    if window is None:
        return live, full
    dev = live.device
    nq, nk = live.shape[1], live.shape[2]
    starts = _as_positions(q_start, dev)  # [1 or Bm, 1]
    rows = torch.arange(nq, device=dev, dtype=torch.int64) * block_m
    q_first = starts + rows  # [1 or Bm, NQ]
    q_last = starts + torch.clamp(rows + block_m, max=seq_q) - 1
    k_first = torch.arange(nk, device=dev, dtype=torch.int64) * block_n
    k_last = torch.clamp(k_first + block_n, max=seq_k) - 1
    meets = k_last[None, None, :] > q_first[:, :, None] - window
    inside = k_first[None, None, :] > q_last[:, :, None] - window
    return live & meets, full & inside


def _as_positions(q_start: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A first-query position (int, or per sample ``[Bm]``) as int64 ``[1 or Bm, 1]``."""
    return torch.as_tensor(q_start, device=device).to(torch.int64).reshape(-1, 1)


def classify_blocks_from_mask(
    mask: torch.Tensor, block_m: int, block_n: int, causal: bool, q_start: int | torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Live/full maps by reducing a dense bool mask ``[Bm, Sq, Sk]`` over each tile (the arbitrary-mask path),
    with the causal test and the window (key position > query position - window) applied to its elements: exact.

    Without a window this is also the pure-torch reference for :func:`classify_blocks_from_bits`.
    """
    mask_batch, sq, sk = mask.shape
    nq, nk = cdiv(sq, block_m), cdiv(sk, block_n)
    if causal or window is not None:
        i = torch.arange(sq, device=mask.device)[:, None]
        j = torch.arange(sk, device=mask.device)[None, :]
        q_pos = _as_positions(q_start, mask.device)[:, :, None] + i  # [1 or Bm, Sq, 1]
        if causal:
            mask = mask & (j <= q_pos)
        if window is not None:
            mask = mask & (j > q_pos - window)
    cols = torch.zeros(mask_batch, sq, nk * block_n, dtype=torch.bool, device=mask.device)
    cols[:, :, :sk] = mask
    any_ = _pad_rows(cols, nq * block_m, False).view(mask_batch, nq, block_m, nk, block_n).any(4).any(2)
    all_ = _pad_rows(cols, nq * block_m, True).view(mask_batch, nq, block_m, nk, block_n).all(4).all(2)
    return any_, all_


def pool_classes(live: torch.Tensor, full: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Live/full maps of tiles ``rows`` x ``cols`` times larger, from the finer maps ``[Bm, NQ, NK]``.

    A coarse tile is live when any fine tile is, full when all are. Fine rows past the last query block do not
    exist (they would be past the end of the queries), so they count as full; missing fine columns would be
    past the end of the keys, which a full tile may not reach, so they count as not full.
    """
    mask_batch, nq, nk = live.shape
    nq2, nk2 = cdiv(nq, rows), cdiv(nk, cols)

    def pad(x: torch.Tensor, row_value: bool, col_value: bool) -> torch.Tensor:
        out = x.new_full((mask_batch, nq2 * rows, nk2 * cols), col_value)
        out[:, nq:, :] = row_value
        out[:, :nq, :nk] = x
        return out.view(mask_batch, nq2, rows, nk2, cols)

    return pad(live, False, False).any(4).any(2), pad(full, True, False).all(4).all(2)
