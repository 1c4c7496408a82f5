"""The problems of the multi-GPU context-parallel tools (``cp_nccl``), by name: layout, shape, timed steps, memory.

GPU rows, B=1, D=128, bf16:

| name | layout | topology | Hq / Hkv |
|---|---|---|---|
| ``mm43k_cyclic`` | (2048, 32768, 8192): the attention benchmark's config | cyclic | 8 / 8 |
| ``hub_causal_256k`` | (16384, 196608, 49152), as in :data:`LONG_LAYOUTS` | hub, causal | 16 / 4 |
| ``video_256k`` | 8192 text tokens, then 64 frames of 3968 | text causal; a frame sees itself and all before | 16 / 4 |
| ``long_1m`` | (8192, 786432, 253952), as in :data:`LONG_LAYOUTS` | hub, causal | 16 / 4 |

``pairs_dropout`` is the dropout check's problem: five segments whose pairs are NONE, FULL and CAUSAL (CAUSAL pairs
to an earlier segment, to itself and to a later one), ragged lengths, dropout 0.1. The ``tiny_*`` problems run on
CPU through Triton's interpreter: a check that the tools work, not a measurement.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .arguments import names_in
from .configs import CONFIGS, CYCLIC, HUB, video_layout

# The long-sequence layouts of context parallelism, name: (topology, seg_lens, causal); the developer tools
# tools.cp_plan, cp_model and cp_local read them too. ``cyclic_43k`` is not the attention benchmark's
# ``mm43k_cyclic`` (2048, 32768, 8192).
LONG_LAYOUTS = {
    "cyclic_43k": (CYCLIC, (4096, 24576, 14336), False),
    "hub_causal_256k": (HUB, (16384, 196608, 49152), True),
    "long_1m": (HUB, (8192, 786432, 253952), True),
}

# Five segments (text, image, text, image, audio): 0 none, 1 full, 2 causal (keys at or before the query).
PAIRS5 = (
    (2, 0, 0, 0, 0),
    (1, 1, 0, 2, 0),  # CAUSAL to a later segment: no key of it
    (1, 1, 2, 0, 1),  # FULL to a later segment
    (0, 0, 1, 1, 0),
    (1, 0, 2, 2, 2),  # CAUSAL to earlier segments: every key of them
)


@dataclass(frozen=True)
class CPCase:
    """One context-parallel problem.

    Args:
        name: the row label.
        topology: k x k pair types (0 none, 1 full, 2 causal).
        seg_lens: k lengths (one sample's, shared by the batch).
        causal: the global causal flag.
        batch, heads_q, heads_kv, head_dim: B, Hq, Hkv, D.
        reps: timed steps of each measurement.
        warmup: untimed steps before them (the checked runs before have compiled the kernels and built the
            pieces already).
        dropout_p: attention dropout (the dropout check's problem only).
    """

    name: str
    topology: tuple[tuple[int, ...], ...]
    seg_lens: tuple[int, ...]
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    reps: int
    warmup: int = 1
    dropout_p: float = 0.0

    @property
    def seq_len(self) -> int:
        return sum(self.seg_lens)

    @property
    def layout(self) -> str:
        k = len(self.seg_lens)
        return str(self.seg_lens) if k <= 5 else f"{k} segments"

    def describe(self) -> str:
        causal = " causal" if self.causal else ""
        return (f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} D={self.head_dim} seg={self.layout}{causal} "
                f"S={self.seq_len}")

    def memory_bytes(self, world: int, element_size: int) -> int:
        """A generous estimate of one GPU's peak in ``cp_nccl``: the whole problem (q, k, v, dout; out and the
        three gradients kept as the reference, and those of a timed step), plus the larger of the
        context-parallel step (a 1/P share of the tensors, the gathered K/V, float32 dq, the float32 dK/dV of the
        gathered keys and what goes back to their owners) and the all-gather baseline (every key's K/V, its
        gradients, their float32 copies)."""
        unit = self.batch * self.seq_len * self.head_dim * element_size
        heads, f32 = self.heads_q + self.heads_kv, 4 / element_size
        single = 6 * heads * unit
        cp = (3 * heads / world + 2 * self.heads_kv + self.heads_q * f32 / world + 3 * self.heads_kv * f32) * unit
        baseline = 2 * self.heads_kv * (2 + f32) * unit
        return int(1.15 * (single + max(cp, baseline)))


def _plan(name: str, heads_q: int, heads_kv: int, reps: int, warmup: int) -> CPCase:
    topology, seg_lens, causal = LONG_LAYOUTS[name]
    return CPCase(name, topology, seg_lens, causal, 1, heads_q, heads_kv, 128, reps, warmup)


_MM43K = CONFIGS["mm43k_cyclic"]
_VIDEO_LENS, _VIDEO_TOPOLOGY = video_layout(8192, 64, 3968)
# Timed steps: a one-GPU step of hub_causal_256k takes ~1.4 s on an H100, of long_1m ~20 s.
CASES: dict[str, CPCase] = {
    c.name: c
    for c in (
        CPCase("mm43k_cyclic", _MM43K.topology, _MM43K.seg_lens, _MM43K.causal, _MM43K.batch, _MM43K.heads_q,
               _MM43K.heads_kv, _MM43K.head_dim, reps=20, warmup=3),
        _plan("hub_causal_256k", 16, 4, reps=5, warmup=1),
        CPCase("video_256k", _VIDEO_TOPOLOGY, _VIDEO_LENS, False, 1, 16, 4, 128, reps=5, warmup=1),
        _plan("long_1m", 16, 4, reps=2, warmup=0),
    )
}
DROPOUT_CASE = CPCase("pairs_dropout", PAIRS5, (1000, 2900, 1500, 2500, 701), False, 1, 8, 2, 128, reps=0,
                      dropout_p=0.1)

_TINY_VIDEO_LENS, _TINY_VIDEO_TOPOLOGY = video_layout(12, 4, 13)
TINY: dict[str, CPCase] = {
    c.name: c
    for c in (
        CPCase("tiny_hub_causal", HUB, (10, 22, 17), True, 1, 2, 1, 16, reps=1, warmup=0),
        CPCase("tiny_cyclic", CYCLIC, (13, 30, 21), False, 1, 2, 1, 16, reps=1, warmup=0),
        CPCase("tiny_video", _TINY_VIDEO_TOPOLOGY, _TINY_VIDEO_LENS, False, 1, 2, 1, 16, reps=1, warmup=0),
    )
}
TINY_DROPOUT_CASE = CPCase("tiny_pairs_dropout", PAIRS5, (9, 14, 11, 12, 10), False, 1, 2, 1, 64, reps=0,
                           dropout_p=0.1)
ALL_CASES: dict[str, CPCase] = {**CASES, **TINY}
# --configs of the context-parallel tools: names of ALL_CASES
case_names = names_in(ALL_CASES)


def rank_tool_parser(tool: str, doc: str) -> argparse.ArgumentParser:
    """The command line of the context-parallel tool ``benchmarks.<tool>`` (run under torchrun), described by its
    docstring's first paragraph, with ``--configs``: names of :data:`ALL_CASES`."""
    parser = argparse.ArgumentParser(prog=f"torchrun --nproc-per-node N -m benchmarks.{tool}",
                                     description=doc.split("\n\n")[0])
    parser.add_argument("--configs", type=case_names, default=None,
                        help="comma-separated context-parallel configs (default: mm43k_cyclic on GPUs, tiny_cyclic "
                             "on CPU)")
    return parser
