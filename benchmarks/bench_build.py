"""Time the block-metadata build for a new set of segment lengths, next to Flex's create_block_mask.

What is timed: ``build_mask_info(topology, lens, ...)`` with a device length tensor (no cache: every call builds
from scratch) plus ``MaskInfo.prepare`` (the block lists of the forward, dK/dV and dQ tiles), host wall time with a
device sync before and after each call, median over the calls. It also checks that the build makes no host sync
(``torch.cuda.set_sync_debug_mode("error")``) and that its lists equal the pure-torch reference's.

    python -m benchmarks.bench_build                 # GPU: B=8 S=16k per-sample lengths, S=43k shared
    python -m benchmarks.bench_build --device cpu    # smoke test through the Triton interpreter (small shapes)

Writes ``build.json`` and ``build.md`` under ``--out`` (default ``benchmarks/results/<gpu>/``; a temporary folder on
the CPU).
"""

from __future__ import annotations

import argparse
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import mmsparse  # noqa: F401  (turns on Triton's interpreter without CUDA, before triton is imported)
from mmsparse.attention.config import kernel_config
from mmsparse.attention.kernel_args import list_tiles, prepare
from mmsparse.mask.add_order import mask_adds_longest_first
from mmsparse.mask.blocks import classify_blocks_from_bits, lists_from_classes
from mmsparse.mask.build import build_mask_info

from .configs import CYCLIC, HUB
from .env import environment, record_dir
from .flex_mask import flex_mask_mod, segment_ids
from .report import write_record
from .timing import host_ms

TOPIC = "build"


@dataclass(frozen=True)
class BuildCase:
    name: str
    batch: int  # rows of per-sample lengths (1: one set shared by the batch)
    seq_len: int
    topology: tuple[tuple[int, ...], ...]
    causal: bool
    head_dim: int = 128


GPU_CASES = (
    BuildCase("b8_s16k_hub", 8, 16384, HUB, False),
    BuildCase("b8_s16k_hub_causal", 8, 16384, HUB, True),
    BuildCase("b1_s43k_cyclic", 1, 43008, CYCLIC, False),
)
CPU_CASES = (BuildCase("tiny_b4_hub", 4, 200, HUB, False), BuildCase("tiny_b1_cyclic_causal", 1, 300, CYCLIC, True))


def random_lengths(case: BuildCase, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Per-sample lengths [batch, 3] that fill 60-100% of the sequence (the rest is padding)."""
    rows = []
    for _ in range(case.batch):
        total = int(case.seq_len * (0.6 + 0.4 * torch.rand((), generator=gen).item()))
        cuts = sorted(torch.randint(0, total + 1, (2,), generator=gen).tolist())
        rows.append([cuts[0], cuts[1] - cuts[0], total - cuts[1]])
    if case.batch == 1:
        rows = [[2048, 32768, 8192]] if case.seq_len == 43008 else rows
    return torch.tensor(rows, dtype=torch.int32, device=device)


def build_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """``reps`` timed calls after a long warm-up (compiles, caches, allocator pools, CPU clocks)."""
    return host_ms(fn, device, min_reps=reps, max_reps=reps, warmup_calls=max(3, reps // 2))


def check_lists(info: Any, cfg: Any) -> bool:
    """The lists :func:`prepare` built for ``cfg`` against the pure-torch classification, row by row (counts and
    ids)."""
    tiles = list_tiles(cfg, info.seq_q, info.seq_k, info.sample_len, longest_first=mask_adds_longest_first(info))
    for bm, bn, by_key in dict.fromkeys(tiles):
        lists = info.built_lists(bm, bn, by_key)
        live, full = classify_blocks_from_bits(info.q_bits, info.k_bits, info.num_segments, bm, bn, info.causal,
                                               info.q_start)
        if by_key:
            live, full = live.transpose(1, 2), full.transpose(1, 2)
        columns = live.shape[2]
        want, got = lists_from_classes(live, full).padded(columns), lists.padded(columns)
        if not all(torch.equal(w, g.expand_as(w)) for w, g in zip(want, got)):
            return False
    return True


def flex_ms(case: BuildCase, lens: torch.Tensor, device: torch.device, reps: int) -> float | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return None
    seg, real = segment_ids(lens, case.seq_len, device)
    mask_mod = flex_mask_mod(case.topology, seg, case.causal, real=real)
    batch = lens.shape[0] if lens.shape[0] > 1 else None
    return build_ms(lambda: create_block_mask(mask_mod, batch, None, case.seq_len, case.seq_len, device=device),
                    device, reps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<gpu>; a "
                                                           "temporary folder on the CPU)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cases = GPU_CASES if device.type == "cuda" else CPU_CASES
    reps = args.reps if device.type == "cuda" else 3
    gen = torch.Generator().manual_seed(0)
    env = environment(device)
    rows = []
    for case in cases:
        lens = random_lengths(case, device, gen)
        cfg = kernel_config(case.head_dim, torch.bfloat16, device)

        def build(lens: torch.Tensor = lens, case: BuildCase = case, cfg: Any = cfg) -> Any:
            return prepare(build_mask_info(case.topology, lens, case.seq_len, case.seq_len, case.causal, device,
                                           check_lengths=False), cfg)

        ms = build_ms(build, device, reps)
        no_sync = None
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                build()
                no_sync = True
            except RuntimeError:
                no_sync = False
                print("host sync in the build:\n" + "".join(traceback.format_exc(limit=-4)), flush=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        exact = check_lists(build(), cfg)
        fms = None if args.no_flex else flex_ms(case, lens, device, min(reps, 10))
        row = {"case": case.name, "batch": case.batch, "seq_len": case.seq_len, "causal": case.causal,
               "build_ms": round(ms, 4), "flex_build_ms": None if fms is None else round(fms, 3),
               "no_host_sync": no_sync, "lists_exact": exact, **env}
        rows.append(row)
        print(f"{case.name:22s} mmsparse build {ms:7.3f} ms   flex create_block_mask "
              f"{'-' if fms is None else f'{fms:7.2f}'} ms   no host sync: {no_sync}   lists exact: {exact}",
              flush=True)
    lines = [f"Run: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. Host wall "
             "time with a device sync around each call, median.", "",
             "| case | B | S | causal | mmsparse build ms | flex create_block_mask ms | no host sync | lists exact |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        flex = "-" if r["flex_build_ms"] is None else f"{r['flex_build_ms']:.2f}"
        lines.append(f"| {r['case']} | {r['batch']} | {r['seq_len']} | {r['causal']} | {r['build_ms']:.3f} | {flex} "
                     f"| {r['no_host_sync']} | {r['lists_exact']} |")
    path = write_record(args.out or record_dir(env["gpu"], TOPIC), TOPIC, rows, "\n".join(lines) + "\n")
    print(f"wrote {path} and its .md", flush=True)

if __name__ == "__main__":
    main()
