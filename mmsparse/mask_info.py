"""Everything the kernels need to know about one mask, built once per (topology, lengths, device) and cached.

The token-level part is O(S): per-token bit vectors, or the user's dense mask on the arbitrary-mask path.
Block lists are built lazily for each tile shape a kernel asks for.
"""

from __future__ import annotations

import torch

from .blocks import (
    BlockLists,
    classify_blocks_from_bits,
    classify_blocks_from_mask,
    lists_from_classes,
    pool_classes,
)
from .ops.block_lists import build_block_lists, kernels_run_on
from .ops.common import MASK_BITS, MASK_DENSE
from .ops.config import KernelConfig
from .ops.token_bits import token_bits
from .topology import MAX_SEGMENTS, Topology


class MaskInfo:
    """Mask description for seq_q queries (at positions q_start .. q_start + seq_q - 1; by default the last seq_q)
    over keys 0 .. seq_k - 1.

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
    ) -> None:
        self.mode = mode
        self.seq_q, self.seq_k = seq_q, seq_k
        self.causal = causal
        self.q_bits, self.k_bits, self.num_segments = q_bits, k_bits, num_segments
        self.dense = dense
        ref = q_bits if mode == MASK_BITS else dense
        self.batch = ref.shape[0]
        self.device = ref.device
        # Position of each sample's first query: by default the queries are the last seq_q positions.
        if q_start is None:
            self.past = _default_past(seq_k - seq_q, self.device)
        else:
            self.past = q_start.to(device=self.device, dtype=torch.int32).reshape(-1)
        self._classes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lists: dict[tuple[int, int, bool], BlockLists] = {}
        self._summaries: dict[tuple[int, int], torch.Tensor] = {}  # per tile, shared by that tile's lists
        self._launch_args: dict[tuple[int, int, bool], tuple[tuple, tuple]] = {}
        self.forward_plans: dict[tuple, object] = {}  # the forward launcher's, per shapes and strides

    @classmethod
    def from_topology(
        cls, topology: Topology, seg_lens: torch.Tensor, seq_q: int, seq_k: int, causal: bool,
        q_start: torch.Tensor | None = None,
    ) -> MaskInfo:
        """seg_lens: int ``[Bm, k]`` on the target device, each row summing to at most seq_k. q_start: optional
        int ``[B]``, the position of each sample's first query (decoding over caches of different lengths)."""
        row_bits, col_bits = token_bits(topology, seg_lens, seq_k)
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
                   num_segments=topology.num_segments, q_start=q_start)

    @classmethod
    def from_dense(cls, mask: torch.Tensor, causal: bool) -> MaskInfo:
        """mask: bool ``[Bm, Sq, Sk]`` over the query rows, on the target device."""
        mask = mask.contiguous()
        return cls(MASK_DENSE, mask.shape[1], mask.shape[2], causal, dense=mask)

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
                    self.q_bits, self.k_bits, self.num_segments, block_m, block_n, self.causal, self.past
                )
            else:
                self._classes[key] = classify_blocks_from_mask(self.dense, block_m, block_n, self.causal, self.past)
        return self._classes[key]

    def lists(self, block_m: int, block_n: int, by_key: bool = False) -> BlockLists:
        """Per query block its key blocks, or (by_key) per key block its query blocks. Topology masks: built by
        Triton kernels straight from the token bits (two launches); dense masks, or CPU tensors without Triton's
        interpreter: reduced from :meth:`classes` in torch."""
        key = (block_m, block_n, by_key)
        if key not in self._lists and self.mode == MASK_BITS and kernels_run_on(self.device):
            self._lists[key] = build_block_lists(self.q_bits, self.k_bits, self.num_segments, block_m, block_n,
                                                 self.causal, self.past, by_key, self._summaries)
        if key not in self._lists:
            live, full = self.classes(block_m, block_n)
            if by_key:
                live, full = live.transpose(1, 2), full.transpose(1, 2)
            self._lists[key] = lists_from_classes(live, full)
        return self._lists[key]

    def prepare(self, config: KernelConfig) -> MaskInfo:
        """Build the block lists of every kernel of ``config`` now (forward, dK/dV, dQ), e.g. before timing or
        CUDA-graph capture."""
        keys = _list_keys(config, self.seq_q, self.seq_k)
        if self.mode == MASK_DENSE or not kernels_run_on(self.device):  # the lists come from classes()
            for block_m, block_n, _ in sorted(keys, key=lambda k: k[0] * k[1]):  # finest first: the rest pool it
                self.classes(block_m, block_n)
        for block_m, block_n, by_key in keys:
            self.lists(block_m, block_n, by_key)
        return self

    def kernel_tensors(self, config: KernelConfig) -> list[torch.Tensor]:
        """Every tensor the kernels of ``config`` read, in a fixed order (for the torch custom op):
        q_bits, k_bits, dense mask (empty stand-ins for the unused path), then (counts, indices) of the forward,
        dK/dV and dQ lists."""
        self.prepare(config)
        empty_bits = torch.empty((self.batch, 0), dtype=torch.int32, device=self.device)
        if self.mode == MASK_BITS:
            tensors = [self.q_bits, self.k_bits, torch.empty((self.batch, 0, 0), dtype=torch.bool, device=self.device)]
        else:
            tensors = [empty_bits, empty_bits, self.dense]
        tensors.append(self.past)
        for key in _list_keys(config, self.seq_q, self.seq_k):
            lists = self._lists[key]
            tensors += [lists.counts, lists.indices]
        return tensors

    @classmethod
    def from_kernel_tensors(
        cls, tensors: list[torch.Tensor], config: KernelConfig, mode: int, seq_q: int, seq_k: int, causal: bool
    ) -> MaskInfo:
        """Inverse of :meth:`kernel_tensors`."""
        q_bits, k_bits, dense, past = tensors[:4]
        if mode == MASK_BITS:
            info = cls(mode, seq_q, seq_k, causal, q_bits=q_bits, k_bits=k_bits, num_segments=MAX_SEGMENTS,
                       q_start=past)
        else:
            info = cls(mode, seq_q, seq_k, causal, dense=dense, q_start=past)
        for i, key in enumerate(_list_keys(config, seq_q, seq_k)):
            info._lists[key] = BlockLists(tensors[4 + 2 * i], tensors[5 + 2 * i])
        return info

    def launch_args(self, block_m: int, block_n: int, by_key: bool = False) -> tuple[tuple, tuple]:
        """The kernels' mask arguments at one tile, kept per tile (a small call is bound by host work):
        ``(tensors, scalars)`` = ((q_bits, k_bits, dense mask, counts, indices), (q_bits batch stride, k_bits batch
        stride, mask batch stride, mask row stride, counts batch stride, indices batch stride, indices row stride,
        seq_q, seq_k, first-query positions int32 [Bm or 1], their batch stride)). Unused tensors are stand-ins
        that are never read; a batch stride of 0 shares one mask (or list) across the batch."""
        key = (block_m, block_n, by_key)
        args = self._launch_args.get(key)
        if args is not None:
            return args
        lists = self.lists(block_m, block_n, by_key)
        shared = self.batch == 1
        if self.mode == MASK_BITS:
            # k_bits' batch stride is 0 too when the key bits are shared (expanded)
            mask = (self.q_bits, self.k_bits, self.q_bits)
            mask_strides = (0 if shared else self.q_bits.stride(0), 0 if shared else self.k_bits.stride(0), 0, 0)
        else:
            dense = self.dense.view(torch.uint8)
            mask, mask_strides = (dense, dense, dense), (0, 0, 0 if shared else dense.stride(0), dense.stride(1))
        list_strides = (0 if shared else lists.counts.stride(0), 0 if shared else lists.indices.stride(0),
                        lists.indices.stride(1))
        past_stride = 0 if self.past.shape[0] == 1 else self.past.stride(0)
        args = self._launch_args[key] = (
            (*mask, lists.counts, lists.indices),
            (*mask_strides, *list_strides, self.seq_q, self.seq_k, self.past, past_stride),
        )
        return args


def _list_keys(config: KernelConfig, seq_q: int, seq_k: int) -> list[tuple[int, int, bool]]:
    """The (block_m, block_n, by_key) lists the forward, dK/dV and dQ kernels of a config read for seq_q queries
    over seq_k keys."""
    fwd, dq = config.forward_tile(seq_q, seq_k), config.dq_tile(seq_k)
    return [
        (fwd.block_m, fwd.block_n, False),
        (config.bwd_dkdv.block_m, config.bwd_dkdv.block_n, True),
        (dq.block_m, dq.block_n, False),
    ]


_PASTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _default_past(past: int, device: torch.device) -> torch.Tensor:
    """int32 ``[1]`` holding ``past`` on ``device``, shared by the masks that need it (the kernels only read it):
    a mask built for new lengths skips one allocation and fill."""
    key = (device, past)
    t = _PASTS.get(key)
    if t is None:
        t = torch.full((1,), past, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return t  # filled only when the graph replays: not for eager masks
        if len(_PASTS) >= 256:
            _PASTS.clear()
        _PASTS[key] = t
    return t
