"""How a multimodal sequence is split over the ranks of a context-parallel group, worked out on the host.

The sequence is cut into chunks at tile granularity. The live (query, key) pairs between every pair of chunks
follow from the topology and the segment intervals alone (a k x k product per chunk pair, no S x S mask), so the
plan can:
- give each rank chunks whose queries carry about the same number of live pairs (longest processing time first,
  with at most ceil(chunks / ranks) chunks a rank, so that tokens, hence activations, stay balanced too);
- list, for each rank, the K/V chunks its queries see, and fetch only those, where a ring or an all-gather moves
  every chunk to every rank. Under a sliding window a rank holds one run of chunks when that balances as well,
  so that it fetches only the chunks next to its run.
With per-sample lengths one layout serves the whole batch: the pair counts are summed over the samples.

Balance comes first: the assignment meets max/mean <= 1.05 on the multimodal configs, and a rank then holds
chunks of every segment, so its queries see most key chunks. For hub topologies and causal masks that is what
they need anyway; for a cyclic topology a volume-aware assignment (ranks holding chunks of one segment fetch only
the segments it sees) would move about half the bytes at some cost in balance. ``summary()`` reports both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..mask.topology import CAUSAL, Topology, validate_seg_lens


def interval_pairs(
    q0: torch.Tensor, q1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, causal: bool, window: int | None = None
) -> torch.Tensor:
    """Pairs (i, j) with q0 <= i < q1 and k0 <= j < k1 (and j <= i when causal, j > i - window with a window),
    elementwise over int64 tensors of interval bounds (empty intervals count 0)."""
    nq, nk = (q1 - q0).clamp(min=0), (k1 - k0).clamp(min=0)
    pairs = _keys_up_to(q0, q1, k0, k1, 0) if causal else nq * nk
    if window is not None:  # less the pairs whose key is at or before the query minus the window
        pairs = pairs - _keys_up_to(q0, q1, k0, k1, -window)
    return pairs


def _keys_up_to(q0: torch.Tensor, q1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, shift: int) -> torch.Tensor:
    """Pairs (i, j) of ``[q0, q1) x [k0, k1)`` with j <= i + shift, elementwise."""
    nq, nk = (q1 - q0).clamp(min=0), (k1 - k0).clamp(min=0)
    q0, q1 = q0 + shift, q1 + shift
    # Sum over i of clamp(i + 1 - k0, 0, nk): zero for i < k0, a ramp up to nk at i = k1 - 1, then nk.
    lo, hi = torch.maximum(q0, k0), torch.minimum(q1, k1)  # queries on the ramp: [lo, hi)
    ramp_n = (hi - lo).clamp(min=0)
    first = lo + 1 - k0  # the ramp's value at i = lo
    ramp = ramp_n * first + ramp_n * (ramp_n - 1) // 2
    flat = (q1 - torch.maximum(q0, k1)).clamp(min=0) * nk  # queries at or past k1 see every key
    return torch.where((nq > 0) & (nk > 0), ramp + flat, torch.zeros_like(nq))


def chunk_pairs(topology: Any, seg_lens: Sequence[int] | Sequence[Sequence[int]], chunk: int, seq_len: int,
                causal: bool = False, window: int | None = None) -> torch.Tensor:
    """Live pairs between query chunk a and key chunk b, int64 ``[n, n]`` with n = ceil(seq_len / chunk), summed
    over the samples when ``seg_lens`` is ``[B, k]``. Tokens past a sample's total are padding: they attend
    nothing and nobody attends them. With a window only pairs with key > query - window count (and CAUSAL pairs
    count as such); without one, CAUSAL pairs of a call that is not causal count as FULL (an upper bound)."""
    topo = Topology(topology)
    k = topo.num_segments
    rows = _rows(seg_lens, k)
    n = math.ceil(seq_len / chunk)
    c0 = torch.arange(n, dtype=torch.int64) * chunk
    c1 = torch.clamp(c0 + chunk, max=seq_len)
    table = topo.matrix.to(torch.int64)
    ordered = (topo.types == CAUSAL) | causal
    total = torch.zeros(n, n, dtype=torch.int64)
    for lens in rows:
        ends = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
        if int(ends[-1]) > seq_len:
            raise ValueError(f"seg_lens {lens} sum to {int(ends[-1])}, more than the sequence length {seq_len}")
        starts = ends - torch.tensor(lens, dtype=torch.int64)
        # [n, k]: each chunk's overlap with each segment, as an interval
        s0, s1 = torch.maximum(c0[:, None], starts[None, :]), torch.minimum(c1[:, None], ends[None, :])
        if not causal and window is None:
            overlap = (s1 - s0).clamp(min=0)
            total += overlap @ table @ overlap.T
            continue
        # [n, k, n, k] bounds would be n^2 k^2: walk segment pairs instead (k^2 products of [n, n])
        for r in range(k):
            for c in range(k):
                if table[r, c]:
                    total += interval_pairs(s0[:, r, None], s1[:, r, None], s0[None, :, c], s1[None, :, c],
                                            bool(ordered[r, c]), window)
    return total


@dataclass(frozen=True)
class ContextParallelPlan:
    """Which chunks each rank owns and which K/V chunks it needs. Build it with :func:`plan_context_parallel`.

    Attributes:
        world_size, chunk, seq_len: the group size, tokens per chunk, the sequence length.
        owner: rank of each chunk.
        local_chunks: per rank, its chunks in sequence order (its queries and its share of K/V).
        needed_kv: per rank, every chunk whose K/V its queries see (its own included), in sequence order.
        live_pairs: per rank, the live (query, key) pairs of its queries.
        pairs: the chunk-by-chunk live pairs the plan was made from, int64 ``[n, n]``.
        window: the sliding window the pairs were counted under (None: none).
    """

    world_size: int
    chunk: int
    seq_len: int
    owner: tuple[int, ...]
    local_chunks: tuple[tuple[int, ...], ...]
    needed_kv: tuple[tuple[int, ...], ...]
    live_pairs: tuple[int, ...]
    pairs: torch.Tensor
    window: int | None = None

    def chunk_tokens(self, c: int) -> int:
        return min(self.chunk, self.seq_len - c * self.chunk)

    def tokens_of(self, chunks: Sequence[int]) -> int:
        """The tokens of ``chunks``, laid end to end."""
        return sum(self.chunk_tokens(c) for c in chunks)

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 positions of the tokens that ``rank`` holds, in the order it holds them."""
        spans = [torch.arange(c * self.chunk, c * self.chunk + self.chunk_tokens(c)) for c in self.local_chunks[rank]]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.int64)

    def imbalance(self) -> float:
        """max / mean of the live pairs per rank (1.0 is perfect balance)."""
        mean = sum(self.live_pairs) / self.world_size
        return max(self.live_pairs) / mean if mean else 1.0

    def summary(self, kv_bytes_per_token: int = 1) -> dict[str, Any]:
        """Live pairs per rank and their imbalance; tokens of K/V each rank receives and sends under this plan,
        and what a ring or an all-gather of K/V would move, in bytes (``kv_bytes_per_token``: K and V of one
        token over all kv heads, e.g. ``2 * Hkv * D * 2`` in bf16; 1 reports tokens)."""
        recv = [sum(self.chunk_tokens(c) for c in need if self.owner[c] != r) for r, need in enumerate(self.needed_kv)]
        sent = [0] * self.world_size
        for r, need in enumerate(self.needed_kv):
            for c in need:
                if self.owner[c] != r:
                    sent[self.owner[c]] += self.chunk_tokens(c)
        held = [self.tokens_of(chunks) for chunks in self.local_chunks]
        all_gather = [self.seq_len - h for h in held]  # a ring moves the same tokens, in world_size - 1 steps
        return {
            "world_size": self.world_size,
            "chunk": self.chunk,
            "live_pairs": list(self.live_pairs),
            "imbalance": self.imbalance(),
            "tokens": held,
            "recv_bytes": [t * kv_bytes_per_token for t in recv],
            "sent_bytes": [t * kv_bytes_per_token for t in sent],
            "all_gather_bytes": [t * kv_bytes_per_token for t in all_gather],
        }


def plan_context_parallel(
    topology: Any, seg_lens: Sequence[int] | Sequence[Sequence[int]], world_size: int, causal: bool = False,
    seq_len: int | None = None, chunk: int | None = None, tile: int = 128, window: int | None = None,
) -> ContextParallelPlan:
    """Split a sequence over ``world_size`` ranks, balancing live pairs (see the module's docstring).

    Args:
        topology: k x k; seg_lens: k lengths, or ``[B, k]`` per sample (the layout serves the whole batch).
        causal: the global causal flag, as in ``mbs_attention``.
        seq_len: the sequence length S (default: the largest sample's total).
        chunk: tokens per chunk, a multiple of ``tile`` (default: about 16 chunks a rank, at least one tile).
        window: a sliding window (key > query - window): chunks wholly outside it carry no pairs, so no rank
            fetches them for those queries.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    rows = _rows(seg_lens, Topology(topology).num_segments)
    seq_len = max(sum(r) for r in rows) if seq_len is None else seq_len
    if chunk is None:
        chunk = tile * max(1, seq_len // (tile * world_size * 16))
    if chunk <= 0 or chunk % tile:
        raise ValueError(f"chunk must be a positive multiple of the tile ({tile}); got {chunk}")
    pairs = chunk_pairs(topology, rows, chunk, seq_len, causal, window)
    n = pairs.shape[0]
    work = pairs.sum(1).tolist()
    owner = _longest_first(work, world_size)
    if window is not None:
        # A window's queries see only nearby keys: a rank holding one run of chunks fetches only the chunks
        # next to its run, where interleaved chunks would make it fetch almost every chunk. Taken when it
        # balances about as well.
        runs = [c * world_size // n for c in range(n)]
        if _imbalance(work, runs, world_size) <= max(BALANCE, _imbalance(work, owner, world_size)):
            owner = runs
    load = [0] * world_size
    for c, r in enumerate(owner):
        load[r] += work[c]
    local = tuple(tuple(c for c in range(n) if owner[c] == r) for r in range(world_size))
    sees = pairs > 0
    needed = tuple(tuple(torch.nonzero(sees[list(chunks)].any(0)).flatten().tolist()) if chunks else ()
                   for chunks in local)
    return ContextParallelPlan(world_size, chunk, seq_len, tuple(owner), local, needed, tuple(load), pairs, window)


BALANCE = 1.05  # max / mean live pairs a plan aims for


def _longest_first(work: list[int], world_size: int) -> list[int]:
    """Each chunk's rank: longest processing time first, at most ceil(n / world_size) chunks a rank."""
    n = len(work)
    cap = math.ceil(n / world_size)
    load, count = [0] * world_size, [0] * world_size
    owner = [0] * n
    for c in sorted(range(n), key=lambda c: (-work[c], c)):  # longest first; ties by position: deterministic
        r = min((r for r in range(world_size) if count[r] < cap), key=lambda r: (load[r], count[r], r))
        owner[c] = r
        load[r] += work[c]
        count[r] += 1
    return owner


def _imbalance(work: list[int], owner: list[int], world_size: int) -> float:
    """max / mean of the ranks' live pairs under ``owner``."""
    load = [0] * world_size
    for c, r in enumerate(owner):
        load[r] += work[c]
    mean = sum(load) / world_size
    return max(load) / mean if mean else 1.0


def _rows(seg_lens: Any, k: int) -> list[tuple[int, ...]]:
    if isinstance(seg_lens, torch.Tensor):
        seg_lens = seg_lens.tolist()
    seg_lens = list(seg_lens)
    if seg_lens and isinstance(seg_lens[0], (list, tuple)):
        return [validate_seg_lens(r, k, f"seg_lens[{b}]") for b, r in enumerate(seg_lens)]
    return [validate_seg_lens(seg_lens, k)]
