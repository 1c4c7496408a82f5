"""The context-parallel plan's balance and volume for the long-sequence configs: ``python -m tools.cp_plan``.

Host arithmetic only (no GPU): live pairs per rank (max/mean) and the K/V bytes the busiest rank receives under
the plan, against an all-gather (which a ring moves too, in P - 1 steps). All rows: Hkv=4, D=128, bf16. Writes
``--out DIR/cp_plan.{json,md}`` when given. ``cyclic_43k`` is (4096, 24576, 14336) under the cyclic topology, with
Hq=16 / Hkv=4 where it is timed: not the attention benchmark's ``mm43k_cyclic`` (2048, 32768, 8192; Hq=Hkv=8).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.cp_cases import LONG_LAYOUTS
from mmsparse.distributed import plan_context_parallel

KV_BYTES_PER_TOKEN = 2 * 4 * 128 * 2  # K and V, 4 kv heads, D=128, bf16
WORLD_SIZES = (2, 4, 8)


def rows() -> list[dict]:
    out = []
    for name, (topology, seg_lens, causal) in LONG_LAYOUTS.items():
        for world in WORLD_SIZES:
            plan = plan_context_parallel(topology, seg_lens, world, causal=causal, tile=128)
            s = plan.summary(KV_BYTES_PER_TOKEN)
            out.append({"config": name, "world_size": world, "chunk": plan.chunk, "imbalance": s["imbalance"],
                        "max_recv_mib": max(s["recv_bytes"]) / 2**20,
                        "all_gather_mib": max(s["all_gather_bytes"]) / 2**20, "live_pairs": s["live_pairs"]})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| config | ranks | chunk | live pairs max/mean | K/V received, busiest rank (MiB) | all-gather (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['world_size']} | {r['chunk']} | {r['imbalance']:.3f} | {r['max_recv_mib']:.1f} | "
              f"{r['all_gather_mib']:.1f} |" for r in table]
    return "\n".join(lines) + "\n"


def table_main(argv: list[str] | None, topic: str, doc: str, rows: Callable[[], list[dict]],
               markdown: Callable[[list[dict]], str]) -> int:
    """The command line of a host-arithmetic table: print it; with ``--out DIR``, write DIR/<topic>.{json,md}."""
    parser = argparse.ArgumentParser(prog=f"python -m tools.{topic}", description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {topic}.json and {topic}.md")
    args = parser.parse_args(argv)
    table = rows()
    print(markdown(table), end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{topic}.json").write_text(json.dumps(table, indent=1) + "\n")
        (args.out / f"{topic}.md").write_text(markdown(table))
    return 0


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "cp_plan", __doc__, rows, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
