"""The attention kernels' mask arguments (their ABI): which tensors and scalars, in which order.

Every tl and Gluon attention kernel takes, after its q/k/v/output pointers, the same mask arguments:

    tensors: Q_BITS, K_BITS, MASK, COUNTS, INDICES (segment codes: Q_BITS/K_BITS hold the codes, MASK the pair
             table and stride_mask_q its row stride; COUNTS also the order in which the programs take the rows:
             ``mask.list_order``)
    scalars: stride_qbits_b, stride_kbits_b, stride_mask_b, stride_mask_q, stride_cnt_b, stride_idx_b,
             seq_q, seq_k, Q_START (the first-query positions, int32 [1 or Bm]), stride_qstart_b, window (the
             sliding window, read only by the HAS_WINDOW variants; 0 without one)

(the tl kernels take the dropout SEED between the two groups). The torch custom ops carry a mask as its
``kernel_tensors`` (:mod:`mmsparse.mask.info`) and each tile's lists, and make these arguments from them
(:func:`mask_launch_args`). Adding a kernel argument touches this module and the kernels, nothing
above.
"""

from __future__ import annotations

import weakref

import torch

from ..kernels.constants import MASK_DENSE, MASK_SEGMENTS
from ..mask.add_order import mask_adds_longest_first
from ..mask.bit_lists import kernel_window
from ..mask.info import MaskInfo, TileKey
from ..runtime.recent import RecentlyUsed
from .config import KernelConfig
from .plan import plan_attention

LaunchArgs = tuple[tuple, tuple]  # (mask tensors, mask scalars) of one tile
# Per mask: the distinct calls (shapes, strides, dtype, scale, dropout, determinism, tiles) whose launches are kept.
# A launch holds host objects only (the lists are the mask's): room for dynamic batching's batch sizes costs little.
MAX_CALLS = 64


class KernelArgs:
    """The kernels' view of one mask: its arguments per tile, kept (a small call is bound by host work), and the
    launches of its calls (:mod:`mmsparse.attention.call` owns them).

    The mask holds this object (``info.kernel_args``) and this object holds the mask only weakly: a strong
    reference back would make a cycle, which reference counting never frees. Every mask that had run a kernel
    (every cached one evicted, every one built from a length tensor) would then keep its token bits and block
    lists on the device until the cyclic garbage collector's next full collection, which in a training loop comes
    every few hundred or thousand steps (the soak's saw-tooth in allocated memory)."""

    __slots__ = ("_info", "calls", "_tiles")

    def __init__(self, info: MaskInfo) -> None:
        self._info = weakref.ref(info)
        self.calls: RecentlyUsed = RecentlyUsed(MAX_CALLS)
        self._tiles: dict[TileKey, LaunchArgs] = {}

    @property
    def info(self) -> MaskInfo:
        """The mask (alive while anyone reaches this object through it)."""
        info = self._info()
        if info is None:
            raise ReferenceError("the mask of these kernel arguments is gone")
        return info

    def tile(self, block_m: int, block_n: int, by_key: bool = False) -> LaunchArgs:
        """The mask arguments at one tile, in the order of the module docstring, over block lists built before
        (``MaskInfo.prepare``): this builds nothing. Unused tensors are stand-ins that are never read; a batch
        stride of 0 shares one mask (or list) across the batch."""
        key = (block_m, block_n, by_key)
        args = self._tiles.get(key)
        if args is not None:
            return args
        info = self.info
        lists = info.built_lists(block_m, block_n, by_key)
        args = self._tiles[key] = mask_launch_args(info.kernel_tensors(), info.mode, lists.counts, lists.indices,
                                                   info.window)
        return args


def mask_launch_args(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], mode: int, counts: torch.Tensor,
                     indices: torch.Tensor, window: int | None) -> LaunchArgs:
    """The mask arguments of one tile, in the order of the module docstring, from a mask's kernel tensors
    (``MaskInfo.kernel_tensors``: three tensors and the first-query positions) and that tile's lists. A batch
    stride of 0 shares one mask (or list) across the batch; tensors a mode does not read are stand-ins."""
    first, second, third, q_start = tensors
    shared = first.shape[0] == 1
    if mode == MASK_DENSE:
        dense = third.view(torch.uint8)
        mask, mask_strides = (dense, dense, dense), (0, 0, 0 if shared else dense.stride(0), dense.stride(1))
        seq_q, seq_k = dense.shape[1], dense.shape[2]
    else:
        # k bits (or codes): batch stride 0 too when shared (expanded); the pair table's row stride (codes)
        mask = (first, second, third)
        mask_strides = (0 if shared else first.stride(0), 0 if shared else second.stride(0), 0,
                        third.stride(0) if mode == MASK_SEGMENTS else 0)
        seq_q, seq_k = first.shape[1], second.shape[1]
    list_strides = (0 if shared else counts.stride(0), 0 if shared else indices.stride(0))
    q_start_stride = 0 if q_start.shape[0] == 1 else q_start.stride(0)
    return ((*mask, counts, indices),
            (*mask_strides, *list_strides, seq_q, seq_k, q_start, q_start_stride, kernel_window(window)))


def traced_mask_args(tensors: list[torch.Tensor], mode: int, lists: list[torch.Tensor], window: int | None,
                     tiles: int) -> list[LaunchArgs]:
    """The mask arguments of ``tiles`` tiles from a custom op's mask tensors and its ``lists`` argument (each
    tile's counts and indices in turn)."""
    return [mask_launch_args(tensors, mode, lists[2 * i], lists[2 * i + 1], window) for i in range(tiles)]


def kernel_args(info: MaskInfo) -> KernelArgs:
    """The kernel arguments of ``info``, made on first use and kept on it."""
    args = info.kernel_args
    if args is None:
        args = info.kernel_args = KernelArgs(info)
    return args  # type: ignore[return-value]


_CPU = torch.device("cpu")  # plans' lists do not depend on the device; its SM count only splits the forward's grid


def list_tiles(config: KernelConfig, seq_q: int, seq_k: int, sample_len: int | None = None,
               deterministic: bool = True, dropout: bool = False,
               device: torch.device = _CPU, longest_first: bool = False) -> list[TileKey]:
    """The (block_m, block_n, by_key) lists the kernels of a config read for seq_q queries over seq_k keys (in
    packs of samples of ``sample_len`` tokens on average, if given), with or without dropout, over a mask whose
    programs the ordered dQ writer launches ``longest_first`` or not: those of the call's plan
    (:func:`mmsparse.attention.plan.plan_attention`), whose lists do not depend on the batch or the heads."""
    plan = plan_attention(config, 1, 1, 1, seq_q, seq_k, device, sample_len, dropout, deterministic=deterministic,
                          longest_first=longest_first)
    return plan.list_tiles()


def prepare(info: MaskInfo, config: KernelConfig, deterministic: bool = True, dropout: bool = False) -> MaskInfo:
    """Build the block lists of every kernel of ``config`` now (forward, dK/dV, dQ; where the backward runs in one
    pass the one-pass backward's instead of the last two), e.g. before timing or CUDA-graph capture."""
    tiles = list_tiles(config, info.seq_q, info.seq_k, info.sample_len, deterministic, dropout, info.device,
                       mask_adds_longest_first(info))
    return info.prepare(tiles, config.compact_bytes)
