"""The Gluon forward's ping-pong settings side by side on one Hopper GPU: each turn scheme (``Tile.turns``) at the
config's tile and the tile without ping-pong at 2 and 3 stages where the config takes turns (D=128), and where the
config runs without ping-pong (D=64, D=256) its tile at 2-4 stages and ping-pong at 2 and 3 stages with each
scheme, where the tile fits a CTA. Every setting's output must equal the config's tile's bit for bit (they only
move synchronisation); the forward's time is the median over interleaved rounds, and each ratio the median of the
per-round ratios to the first setting.

    python -m tools.fwd_turns                                   # the configs below, 5 rounds
    python -m tools.fwd_turns --configs mm13k_hub,pack_64k_x512 --rounds 9 --out benchmarks/results/h200
    python -m tools.fwd_turns --configs vlm32k_d256 --settings pingpong_2stages_named_release

Writes ``fwd_turns.{json,md}`` under ``--out``, with the GPU, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter
from benchmarks.arguments import config_names
from benchmarks.baselines import mmsparse_fn
from benchmarks.configs import ALL_CONFIGS
from benchmarks.env import git_commit, versions
from benchmarks.inputs import make_inputs
from mmsparse.attention.config import TURN_SCHEMES, KernelConfig, gluon_tile_problem, head_dim_pad, kernel_config
from mmsparse.attention.dispatch import hopper_gluon_available

DEFAULT_CONFIGS = ("mm13k_cyclic", "mm13k_hub", "mm43k_cyclic", "transfusion_16k", "pack_64k_x512", "mm13k_hub_d64")


def settings(base: KernelConfig, head_dim: int) -> dict[str, KernelConfig]:
    """Label -> config. The first is the reference of the ratios: the config's own tile without ping-pong at D=64
    and D=256, the turn mbarriers otherwise. The forward's tile and the short-samples tile change together; a tile
    that does not fit a CTA's shared memory is left out."""
    if not base.fwd.pingpong:
        out = {"no_pingpong": base, **_without_pingpong(base, head_dim, (2, 3, 4))}
        for stages in (2, 3):
            for turns in TURN_SCHEMES:
                tile = replace(base.fwd, gluon_stages=stages, pingpong=True, turns=turns)
                if gluon_tile_problem("fwd", tile, head_dim_pad(head_dim)) is None:
                    out[f"pingpong_{stages}stages_{turns}"] = replace(base, fwd=tile)
        return out
    short = base.fwd_short_samples
    return {**{turns: replace(base, fwd=replace(base.fwd, turns=turns),
                              fwd_short_samples=short if short is None else replace(short, turns=turns))
               for turns in TURN_SCHEMES},
            **_without_pingpong(base, head_dim, (2, 3))}


def _without_pingpong(base: KernelConfig, head_dim: int, stages: tuple[int, ...]) -> dict[str, KernelConfig]:
    """The forward's tile without ping-pong (a stage's K and its V released apart, kernels/gluon/forward.py) at each
    of ``stages`` where it fits a CTA and is not the config's own tile."""
    out = {}
    for count in stages:
        tile = replace(base.fwd, gluon_stages=count, pingpong=False)
        if tile != base.fwd and gluon_tile_problem("fwd", tile, head_dim_pad(head_dim)) is None:
            out[f"no_pingpong_{count}stages"] = replace(base, fwd=tile)
    return out


def time_config(name: str, rounds: int, only: list[str] | None = None) -> dict[str, Any]:
    from triton.testing import do_bench

    cfg, device = ALL_CONFIGS[name], torch.device("cuda")
    q, k, v, _ = make_inputs(cfg, device)
    fn = mmsparse_fn(cfg, device)
    variants = settings(kernel_config(cfg.head_dim, q.dtype, device), cfg.head_dim)
    if only:  # the reference setting stays first
        unknown = [label for label in only if label not in variants]
        if unknown:
            raise ValueError(f"--settings {', '.join(unknown)}: {name} (D={cfg.head_dim}) has the settings "
                             f"{', '.join(variants)}")
        variants = {label: kc for i, (label, kc) in enumerate(variants.items()) if i == 0 or label in only}
    times: dict[str, list[float]] = {label: [] for label in variants}
    with torch.no_grad():
        outs = {}
        for label, kc in variants.items():
            with mmsparse.tuning.use_tuning(kc):
                outs[label] = fn(q, k, v)
        first = next(iter(variants))
        for r in range(rounds):  # the order alternates, so that slow spells land on every setting
            for label in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                with mmsparse.tuning.use_tuning(variants[label]):
                    times[label].append(do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median"))
    return {"config": name, "reference": first, "settings": {
        label: {"fwd_ms": statistics.median(times[label]),
                "speedup": statistics.median(a / b for a, b in zip(times[first], times[label])),
                "bit_equal": bool(torch.equal(outs[label], outs[first]))} for label in variants}}


def markdown(record: dict[str, Any]) -> str:
    lines = [f"{record['versions']}, commit {record['commit']}, bf16; do_bench median of the forward, "
             f"{record['rounds']} interleaved rounds; speedup: the median of the per-round ratios to the row's first "
             "setting.", "",
             "| config | setting | fwd ms | speedup | bit-equal |", "|---|---|---:|---:|---|"]
    for row in record["rows"]:
        for label, s in row["settings"].items():
            lines.append(f"| {row['config']} | {label} | {s['fwd_ms']:.3f} | {s['speedup']:.3f}x | {s['bit_equal']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fwd_turns", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated benchmark config names")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median)")
    ap.add_argument("--out", type=Path, help="folder for fwd_turns.{json,md}")
    ap.add_argument("--settings", default=None,
                    help="comma-separated setting labels to time beside the config's own, which every config must have "
                         "(default: every one)")
    args = ap.parse_args(argv)
    names = config_names(ap, args.configs)
    if not (torch.cuda.is_available() and hopper_gluon_available(0)):
        print("tools.fwd_turns times the Gluon forward: it needs a Hopper GPU (H100, H200)", file=sys.stderr)
        return 2
    only = args.settings.split(",") if args.settings else None
    rows = [time_config(name, args.rounds, only) for name in names]
    record = {"rows": rows, "versions": versions(torch.device("cuda")), "commit": git_commit(), "rounds": args.rounds}
    print(markdown(record))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fwd_turns.json").write_text(json.dumps(record, indent=1))
        (args.out / "fwd_turns.md").write_text(markdown(record))
    unequal = [(r["config"], k) for r in rows for k, s in r["settings"].items() if not s["bit_equal"]]
    if unequal:
        print(f"outputs differ from the reference setting: {unequal}", file=sys.stderr)
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
