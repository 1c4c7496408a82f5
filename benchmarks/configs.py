"""Benchmark shapes, by name, and the live-pair count behind the TFLOP/s numbers.

Every config is a multimodal sequence (text, vision, audio) under a 3 x 3 topology. Results, the A/B tool and
docs/performance.md refer to them by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

CYCLIC = ((0, 1, 0), (0, 0, 1), (1, 0, 0))  # text -> vision -> audio -> text
HUB = ((1, 1, 1), (1, 1, 0), (1, 0, 1))  # text sees everything; vision and audio see text and themselves

TOPOLOGY_NAMES = {CYCLIC: "cyclic", HUB: "hub"}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark shape.

    Args:
        name: the row label in every output.
        batch: B.
        heads_q: query heads Hq.
        heads_kv: key/value heads Hkv (Hq a multiple of it; fewer than Hq is GQA).
        head_dim: D.
        seg_lens: k segment lengths; S = sum(seg_lens) key positions.
        topology: k x k 0/1 tuple of tuples; ``topology[r][c] == 1`` lets segment r attend segment c.
        causal: also require key position <= query position.
        seq_q: query positions (the last seq_q of the S); None means S (prefill). Decode rows set it.
    """

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seg_lens: tuple[int, ...]
    topology: tuple[tuple[int, ...], ...]
    causal: bool = False
    seq_q: int | None = None
    tags: tuple[str, ...] = field(default=())

    @property
    def seq_k(self) -> int:
        return sum(self.seg_lens)

    @property
    def q_len(self) -> int:
        return self.seq_k if self.seq_q is None else self.seq_q

    @property
    def mode(self) -> str:
        """"prefill" (queries = all positions) or "decode" (a few last positions)."""
        return "prefill" if self.q_len == self.seq_k else "decode"

    @property
    def topology_name(self) -> str:
        return TOPOLOGY_NAMES.get(self.topology, "custom")

    @property
    def live_pairs(self) -> int:
        """Allowed (query, key) pairs of one head, from the lengths alone (no S x S tensor)."""
        return live_pairs(self.topology, self.seg_lens, self.q_len, self.causal)

    @property
    def density(self) -> float:
        """Live pairs over all Sq x Sk pairs."""
        return self.live_pairs / (self.q_len * self.seq_k)

    def describe(self) -> str:
        gqa = f" Hkv={self.heads_kv}" if self.heads_kv != self.heads_q else ""
        causal = " causal" if self.causal else ""
        return (
            f"B={self.batch} Hq={self.heads_q}{gqa} D={self.head_dim} seg={self.seg_lens} {self.topology_name}"
            f"{causal} S={self.seq_k} density={self.density:.3f}"
        )


def _clamped_prefix(n: int, cap: int) -> int:
    """sum of min(max(x, 0), cap) over the integers x < n."""
    if n <= 0:
        return 0
    if n <= cap + 1:
        return n * (n - 1) // 2
    return cap * (cap + 1) // 2 + (n - cap - 1) * cap


def live_pairs(topology: Sequence[Sequence[int]], seg_lens: Sequence[int], seq_q: int | None = None,
               causal: bool = False) -> int:
    """Number of allowed (query, key) pairs for one head, exactly, in O(k^2).

    Queries are the last ``seq_q`` of the S = sum(seg_lens) positions (past_len = S - seq_q). A query at absolute
    position i in segment r may see a key j in segment c when ``topology[r][c]`` and, if causal, ``j <= i``.

    Args:
        topology: k x k 0/1.
        seg_lens: k lengths.
        seq_q: query positions; None means S.
        causal: add the causal condition.

    Returns:
        The count, a Python int.
    """
    seq_k = sum(seg_lens)
    seq_q = seq_k if seq_q is None else seq_q
    past = seq_k - seq_q
    starts = [sum(seg_lens[:i]) for i in range(len(seg_lens))]
    total = 0
    for r, (r0, rl) in enumerate(zip(starts, seg_lens)):
        a0, a1 = max(r0, past), r0 + rl  # absolute query positions [a0, a1) of segment r
        if a1 <= a0:
            continue
        for c, (c0, cl) in enumerate(zip(starts, seg_lens)):
            if not topology[r][c] or cl == 0:
                continue
            if not causal:
                total += (a1 - a0) * cl
            else:  # query i sees min(max(i + 1 - c0, 0), cl) keys of segment c
                total += _clamped_prefix(a1 + 1 - c0, cl) - _clamped_prefix(a0 + 1 - c0, cl)
    return total


def _mm13k(name: str, topology: tuple[tuple[int, ...], ...], causal: bool = False, heads_q: int = 16,
           heads_kv: int = 16, head_dim: int = 128) -> BenchConfig:
    return BenchConfig(name, 1, heads_q, heads_kv, head_dim, (1024, 8192, 4096), topology, causal)


CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig("seed", 8, 16, 16, 64, (50, 375, 500), CYCLIC),
        _mm13k("mm13k_cyclic", CYCLIC),
        _mm13k("mm13k_hub", HUB),
        _mm13k("mm13k_hub_causal", HUB, causal=True),
        BenchConfig("mm43k_cyclic", 1, 8, 8, 128, (2048, 32768, 8192), CYCLIC),
        _mm13k("mm13k_hub_d64", HUB, head_dim=64),
        _mm13k("mm13k_hub_gqa", HUB, heads_q=32, heads_kv=8),
    )
}

QUICK = ("seed", "mm13k_cyclic", "mm13k_hub")

# Decode rows: a few new text queries (the last segment) against a long multimodal cache of (vision, audio,
# text). Text sees vision and text but not audio; vision and audio see themselves. Not causal, so that every
# implementation computes the same mask for q_len > 1; with q_len = 1 causal changes nothing.
DECODE_TOPOLOGY = ((1, 0, 0), (0, 1, 0), (1, 0, 1))
DECODE_CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(f"decode_q{q}_kv{kv // 1024}k", 8, 32, 8, 128, (kv * 3 // 4, kv // 4 - 512, 512), DECODE_TOPOLOGY,
                    seq_q=q, tags=("decode",))
        for q in (1, 16)
        for kv in (8192, 32768)
    )
}

# Smoke-test shapes for ``--tiny`` (CPU, Triton interpreter): ragged lengths, D 16/32, GQA, causal.
TINY: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig("tiny_cyclic", 2, 2, 2, 16, (10, 45, 41), CYCLIC),
        BenchConfig("tiny_hub_causal_gqa", 1, 4, 2, 32, (13, 50, 37), HUB, causal=True),
        BenchConfig("tiny_decode", 2, 4, 2, 32, (40, 30, 11), DECODE_TOPOLOGY, seq_q=4, tags=("decode",)),
        # the A/B tool's CPU smoke test: a fraction of a second per call through the interpreter
        BenchConfig("tiny_ab", 1, 2, 1, 16, (7, 20, 13), HUB, causal=True),
    )
}

ALL_CONFIGS: dict[str, BenchConfig] = {**CONFIGS, **DECODE_CONFIGS, **TINY}
