"""Benchmark shapes, by name, and the live-pair count behind the TFLOP/s numbers.

Most configs are one multimodal sequence (text, vision, audio) under a 3 x 3 topology. The mask rows
(:data:`MASK_CONFIGS`) add packs of many samples (``packed``: ``[N, k]`` lengths), topologies of many segments
with pair types 0/1/2 (none, full, causal) and a sliding window (``window``). Results, the A/B tool and
docs/performance.md refer to configs by name.

No torch here: the A/B tool's parent process imports this module.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

NONE, FULL, CAUSAL = 0, 1, 2  # pair types, as mmsparse.NONE / FULL / CAUSAL: no key, every key, keys <= the query

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
        seg_lens: k segment lengths; S = sum(seg_lens) key positions. With ``packed``: N rows of k lengths
            (``[N, k]``, as ``mmsparse.mbs_attention_varlen`` takes them), the samples laid end to end; S is the
            sum of them all.
        topology: k x k tuple of tuples of pair types: ``topology[r][c]`` is NONE (0), FULL (1: segment r sees
            every key of segment c) or CAUSAL (2: the keys of c at or before the query's position).
        causal: also require key position <= query position (per sample in a pack).
        seq_q: query positions (the last seq_q of the S); None means S (prefill). Decode rows set it.
        packed: ``seg_lens`` is ``[N, k]``: N samples packed in one sequence (batch 1), each seeing only itself.
        window: a sliding window on top of the rest: a key is kept only when its position is greater than the
            query's minus ``window`` (``mmsparse.mbs_attention(..., window=)``); None: no window.
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
    packed: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        k = len(self.topology)
        if any(len(row) != k for row in self.topology) or any(t not in (NONE, FULL, CAUSAL)
                                                               for row in self.topology for t in row):
            raise ValueError(f"{self.name}: the topology must be k x k of 0/1/2")
        rows = self.seg_lens if self.packed else (self.seg_lens,)
        if any(len(row) != k for row in rows):
            raise ValueError(f"{self.name}: every row of seg_lens needs {k} lengths")
        if self.packed and (self.batch != 1 or self.seq_q is not None):
            raise ValueError(f"{self.name}: a pack is one sequence (batch 1) of prefill queries (seq_q None)")
        validate_window(self.window, self.name)

    @property
    def rows(self) -> tuple[tuple[int, ...], ...]:
        """The samples' k lengths: N rows for a pack, else the one shared row."""
        return self.seg_lens if self.packed else (self.seg_lens,)  # type: ignore[return-value]

    @property
    def num_segments(self) -> int:
        return len(self.topology)

    @property
    def has_causal_pairs(self) -> bool:
        return any(t == CAUSAL for row in self.topology for t in row)

    @property
    def dense_causal(self) -> bool:
        """Whether the dense speed reference (dense_flash) runs causal: on causal configs and on topologies with
        CAUSAL pairs (whose mask is mostly the causal half)."""
        return self.causal or self.has_causal_pairs

    @property
    def seq_k(self) -> int:
        return sum(sum(row) for row in self.rows)

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

    @cached_property
    def live_pairs(self) -> int:
        """Allowed (query, key) pairs of one head, from the lengths alone (no S x S tensor)."""
        return live_pairs(self.topology, self.seg_lens, self.q_len, self.causal, packed=self.packed,
                          window=self.window)

    @property
    def density(self) -> float:
        """Live pairs over all Sq x Sk pairs."""
        return self.live_pairs / (self.q_len * self.seq_k)

    @property
    def layout(self) -> str:
        """The lengths in a few words: the k lengths, or a summary of a pack or of many segments."""
        if self.packed:
            return f"{len(self.rows)} samples x {self.num_segments} segments (packed)"
        if self.num_segments > 8:
            return f"{self.num_segments} segments"
        return str(self.seg_lens)

    def describe(self) -> str:
        gqa = f" Hkv={self.heads_kv}" if self.heads_kv != self.heads_q else ""
        causal = (" causal per sample" if self.packed else " causal") if self.causal else ""
        window = "" if self.window is None else f" window={self.window}"
        return (
            f"B={self.batch} Hq={self.heads_q}{gqa} D={self.head_dim} seg={self.layout} {self.topology_name}"
            f"{causal}{window} S={self.seq_k} density={self.density:.4f}"
        )


def validate_window(window: object, name: str = "window") -> None:
    """Raise unless ``window`` is None or a positive int (a bool is not one)."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"{name}: window must be a positive int (keys within that many positions up to the query) "
                        f"or None, not {type(window).__name__} {window!r}")
    if window < 1:
        raise ValueError(f"{name}: window must be at least 1 (a key is kept when its position is greater than the "
                         f"query's minus the window), not {window}")


def _clamped_prefix(n: int, cap: int) -> int:
    """sum of min(max(x, 0), cap) over the integers x < n."""
    if n <= 0:
        return 0
    if n <= cap + 1:
        return n * (n - 1) // 2
    return cap * (cap + 1) // 2 + (n - cap - 1) * cap


def live_pairs(topology: Sequence[Sequence[int]], seg_lens: Sequence[int] | Sequence[Sequence[int]],
               seq_q: int | None = None, causal: bool = False, packed: bool = False,
               window: int | None = None) -> int:
    """Number of allowed (query, key) pairs for one head, exactly, in O(k^2) (O(N k^2) for a pack).

    Queries are the last ``seq_q`` of the S = sum(seg_lens) positions (past_len = S - seq_q). A query at absolute
    position i in segment r may see a key j in segment c when ``topology[r][c]`` is FULL, or CAUSAL and
    ``j <= i``; if causal, also only when ``j <= i``; with a window, also only when ``j > i - window``. A pack
    counts each sample on its own (a sample sees only itself; its positions are the sample's, and the window
    compares positions within it).

    Args:
        topology: k x k pair types 0/1/2.
        seg_lens: k lengths, or with ``packed`` N rows of k lengths.
        seq_q: query positions; None means S. Packs are prefill (None).
        causal: add the causal condition (per sample in a pack).
        packed: ``seg_lens`` is ``[N, k]``, samples laid end to end.
        window: a sliding window (None: none).

    Returns:
        The count, a Python int.
    """
    validate_window(window)
    if packed:
        if seq_q is not None and seq_q != sum(sum(row) for row in seg_lens):  # type: ignore[arg-type]
            raise ValueError("a pack's queries are all its positions")
        return sum(live_pairs(topology, row, None, causal, window=window) for row in seg_lens)  # type: ignore[arg-type]
    seq_k = sum(seg_lens)  # type: ignore[arg-type]
    seq_q = seq_k if seq_q is None else seq_q
    past = seq_k - seq_q
    starts = [0, *accumulate(seg_lens)][:-1]  # type: ignore[arg-type]
    total = 0
    for r, (r0, rl) in enumerate(zip(starts, seg_lens)):
        a0, a1 = max(r0, past), r0 + rl  # absolute query positions [a0, a1) of segment r
        if a1 <= a0:
            continue
        for c, (c0, cl) in enumerate(zip(starts, seg_lens)):
            kind = topology[r][c]
            if kind == NONE or cl == 0:
                continue
            if kind == FULL and not causal:
                total += (a1 - a0) * cl
            elif kind in (FULL, CAUSAL):  # query i sees min(max(i + 1 - c0, 0), cl) keys of segment c
                total += _clamped_prefix(a1 + 1 - c0, cl) - _clamped_prefix(a0 + 1 - c0, cl)
            else:
                raise ValueError(f"topology[{r}][{c}] = {kind!r}: pair types are 0, 1 and 2")
            if window is not None:  # less the keys at or before i - window: min(max(i - window + 1 - c0, 0), cl)
                total -= _clamped_prefix(a1 - window + 1 - c0, cl) - _clamped_prefix(a0 - window + 1 - c0, cl)
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

# Mask rows: the shapes of multimodal training that are not three segments. B = 1, Hq = 16, Hkv = 4, D = 128, but
# for the sliding-window row (a Gemma-3-like sequence: B = 2, Hkv = 8).


def pack_lengths(samples: int, ranges: Sequence[tuple[int, int]], seed: int = 0,
                 total: int | None = None) -> tuple[tuple[int, ...], ...]:
    """``[samples, k]`` lengths, each drawn uniformly from its segment's ``(low, high)`` by ``random.Random(seed)``.

    With ``total``, the drawn lengths are then scaled so that the pack holds exactly ``total`` tokens (each scaled
    down, the largest remainders rounded up): the ranges keep their proportions, zeros stay zero.
    """
    rng = random.Random(seed)
    flat = [rng.randint(low, high) for _ in range(samples) for low, high in ranges]
    if total is not None:
        flat = scale_to_total(flat, total)
    k = len(ranges)
    return tuple(tuple(flat[n * k : (n + 1) * k]) for n in range(samples))


def scale_to_total(lengths: Sequence[int], total: int) -> list[int]:
    """``lengths`` scaled so that they sum to exactly ``total``: each scaled down, the largest remainders rounded
    up (ties to the earlier one). Proportions are kept and zeros stay zero."""
    drawn = sum(lengths)
    if drawn <= 0 or total < 0:
        raise ValueError(f"cannot scale lengths summing to {drawn} to a total of {total}")
    scaled = [x * total // drawn for x in lengths]
    by_remainder = sorted(range(len(lengths)), key=lambda i: (-(lengths[i] * total % drawn), i))
    for i in by_remainder[: total - sum(scaled)]:
        scaled[i] += 1
    return scaled


def transfusion_layout(images: int, image_len: int, text_lens: tuple[int, int], seed: int = 0,
                       total: int | None = None) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Interleaved text and images (Transfusion, Gemma 3): text, image, text, ..., image, text, 2 * images + 1
    segments, the text lengths drawn from ``text_lens`` by ``random.Random(seed)``. Text is causal over everything
    before it (FULL for earlier segments, CAUSAL within itself); an image sees all of itself and everything before
    it. With ``total``, the text lengths are then scaled (:func:`scale_to_total`) so that the sequence holds
    exactly ``total`` tokens.

    Returns:
        ``(seg_lens, topology)``.
    """
    rng = random.Random(seed)
    texts = [rng.randint(*text_lens) for _ in range(images + 1)]
    if total is not None:
        texts = scale_to_total(texts, total - images * image_len)
    lens: list[int] = []
    for text in texts[:-1]:
        lens += [text, image_len]
    lens.append(texts[-1])
    k = len(lens)
    topology = tuple(
        tuple(FULL if c < r or (c == r and r % 2) else CAUSAL if c == r else NONE for c in range(k)) for r in range(k)
    )
    TOPOLOGY_NAMES[topology] = "transfusion"
    return tuple(lens), topology


def video_layout(text_len: int, frames: int, frame_len: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """A text prompt, then video frames: 1 + frames segments. The text is causal within itself; each frame sees all
    of itself, the text and every earlier frame.

    Returns:
        ``(seg_lens, topology)``.
    """
    k = frames + 1
    topology = ((CAUSAL,) + (NONE,) * frames,) + tuple(
        tuple(FULL if c <= r else NONE for c in range(k)) for r in range(1, k)
    )
    TOPOLOGY_NAMES[topology] = "video"
    return (text_len,) + (frame_len,) * frames, topology


PACK_RANGES = ((16, 64), (64, 256), (0, 64))  # text, vision, audio tokens of one sample, before scaling
_TRANSFUSION_16K = transfusion_layout(40, 256, (20, 200))
_VIDEO_64K = video_layout(2048, 256, 240)
# 32 images of 256 tokens among 33 texts drawn from 256-1280 tokens, scaled to 32768 tokens in all (x ~0.93)
_VLM_32K = transfusion_layout(32, 256, (256, 1280), seed=0, total=32768)
MASK_CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        # 512 samples of (text, vision, audio) drawn from PACK_RANGES, scaled to 65536 tokens in all (x ~0.55: the
        # unscaled ranges average 232 tokens, ~119k for 512 samples); hub topology, causal per sample
        BenchConfig("pack_64k_x512", 1, 16, 4, 128, pack_lengths(512, PACK_RANGES, seed=0, total=65536), HUB,
                    causal=True, packed=True, tags=("masks",)),
        # 40 images of 256 tokens between 41 texts of 20-200 tokens: 81 segments
        BenchConfig("transfusion_16k", 1, 16, 4, 128, *_TRANSFUSION_16K, tags=("masks",)),
        # 2048 text tokens, then 256 frames of 240 tokens: 257 segments
        BenchConfig("video_64k", 1, 16, 4, 128, *_VIDEO_64K, tags=("masks",)),
        # the transfusion mask (text causal, each image bidirectional and seeing everything before it) under a
        # 4096-token sliding window, as Gemma 3's sliding layers compose it: 65 segments
        BenchConfig("vlm32k_window4k", 2, 16, 8, 128, *_VLM_32K, window=4096, tags=("masks",)),
        # Gemma 3's head dim: the same sequence at Gemma-3-4B-like heads, whole and under Gemma 3 4B's 1024 window
        BenchConfig("vlm32k_d256", 1, 8, 4, 256, *_VLM_32K, tags=("masks",)),
        BenchConfig("vlm32k_d256_window1k", 1, 8, 4, 256, *_VLM_32K, window=1024, tags=("masks",)),
        # head dim 192, which pads to 256 (Triton's tensor shapes are powers of two): the D=256 kernels' row at 192
        BenchConfig("vlm32k_d192", 1, 8, 4, 192, *_VLM_32K, tags=("masks",)),
        # one causal segment: the row where FlashAttention-4's dense kernel (fa4_dense) runs the same mask
        BenchConfig("dense_causal_d256", 1, 16, 4, 256, (16384,), ((CAUSAL,),), tags=("masks",)),
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
        # the mask rows, small: a pack of 6 samples (one without audio), 3 images, 4 frames
        BenchConfig("tiny_pack", 1, 2, 1, 16, pack_lengths(6, ((2, 8), (4, 24), (0, 8)), seed=1), HUB, causal=True,
                    packed=True, tags=("masks",)),
        BenchConfig("tiny_transfusion", 1, 4, 2, 32, *transfusion_layout(3, 16, (3, 12)), tags=("masks",)),
        BenchConfig("tiny_video", 1, 2, 1, 16, *video_layout(20, 4, 12), tags=("masks",)),
        # a window of 11: below one tile, not a multiple of any block size, and shorter than the images (cut by it)
        BenchConfig("tiny_window", 2, 2, 1, 16, *transfusion_layout(3, 14, (3, 12), seed=2), window=11,
                    tags=("masks",)),
    )
}

# Packs of longer samples, outside the default run: the tools that compare backward passes take them by name
# (``tools.one_pass --configs pack_64k_x64``), to see how a choice for pack_64k_x512 holds as samples grow.
PACK_CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        # 64 samples scaled to 65536 tokens (~1k a sample), 32 (~2k), 16 (~4k); PACK_RANGES, hub, causal per sample
        BenchConfig("pack_64k_x64", 1, 16, 4, 128, pack_lengths(64, PACK_RANGES, seed=0, total=65536), HUB,
                    causal=True, packed=True),
        BenchConfig("pack_64k_x32", 1, 16, 4, 128, pack_lengths(32, PACK_RANGES, seed=0, total=65536), HUB,
                    causal=True, packed=True),
        BenchConfig("pack_64k_x16", 1, 16, 4, 128, pack_lengths(16, PACK_RANGES, seed=0, total=65536), HUB,
                    causal=True, packed=True),
    )
}

GPU_CONFIGS: dict[str, BenchConfig] = {**CONFIGS, **DECODE_CONFIGS, **MASK_CONFIGS}  # ``python -m benchmarks``
ALL_CONFIGS: dict[str, BenchConfig] = {**GPU_CONFIGS, **PACK_CONFIGS, **TINY}

# Names that stand for several configs in ``--configs`` (mixable with config names: ``masks,mm13k_hub_causal``).
GROUPS: dict[str, tuple[str, ...]] = {
    "quick": QUICK,
    "decode": tuple(DECODE_CONFIGS),
    "masks": tuple(MASK_CONFIGS),
    "tiny": tuple(TINY),
    "tiny_masks": tuple(n for n, c in TINY.items() if "masks" in c.tags),
}
assert not set(GROUPS) & set(ALL_CONFIGS), "a group name must not be a config name"


def expand_names(names: Iterable[str]) -> list[str]:
    """Config names with each group name replaced by its configs, in order, without repeats; unknown names are
    kept (the caller reports them)."""
    out: list[str] = []
    for name in names:
        out += [n for n in GROUPS.get(name, (name,)) if n not in out]
    return out
