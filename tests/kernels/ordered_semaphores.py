"""The ordered one-pass backward's semaphores, read after a call: a recorder of the semaphores each call allocates
and of the by-key lists its add ranks came from, and the check that every semaphore ends at the number of key
blocks whose lists hold its tile."""

from __future__ import annotations

import pytest
import torch

from mmsparse.attention import backward
from mmsparse.attention.config import Tile
from mmsparse.mask.blocks import cdiv
from mmsparse.mask.info import MaskInfo


class SemaphoreRecord:
    """Wraps the backward's dQ accumulator allocation and the mask's add ranks: keeps each call's semaphores and
    the by-key lists its ranks came from, to read after the call."""

    def __init__(self, allocate, ranks) -> None:
        self.allocate, self.ranks, self.semaphores, self.lists = allocate, ranks, [], []

    def __call__(self, shape, device, semaphores):
        dq_sum, dq_sem = self.allocate(shape, device, semaphores)
        self.semaphores.append(dq_sem)
        return dq_sum, dq_sem

    def add_ranks(self, info, block_m, block_n):
        self.lists.append((info.built_lists(block_m, block_n, True), cdiv(info.seq_q, block_m)))
        return self.ranks(info, block_m, block_n)


def record_semaphores(monkeypatch: pytest.MonkeyPatch) -> SemaphoreRecord:
    """Record the semaphores and lists of the ordered one-pass backwards run while ``monkeypatch`` holds."""
    spy = SemaphoreRecord(backward._dq_accumulator, MaskInfo.dq_add_ranks)
    monkeypatch.setattr(backward, "_dq_accumulator", spy)
    monkeypatch.setattr(MaskInfo, "dq_add_ranks", lambda info, bm, bn: spy.add_ranks(info, bm, bn))
    return spy


def _listed_counts(lists, n_cols: int, batch: int, heads: int) -> torch.Tensor:
    """int32 ``[B, Hq, query blocks]``: how many key blocks' lists hold each query block."""
    counts, ids = lists.padded(n_cols)
    held = torch.stack([(ids == c).sum((1, 2)) for c in range(n_cols)], -1).to(torch.int32).cpu()  # [Bm, NQ]
    return held[:, None, :].expand(batch, heads, n_cols)


def _live_counts(mask: torch.Tensor, batch: int, heads: int, block_m: int, block_n: int) -> torch.Tensor:
    """int32 ``[B, Hq, query blocks]``: the key blocks with an allowed pair in each query block (from the dense
    reference mask: the tiles the float64 reference says are live)."""
    mask = mask.expand(batch, *mask.shape[-2:]) if mask.dim() == 3 else mask.expand(batch, *mask.shape)
    seq_q, seq_k = mask.shape[-2:]
    n_q, n_k = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    padded = torch.zeros(batch, n_q * block_m, n_k * block_n, dtype=torch.bool)
    padded[:, :seq_q, :seq_k] = mask.cpu()
    live = padded.view(batch, n_q, block_m, n_k, block_n).any(4).any(2)  # [B, NQ, NK]
    return live.sum(-1).to(torch.int32)[:, None, :].expand(batch, heads, n_q)


def check_semaphore_counts(record: SemaphoreRecord, mask: torch.Tensor, batch: int, heads: int, tile: Tile,
                           window: bool) -> None:
    """One call's semaphores each end at the number of key blocks whose lists hold its tile (each waited for its
    turn and passed it on); without a window that is the number of live tiles of the reference ``mask`` at
    ``tile`` (a window's edge may list a tile with no pair)."""
    (sem,), ((lists, n_cols),) = record.semaphores, record.lists
    want = _listed_counts(lists, n_cols, batch, heads)
    per_tile = sem.numel() // want.numel()  # the Gluon kernel (Hopper): one per warpgroup's column half
    got = sem.cpu().view(*want.shape, per_tile)
    assert torch.equal(got, want[..., None].expand_as(got)), f"semaphores {got} vs {want}"
    if not window:
        assert torch.equal(want, _live_counts(mask, batch, heads, tile.block_m, tile.block_n))
