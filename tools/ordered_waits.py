"""A CPU model of the ordered dQ writer's waits, to rank launch and rank schemes before GPU time.

The ordered dQ writer (``kernels/gluon/bwd_dq_writer.py`` with ``ORDERED``) adds each query block's dQ in the order
of ``mask.add_order``'s ranks: a program's writer waits until the block's counter reads its entry's rank. This
model replays one backward's launch over a config's real block lists and ranks (``mask.add_order.dq_add_ranks``, in
the kernel's launch direction and groups) on ``--sms`` multiprocessors, one program each, started in launch order
as others end, and gives the ordered writer's time over the same launch without the waits (the unordered writer).

A program, per step (one list entry for each head of its GQA group): its MMA warpgroups take ``--step-us`` a step
and store the step's dQ into the writer's staging half once the writer has taken the previous step's; the writer
issues a step's adds once the step is computed, its own adds before have landed, and the block's counter reads the
entry's rank; the adds land (the counter counts one) ``--add-us`` after they are issued. Nothing else is modelled:
not memory, not L2, not a partial block's extra work. With 2.5 and 2 µs it gives 0.874, 1.005 and 1.028 for sections
of 1, 2 and 4 heads on mm13k_cyclic, and 0.863, 0.956 and 0.988 on mm13k_hub_d64, where an H200 measured 0.895,
0.961, 1.009 and 0.882, 0.922, 0.955 (each against the two passes of its own process, over the unordered writer's
ratio: ``benchmarks/results/h200/ordered_head_sections.md``): the order of the schemes, not their figures.

A section here counts (batch, KV head)s (``KernelConfig.ordered_head_section`` counts query heads: the backward takes
that over the GQA group). Sections are modelled in either launch direction; the backward takes them only where its
programs launch longest list first (``attention/backward.py``): shortest first, the model gave 0.52-0.86x on causal
masks.

    python -m tools.ordered_waits --configs mm13k_cyclic,mm13k_hub_d64 --sections 1,2,4
    python -m tools.ordered_waits --configs seed --sections 1,2 --sms 8       # small, as the tests run it
"""

from __future__ import annotations

import argparse
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import torch

import mmsparse  # noqa: F401  (before triton: without CUDA it turns on Triton's interpreter)
from benchmarks.arguments import config_names
from benchmarks.configs import ALL_CONFIGS, BenchConfig
from mmsparse.attention.config import cuda_kernel_config
from mmsparse.mask.add_order import adds_shortest_first, dq_add_ranks
from mmsparse.mask.blocks import BlockLists
from mmsparse.mask.build import build_mask_info
from mmsparse.mask.info import MaskInfo


@dataclass(frozen=True)
class Timing:
    """The model's costs, in µs: a step's matmuls, an add's issue to its count, a program's start and end."""

    step_us: float = 2.5
    add_us: float = 2.0
    start_us: float = 2.0
    end_us: float = 1.0
    stage_us: float = 0.2  # the writer's taking a staging half, before the MMA warpgroups may fill it again


@dataclass(frozen=True)
class Launch:
    """One backward's programs, in launch order: each (head, list) pair's entries (slots into ``indices``), the
    block ids and their ranks (None: unordered), and the steps a list entry takes (the GQA group's heads)."""

    programs: list[tuple[int, list[int]]]
    blocks: list[int]
    ranks: list[int] | None
    group: int


def launch_of(lists: BlockLists, query_blocks: int, heads: int, group: int, sms: int, section: int,
              shortest_first: bool, ordered: bool) -> Launch:
    """The programs of ``heads`` (batch, KV head)s over one sample's ``lists`` (``counts[0]``, ``indices[0]``), in
    the kernel's launch order: the lists' order (backwards where ``shortest_first``), the heads in sections of
    ``section`` taking each place in turn (``kernels/gluon/dkdv_rows._heads_in_sections``), with the ranks the
    backward makes for it (groups of ``sms // section`` rows; ``query_blocks``: the query blocks a head)."""
    counts = lists.counts[0].tolist()
    order = [row[3] for row in counts][::-1 if shortest_first else 1]
    programs = []
    for first in range(0, heads, section):
        for row in order:
            full, partial, start, _ = counts[row]
            for head in range(first, min(first + section, heads)):
                programs.append((head, list(range(start, start + full + partial))))
    ranks = None
    if ordered:
        resident = max(1, sms // section)
        ranks = dq_add_ranks(lists, query_blocks, resident, shortest_first)[0].tolist()
    return Launch(programs, lists.indices[0].tolist(), ranks, group)


def modelled_us(launch: Launch, sms: int, timing: Timing) -> float:
    """The time the last program ends, in µs (see the module's docstring). Raises RuntimeError where a wait never
    ends (the ranks and the launch disagree)."""
    programs, blocks, ranks = launch.programs, launch.blocks, launch.ranks
    step_us = timing.step_us * launch.group
    n = len(programs)
    computed: list[list[float]] = [[] for _ in range(n)]
    issued: list[list[float]] = [[] for _ in range(n)]
    landed_at: list[list[float]] = [[] for _ in range(n)]
    counters: dict[tuple[int, int], int] = {}
    waiting: dict[tuple[int, int], dict[int, int]] = {}
    events: list[tuple[float, int, str, int, int]] = []
    ends = [0.0] * n
    order = 0

    def push(at: float, kind: str, program: int, step: int = 0) -> None:
        nonlocal order
        heapq.heappush(events, (at, order, kind, program, step))
        order += 1

    def compute(p: int, started: float = 0.0) -> None:
        step = len(computed[p])
        if step >= len(programs[p][1]) or (step and len(issued[p]) < step):
            return  # done, or the staging half of the step before is not taken yet
        at = started + step_us if not step else max(computed[p][-1], issued[p][-1] + timing.stage_us) + step_us
        computed[p].append(at)
        push(at, "computed", p, step)

    def write(p: int, now: float) -> None:
        step = len(issued[p])
        if step >= len(programs[p][1]) or len(computed[p]) <= step or len(landed_at[p]) < step:
            return
        slot = programs[p][1][step]
        key = (programs[p][0], blocks[slot])
        if ranks is not None and counters.get(key, 0) < ranks[slot]:
            waiting.setdefault(key, {})[ranks[slot]] = p
            return
        at = max(computed[p][step], now)
        issued[p].append(at)
        landed_at[p].append(at + timing.add_us)
        push(at + timing.add_us, "landed", p, step)
        compute(p)

    def start(p: int, now: float) -> None:
        if programs[p][1]:
            compute(p, now + timing.start_us)
        else:
            push(now + timing.start_us, "ended", p)

    launched = min(sms, n)
    for p in range(launched):
        start(p, 0.0)
    while events:
        now, _, kind, p, step = heapq.heappop(events)
        if kind == "computed":
            write(p, now)
        elif kind == "landed":
            key = (programs[p][0], blocks[programs[p][1][step]])
            counters[key] = counters.get(key, 0) + 1
            turn = waiting.get(key, {}).pop(counters[key], None)
            if turn is not None:
                write(turn, now)
            write(p, now)
            if step == len(programs[p][1]) - 1:
                push(now + timing.end_us, "ended", p)
        else:
            ends[p] = now
            if launched < n:
                start(launched, now)
                launched += 1
    if launched < n or any(len(landed_at[p]) < len(programs[p][1]) for p in range(n)):
        raise RuntimeError("a wait never ended: the ranks do not follow the launch")
    return max(ends)


def config_mask(cfg: BenchConfig) -> tuple[MaskInfo, int | None]:
    """``cfg``'s mask built on the CPU, and its samples' average length where it is a pack (None: not a pack)."""
    seq = cfg.seq_k
    info = build_mask_info([list(r) for r in cfg.topology], [list(r) for r in cfg.seg_lens] if cfg.packed
                           else list(cfg.seg_lens), seq, seq, cfg.causal, torch.device("cpu"), packed=cfg.packed,
                           window=cfg.window)
    return info, (seq // len(cfg.seg_lens) if cfg.packed else None)


def config_lists(cfg: BenchConfig) -> tuple[BlockLists, int, bool, int]:
    """The by-key lists of ``cfg``'s first sample at the dQ writer's tile (the Hopper table's, bf16), its query
    blocks, whether its programs launch shortest list first, and its GQA group."""
    seq = cfg.seq_k
    info, sample_len = config_mask(cfg)
    config = cuda_kernel_config(cfg.head_dim, torch.bfloat16, gluon_dq_writer=True)
    tile = config.dq_writer_tile(seq, sample_len)
    if tile is None:
        raise ValueError(f"{cfg.name}: no dQ-writer kernel at head dim {cfg.head_dim} (the table's head dims: 64, 128)")
    lists = info.lists(tile.block_m, tile.block_n, True, config.compact_bytes)
    return lists, -(-seq // tile.block_m), adds_shortest_first(info.mode, info.causal), cfg.heads_q // cfg.heads_kv


def model_config(cfg: BenchConfig, sections: list[int], sms: int, timing: Timing) -> dict:
    """The row of one config: the unordered time, and the ordered writer's over it for each section size."""
    lists, query_blocks, shortest_first, group = config_lists(cfg)
    heads = cfg.batch * cfg.heads_kv
    unordered = modelled_us(launch_of(lists, query_blocks, heads, group, sms, 1, shortest_first, False), sms, timing)
    row = {"config": cfg.name, "unordered_us": unordered, "shortest_first": shortest_first}
    for section in sections:
        launch = launch_of(lists, query_blocks, heads, group, sms, section, shortest_first, True)
        ordered = modelled_us(launch, sms, timing)
        row[f"sections_{section}"] = unordered / ordered
    return row


def table(rows: list[dict], sections: list[int]) -> str:
    heads = " | ".join(f"{s} heads a section" for s in sections)
    lines = [f"| config | launch | unordered µs (model) | {heads} |", "|---|---|---:|" + "---:|" * len(sections)]
    for row in rows:
        launch = "shortest first" if row["shortest_first"] else "longest first"
        lines.append(f"| {row['config']} | {launch} | {row['unordered_us']:.0f} | "
                     + " | ".join(f"{row[f'sections_{s}']:.3f}" for s in sections) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ordered_waits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="mm13k_cyclic,mm13k_hub,mm13k_hub_d64",
                    help="comma-separated benchmark config names (benchmarks/configs.py)")
    ap.add_argument("--sections", default="1,2,4",
                    help="comma-separated (batch, KV head)s a section (the backward's: ordered_head_section query "
                         "heads over the GQA group)")
    ap.add_argument("--sms", type=int, default=132, help="programs running at once (an H200's multiprocessors)")
    ap.add_argument("--step-us", type=float, default=Timing.step_us, help="a step's matmuls, µs")
    ap.add_argument("--add-us", type=float, default=Timing.add_us, help="an add's issue to its count, µs")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    names = config_names(ap, args.configs)
    try:
        sections = [int(s) for s in args.sections.split(",") if s]
    except ValueError:
        ap.error(f"--sections takes comma-separated ints; got {args.sections!r}")
    if not sections or min(sections) < 1 or args.sms < 1 or args.step_us <= 0 or args.add_us < 0:
        ap.error("--sections, --sms and --step-us take positive values, --add-us one of at least 0")
    timing = Timing(step_us=args.step_us, add_us=args.add_us)
    rows = [model_config(ALL_CONFIGS[name], sections, args.sms, timing) for name in names]
    print("The ordered writer's modelled time over the unordered writer's (1: no wait costs anything)")
    print(table(rows, sections))
    if args.out is not None:
        args.out.write_text(json.dumps({"sms": args.sms, "timing": vars(timing), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
