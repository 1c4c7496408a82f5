"""The order in which the key blocks of a by-key pass add into each query block's dQ, fixed so that the adds are
bitwise repeatable, and chosen so that the programs rarely wait for it.

Each entry of a key block's list gets its rank among the entries of all the sample's key blocks that hold the same
query block; the kernel adds that query block's dQ once its counter reads the rank, and counts one more
(``kernels.gluon.bwd_dq_writer``). The entries of one query block rank by the step at which their program reaches
them (the entry's place in its list), then by launch position: programs that step through their lists side by side
find each query block's earlier adds done. A program waits only for entries of earlier steps, or of its own step
and earlier programs, so the waits form no cycle.

The launch order depends on the mask (:func:`adds_shortest_first`). Where lists start at their own key block's
queries (a causal mask, causal pairs), the programs of each (batch, KV head) launch shortest list first
(the lists' order, ``mask.list_order``, backwards): the key block that reaches a query block first is then the one
that also starts first (FlashAttention-3's deterministic causal order). Longest first, the causal hub mask ran 0.70x
the two passes' speed instead of 1.03x. Elsewhere no list starts at its own queries, and the ordered kernel launches
longest list first, as the unordered one does: five such masks ran 0.92-1.03x the two passes' speed against
0.89-0.99x shortest first (``benchmarks/results/h200/ordered_dq_writer.md``).

A program must never wait for one that cannot start. The programs of one (batch, KV head) start in launch order,
and in groups of ``resident`` (the programs the call's stream may run at once: the GPU's multiprocessors, or fewer
under an MPS limit or on a green context's stream, ``runtime.multiprocessors``) the ranks go group by group: a
program waits only for programs of its own group or of earlier ones. Every earlier group has started (the hardware
starts programs in launch order), and once the programs before its group have finished, its whole group is
resident. Ranked for more than run at once, a program could wait for one that starts only once it has ended.
Where the programs take each key block for a section of k (batch, KV head)s in turn
(``KernelConfig.ordered_head_section``, launched longest first), a group holds the GPU's programs divided by k
rows: the section's heads' groups of the same rows are then consecutive programs, as many as the GPU holds, and
the argument stands. A kernel of higher stream priority (or of another process under MPS) may take
multiprocessors the group needs; the group then waits until that kernel ends
(``tests/kernels/test_hopper_ordered_writer.py`` runs matmuls beside it). Only a kernel that held them until this
one ended would stall it for good.

Built from the lists alone, on their device, with no read-back: one sort of the lists' entries.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..kernels.constants import MASK_BITS
from ..runtime.launch import stream_key
from ..runtime.streams import build_stream, on_build_stream
from .blocks import BlockLists
from .info import MaskInfo


def adds_shortest_first(mode: int, causal: bool) -> bool:
    """Whether the ordered dQ writer launches a mask's programs shortest list first: unless the mask is a bit mask
    without the causal flag (``mode`` a ``kernels.constants`` mask mode), where no key block's list starts at its own
    queries (a window only ends lists earlier). Segment codes mean causal pairs; a dense mask may hold anything."""
    return causal or mode != MASK_BITS


def mask_adds_longest_first(info: MaskInfo) -> bool:
    """Whether the ordered dQ writer launches ``info``'s programs longest list first (:func:`adds_shortest_first`):
    what a call's plan is told of its mask (``plan_attention``'s ``longest_first``)."""
    return not adds_shortest_first(info.mode, info.causal)


def dq_add_ranks(lists: BlockLists, query_blocks: int, resident: int, shortest_first: bool = True) -> torch.Tensor:
    """int32 ``[Bm, L]``, the layout of ``lists.indices``: at each entry of a key block's list (a query block id
    below ``query_blocks``), the number of entries of the sample's other key blocks that hold the same query block
    and add before it: in an earlier group of ``resident`` programs in launch order, or in the same group at an
    earlier step, or at the same step by an earlier program. The launch order is the lists' (longest first) taken
    backwards where ``shortest_first``, as the ordered dQ writer launches. Slots past a list's end hold what the
    sort leaves there; no kernel reads them."""
    counts, indices = lists.counts.long(), lists.indices
    samples, rows, slots = counts.shape[0], counts.shape[1], indices.shape[1]
    device = counts.device
    if not (samples and rows and slots):
        return torch.zeros((samples, slots), dtype=torch.int32, device=device)
    if resident < 1:
        raise ValueError(f"resident is the number of programs a GPU runs at once, at least 1; got {resident}")
    start, length, order = counts[..., 2].contiguous(), counts[..., 0] + counts[..., 1], counts[..., 3]
    # position[row]: where the row's program stands in the launch order (order[position] = row)
    places = torch.arange(rows, device=device).expand(samples, rows)
    position = torch.empty_like(order).scatter_(1, order, places)
    if shortest_first:
        position = rows - 1 - position
    slot = torch.arange(slots, device=device).expand(samples, slots).contiguous()
    # the row that owns each slot: starts ascend with the row (fixed slots r * C, or packed end to end)
    owner = (torch.searchsorted(start, slot, right=True) - 1).clamp_(min=0)
    owner_start = start.gather(1, owner)
    live = slot < owner_start + length.gather(1, owner)
    place = position.gather(1, owner)
    groups = -(-rows // resident)
    # (query block, group, step, launch position), one number: a list's steps are below query_blocks
    turn = ((torch.div(place, resident, rounding_mode="floor") * query_blocks + (slot - owner_start)) * rows + place)
    per_block = groups * query_blocks * rows
    key = torch.where(live, indices.long() * per_block + turn, query_blocks * per_block)
    sorted_key, by_key = torch.sort(key, dim=1)
    # each entry's rank: its place in the sorted run of its query block's entries
    run_start = torch.searchsorted(sorted_key, torch.div(sorted_key, per_block, rounding_mode="floor") * per_block)
    ranks = (slot - run_start).to(torch.int32)
    return torch.empty((samples, slots), dtype=torch.int32, device=device).scatter_(1, by_key, ranks)


# The ranks of the lists in use, by the identity of their ids tensor: a mask's lists are written once, before any
# launch reads them, and never again, so their ranks hold while the tensor lives (a finalizer drops the entry).
# Each entry also holds what else the ranks stand for: the counts tensor, the query blocks, the resident programs,
# the launch direction and the stream that built them (a mask's lists are read on the stream that built them; a
# stream that got its own copy of a mask has its own lists).
_RANKS: dict[int, tuple[weakref.ref, weakref.ref, tuple, torch.Tensor]] = {}
_RANKS_LOCK = threading.Lock()


def lists_add_ranks(counts: torch.Tensor, indices: torch.Tensor, query_blocks: int, resident: int,
                    shortest_first: bool = True) -> torch.Tensor:
    """:func:`dq_add_ranks` of the lists ``(counts, indices)`` in that launch direction, built at their first use
    and kept while ``indices`` lives (every layer and step of a mask reuses them), ready to read on the current
    stream. A traced graph's lists are new tensors at each step, and their ranks are built at each step; so are
    those built in a CUDA graph's capture, which its replays write."""
    if torch.compiler.is_compiling() or _is_fake(indices) or _capturing(indices):
        return dq_add_ranks(BlockLists(counts, indices), query_blocks, resident, shortest_first)
    key = id(indices)
    wanted = (query_blocks, resident, shortest_first, stream_key(indices.device))
    kept = _RANKS.get(key)
    if kept is not None and kept[0]() is indices and kept[1]() is counts and kept[2] == wanted:
        return kept[3]
    ranks = _built_apart(BlockLists(counts, indices), query_blocks, resident, shortest_first)
    with _RANKS_LOCK:
        if key not in _RANKS:
            weakref.finalize(indices, _RANKS.pop, key, None)
        _RANKS[key] = (weakref.ref(indices), weakref.ref(counts), wanted, ranks)
    return ranks


def _built_apart(lists: BlockLists, query_blocks: int, resident: int, shortest_first: bool) -> torch.Tensor:
    """:func:`dq_add_ranks` for keeping, on a GPU built on mmsparse's own thread and build stream after the current
    stream's work so far, and readable on the current stream: under ``torch.compile(mode="reduce-overhead")`` the
    warm-up routes every allocation of the calling thread to a CUDA graph's private pool, which must hold nothing
    that outlives the call (:mod:`mmsparse.runtime.own_thread`)."""
    device = lists.indices.device
    if device.type != "cuda":
        return dq_add_ranks(lists, query_blocks, resident, shortest_first)
    ranks = on_build_stream(device, lambda: dq_add_ranks(lists, query_blocks, resident, shortest_first))
    current = torch.cuda.current_stream(device)
    current.wait_stream(build_stream(device))
    ranks.record_stream(current)
    return ranks


def _capturing(tensor: torch.Tensor) -> bool:
    """A CUDA graph is being captured: the ranks are written only when it replays, so none are kept for eager
    calls."""
    return tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _is_fake(tensor: torch.Tensor) -> bool:
    """A FakeTensor (a graph being traced): nothing of it is kept."""
    return type(tensor).__name__ == "FakeTensor"
