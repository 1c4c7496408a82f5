"""A performance model of context parallelism, for the long-sequence layouts of :mod:`benchmarks.cp_cases`:
``python -m tools.cp_model [--out DIR]``.

Per config and world size P (Hq=16, Hkv=4, D=128, bf16, batch 1), for one forward and backward step:

- **compute**: the busiest rank's live pairs at the single-GPU rate of the attention kernels (forward 4·Hq·D flops
  a live pair, backward 2.5 times that), :data:`RATE_FWD` and :data:`RATE_BWD`, measured on one H100;
- **exchange** at a link bandwidth per direction (:mod:`benchmarks.cp_traffic`): in the forward the K/V a rank
  receives and serves; in the backward the same K/V again (the forward keeps O(S/P)) and the dK/dV that go back to
  the owners, in float32 (twice the bytes); each direction is timed separately and the busier one counts;
- **step**: compute + exchange (no overlap: a bound from below on the speedup; the pieces over a rank's own
  chunk already run under the exchange), and max(compute, exchange) with the exchange fully hidden.

Speedup is over one GPU running every live pair at the same rate. A model, not a measurement: the per-rank time
is the measured rate applied to the plan's pairs (the plan balances live pairs to 1.00-1.01 max/mean), and the
links of the lent machines have not been measured, hence the three bandwidths. Beside it, where
``results/h100/cp_local.json`` holds them, the slowest rank's fwd+bwd measured alone on one GPU
(``python -m tools.cp_local``): the check of the compute term.
"""

from __future__ import annotations

import json

from benchmarks.cp_cases import LONG_LAYOUTS
from benchmarks.cp_traffic import exchange_bytes, predicted_speedup
from benchmarks.env import RESULTS_DIR
from mmsparse.distributed import plan_context_parallel

from .cp_plan import KV_BYTES_PER_TOKEN, table_main

MEASURED = RESULTS_DIR / "h100" / "cp_local.json"

HEADS_Q, HEAD_DIM = 16, 128
# mmsparse's TF/s over live pairs on mm13k_hub_causal (hub topology, causal, D=128), H100, torch 2.11:
# benchmarks/results/h100/flex_flash.md. Long hub-causal sequences run at least as fast per pair.
RATE_FWD, RATE_BWD = 537e12, 440e12
BANDWIDTHS = (50e9, 150e9, 450e9)  # bytes/s per direction
WORLD_SIZES = (1, 2, 4, 8)


def step_seconds(live_pairs: float) -> float:
    """Forward + backward compute time of ``live_pairs`` at the measured rates."""
    flops = 4 * HEADS_Q * HEAD_DIM * live_pairs
    return flops / RATE_FWD + 2.5 * flops / RATE_BWD


def measured_ms() -> dict[tuple[str, int], float]:
    """{(config, world size): the slowest rank's measured fwd+bwd ms} from the cp_local record, if there is one."""
    if not MEASURED.exists():
        return {}
    return {(r["config"], r["world_size"]): r["max_fwdbwd_ms"] for r in json.loads(MEASURED.read_text())["summary"]}


def rows() -> list[dict]:
    out = []
    measured = measured_ms()
    for name, (topology, seg_lens, causal) in LONG_LAYOUTS.items():
        single = None
        for world in WORLD_SIZES:
            plan = plan_context_parallel(topology, seg_lens, world, causal=causal, tile=128)
            s = plan.summary(KV_BYTES_PER_TOKEN)
            compute = step_seconds(max(s["live_pairs"]))
            single = single if single is not None else step_seconds(sum(s["live_pairs"]))
            moved = exchange_bytes(s)
            row = {"config": name, "world_size": world, "compute_ms": compute * 1e3, "exchange_mib": moved / 2**20,
                   "measured_ms": measured.get((name, world))}
            for bw in BANDWIDTHS:
                name_bw = f"speedup_{bw / 1e9:.0f}"
                row[name_bw], row[f"{name_bw}_overlap"] = predicted_speedup(s, single, bw)
            out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    heads = " | ".join(f"{bw / 1e9:.0f} GB/s" for bw in BANDWIDTHS)
    lines = ["Model (not a measurement): speedup over one H100 of a forward + backward step, exchange not "
             "overlapped / fully overlapped.", "",
             f"| config | GPUs | compute ms (busiest rank) | measured ms (slowest rank, alone) | exchanged MiB "
             f"(busiest link) | {heads} |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(BANDWIDTHS)]
    for r in table:
        speeds = " | ".join(f"{r[f'speedup_{bw / 1e9:.0f}']:.2f}x / {r[f'speedup_{bw / 1e9:.0f}_overlap']:.2f}x"
                            for bw in BANDWIDTHS)
        seen = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        lines.append(f"| {r['config']} | {r['world_size']} | {r['compute_ms']:.1f} | {seen} | "
                     f"{r['exchange_mib']:.0f} | {speeds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, "cp_model", __doc__, rows, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
