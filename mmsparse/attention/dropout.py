"""A call's dropout seed, and the kernels' dropout keep mask materialised for tests and debugging (it is S x S per
head: never on the attention path, which regenerates it tile by tile)."""

from __future__ import annotations

import torch

from ..kernels.tl.dropout import dropout_keep_mask_kernel
from ..mask.blocks import cdiv
from ..runtime.launch import FastKernel

# Through FastKernel like every other launch: on the CPU it takes the interpreter's lock and checks its probe.
_KEEP_MASK = FastKernel(dropout_keep_mask_kernel)


def new_dropout_seed(device: torch.device) -> torch.Tensor:
    """The kernels' int64 ``[3]`` dropout seed: a key over the full 64 bits (Philox's), from torch's default
    generator of the device (torch.manual_seed reproduces it; two calls share a dropout mask with odds 2^-64, not
    2^-30), then the query and key position offsets, 0 for a call over the whole sequence."""
    return torch.cat([torch.randint(-(2**63), 2**63 - 1, (1,), device=device, dtype=torch.int64),
                      torch.zeros(2, device=device, dtype=torch.int64)])


def dropout_keep_mask(
    seed: torch.Tensor, batch: int, num_heads: int, seq_q: int, seq_k: int, dropout_p: float,
    q_start: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """bool ``[B, Hq, Sq, Sk]``: True where the kernels keep an attention weight for this seed. The bits are keyed
    by absolute positions: query i of sample b sits at ``q_start[b] + i`` (by default ``seq_k - seq_q``)."""
    out = dropout_keep_rows(seed, 0, batch * num_heads, num_heads, 0, seq_q, seq_k, dropout_p,
                            _query_starts(seed, batch, seq_q, seq_k, q_start))
    return out.reshape(batch, num_heads, seq_q, seq_k)


def dropout_keep_rows(
    seed: torch.Tensor, bh0: int, count: int, num_heads: int, row0: int, rows: int, seq_k: int, dropout_p: float,
    q_start: torch.Tensor,
) -> torch.Tensor:
    """bool ``[count, rows, Sk]``: the keep mask of (batch * head) bh0 .. bh0 + count - 1, query rows row0 ..
    row0 + rows - 1, for references computed a slice at a time. ``q_start``: int32 ``[B]``, each sample's first
    query position."""
    if seed.numel() == 1:  # a bare Philox key: offsets 0
        seed = torch.cat([seed.reshape(1), seed.new_zeros(2)])
    out = torch.empty((count, rows, seq_k), dtype=torch.int8, device=seed.device)
    grid = (cdiv(rows, 32), cdiv(seq_k, 32), count)
    _KEEP_MASK[grid](seed, out, q_start, bh0, row0, rows, seq_k, dropout_p, NUM_HEADS=num_heads, BM=32, BN=32)
    return out.bool()


def _query_starts(seed: torch.Tensor, batch: int, seq_q: int, seq_k: int, q_start) -> torch.Tensor:
    if q_start is None:
        q_start = [seq_k - seq_q] * batch
    return torch.as_tensor(q_start, dtype=torch.int32).to(seed.device).reshape(-1).expand(batch).contiguous()
