"""The order in which key blocks add into each dQ tile in the ordered one-pass backward.

The ordered one-pass backward (``KernelConfig.deterministic_backward = "ordered_one_pass"``) has each key-block
program of the dK/dV pass add its dQ contribution into a query block only after every key block ranked before it
has added there, so that each float32 sum is formed in one fixed order and is bitwise repeatable. A key block's
rank at a query block is the number of key blocks with a lower index whose list holds that query block.

Ranking by key block index matches the launch order: the dK/dV grid puts the key block on its fastest axis, so
every key block a program waits for was launched before it (CUDA dispatches blocks in grid order; Triton's
interpreter runs the programs of one (batch, head) column in ascending key block order), and the lowest key
block of a query block never waits. Built from the by-key block lists alone: a sort of their entries, no S x S
and no [query blocks, key blocks] tensor, and no read-back to the host.
"""

from __future__ import annotations

import torch

from .blocks import BlockLists


def add_ranks(lists: BlockLists, n_cols: int) -> torch.Tensor:
    """The rank of each entry of by-key block lists among the rows (key blocks) whose lists hold its column.

    Args:
        lists: by-key :class:`BlockLists` (rows: key blocks; columns: query blocks), fixed slots or packed.
        n_cols: the number of query blocks (column ids are below it).

    Returns:
        int32, the shape of ``lists.indices``: entry ``(b, p)`` in row r with column c holds the number of rows
        r' < r of sample b whose list holds c; slots past a row's count hold 0 (never read).
    """
    counts, indices = lists.counts, lists.indices
    mask_batch, n_rows, _ = counts.shape
    length = indices.shape[1]
    device = indices.device
    ranks = torch.zeros(indices.shape, dtype=torch.int32, device=device)
    if length == 0 or n_rows == 0 or n_cols == 0:
        return ranks
    starts = counts[..., 2].long().contiguous()  # [Bm, R], non-decreasing in both layouts
    ends = starts + counts[..., 0].long() + counts[..., 1].long()
    pos = torch.arange(length, device=device).expand(mask_batch, length).contiguous()
    # The row of each slot: the last row starting at or before it (empty rows share the next row's start).
    row = (torch.searchsorted(starts, pos, right=True) - 1).clamp_min(0)
    valid = pos < ends.gather(1, row)
    sample = torch.arange(mask_batch, device=device)[:, None]
    # Unique per (sample, column, row); unwritten slots sort after every entry.
    key = (sample * n_cols + indices.long().clamp(0, n_cols - 1)) * n_rows + row
    key = torch.where(valid, key, mask_batch * n_cols * n_rows)
    sorted_key, order = torch.sort(key.flatten())
    column = sorted_key // n_rows
    first = torch.ones_like(column, dtype=torch.bool)
    first[1:] = column[1:] != column[:-1]
    place = torch.arange(column.numel(), device=device)
    group_start = torch.cummax(torch.where(first, place, 0), 0).values
    ranks.view(-1)[order] = (place - group_start).to(torch.int32)
    return torch.where(valid, ranks, 0)
