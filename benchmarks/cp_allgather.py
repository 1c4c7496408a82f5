"""The plain all-gather baseline of context parallelism, for ``cp_nccl`` to time beside ``ContextParallel``.

Rank r holds the contiguous positions [r L, r L + L) with L = ceil(S / P) (the last rank may hold fewer). The
forward all-gathers K and V (``all_gather_into_tensor``, shards padded to L) and runs mmsparse's kernels on the
rank's queries against every key, the queries placed at ``q_start = r L`` (the mask built once); the backward
reduce-scatters every key's dK/dV to its owner in float32 (``reduce_scatter_tensor``). Nothing is balanced:
under a causal mask the last rank has the most pairs, and every rank receives all of K/V whatever its queries see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mmsparse.functional import attention_with_info
from mmsparse.mask.build import build_mask_info

from .cp_dist import all_gather_single, reduce_scatter_single


class AllGatherCP:
    """Contiguous shards, K/V all-gathered, dK/dV reduce-scattered.

    Args:
        topology: k x k pair types, or an ``mmsparse.Topology``.
        seg_lens: k lengths (shared by the batch).
        causal: the global causal flag.
        device: where the mask lives.
    """

    def __init__(self, topology: Any, seg_lens: Sequence[int], causal: bool, device: torch.device) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.seq_len = sum(seg_lens)
        self.shard_len = math.ceil(self.seq_len / self.world_size)
        self.start = min(self.rank * self.shard_len, self.seq_len)
        self.stop = min(self.start + self.shard_len, self.seq_len)
        self.info = build_mask_info(topology, seg_lens, self.stop - self.start, self.seq_len, causal, device,
                                    q_start=[self.start])

    def shard(self, x: torch.Tensor, seq_dim: int = 2) -> torch.Tensor:
        """This rank's positions of ``x`` (a copy)."""
        return x.narrow(seq_dim, self.start, self.stop - self.start).contiguous()

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: ``[B, Hq, S_local, D]``; k, v: ``[B, Hkv, S_local, D]``, this rank's positions. Returns
        ``[B, Hq, S_local, D]``."""
        hkv = k.shape[1]
        kv = _GatherKV.apply(torch.cat([k, v], dim=1), self)
        return attention_with_info(q, kv[:, :hkv], kv[:, hkv:], self.info, None, 0.0)

    def bytes_per_rank(self, batch: int, heads_kv: int, head_dim: int, element_size: int) -> tuple[int, int]:
        """(sent, received) bytes of one step on each rank, both ways alike: the K/V of the other P - 1 shards
        (a ring all-gather) and their float32 dK/dV (a ring reduce-scatter)."""
        tokens = (self.world_size - 1) * self.shard_len
        moved = tokens * batch * 2 * heads_kv * head_dim * (element_size + 4)
        return moved, moved


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv_local, ag: AllGatherCP):  # type: ignore[override]
        b, h, n, d = kv_local.shape
        ctx.ag, ctx.n = ag, n
        padded = kv_local.new_zeros((ag.shard_len, b, h, d))  # sequence first: shards stack along dim 0
        padded[:n] = kv_local.permute(2, 0, 1, 3)
        gathered = padded.new_empty((ag.world_size * ag.shard_len, b, h, d))
        all_gather_single(gathered, padded)
        return gathered[: ag.seq_len].permute(1, 2, 0, 3).contiguous()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ag: AllGatherCP = ctx.ag
        b, h, _, d = grad.shape
        full = grad.new_zeros((ag.world_size * ag.shard_len, b, h, d), dtype=torch.float32)
        full[: ag.seq_len] = grad.permute(2, 0, 1, 3)
        mine = full.new_empty((ag.shard_len, b, h, d))
        reduce_scatter_single(mine, full)
        return mine[: ctx.n].permute(1, 2, 0, 3).to(grad.dtype), None
