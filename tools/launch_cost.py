"""Host time of each kernel launch in one attention step, through Triton's launcher with tensors and with addresses.

    python -m tools.launch_cost                          # the seed's forward + backward, 800 replays a launch (GPU)
    python -m tools.launch_cost --shape small_2k --reps 2000 --out DIR

Triton's C launcher takes a pointer argument as an integer as it is; for a tensor it calls ``data_ptr`` and then
asks the driver (``cuPointerGetAttribute``) whether the address is device memory, on every launch. Bound and cached
launches pass addresses (``mmsparse/runtime/launch.py``, ``_addresses``). This tool runs one step of
``benchmarks.host``'s shape after warm-up, keeps every launch that went straight through a launcher
(``_run_direct``), then replays each alone on the step's own tensors: with the tensors (the launcher checks each)
and with their addresses, the two forms by turns, each a median over blocks of 10 launches and a sync. The replays
write the step's outputs again, which nothing reads. Writes ``DIR/launch_cost.{json,md}`` with ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.env import environment
from benchmarks.host import GPU_SHAPES, _fwd_bwd, _inputs
from benchmarks.report import fmt, write_record
from mmsparse.runtime import launch

TOPIC = "launch_cost"
BLOCK = 10  # launches between two syncs: one timed block


def capture(step: Callable[[], None]) -> list[tuple]:
    """The direct launches of one ``step()``: ``(cache entry, grid, device, runtime args, boxes)`` each."""
    captured: list[tuple] = []
    direct = launch._run_direct

    def keep(entry: tuple, grid3: tuple[int, ...], device: int, args: tuple, boxes: Any = ()) -> None:
        captured.append((entry, grid3, device, tuple(args), boxes))
        direct(entry, grid3, device, args, boxes)

    launch._run_direct = keep
    try:
        step()
    finally:
        launch._run_direct = direct
    return captured


def _block_median_us(call: Callable[[], None], reps: int, sync: Callable[[], None]) -> float:
    for _ in range(2 * BLOCK):
        call()
    sync()
    times = []
    for _ in range(max(1, reps // BLOCK)):
        start = time.perf_counter_ns()
        for _ in range(BLOCK):
            call()
        times.append((time.perf_counter_ns() - start) / BLOCK / 1e3)
        sync()
    return statistics.median(times)


def replay_costs(captured: list[tuple], reps: int, rounds: int, sync: Callable[[], None]) -> list[dict[str, Any]]:
    """Each captured launch replayed ``reps`` times a round with its tensors and with their addresses, the forms by
    turns for ``rounds`` rounds; a row per launch with the medians over rounds in microseconds."""
    rows = []
    for entry, grid3, device, args, boxes in captured:
        as_tensors = (*entry[:3], ())  # no pointer positions: the launcher gets the tensors and checks each
        times: dict[str, list[float]] = {"tensors": [], "addresses": []}
        for _ in range(rounds):
            for form, chosen in (("tensors", as_tensors), ("addresses", entry)):
                replay = functools.partial(launch._run_direct, chosen, grid3, device, args, boxes)
                times[form].append(_block_median_us(replay, reps, sync))
        tensors_us, addresses_us = (statistics.median(times[form]) for form in ("tensors", "addresses"))
        rows.append({"kernel": getattr(entry[0], "name", type(entry[0]).__name__), "pointers": len(entry[3]),
                     "descriptors": len(boxes), "tensors_us": tensors_us, "addresses_us": addresses_us,
                     "saved_us": tensors_us - addresses_us})
    return rows


def markdown(record: dict[str, Any]) -> str:
    rows = record["rows"]
    lines = [f"Host time a launch, one {record['shape']} forward + backward's direct launches replayed "
             f"{record['reps']} times a round, {record['rounds']} rounds, tensors and addresses by turns "
             f"(`python -m tools.launch_cost`). {record['gpu']}; torch {record['torch']}, triton {record['triton']}; "
             f"commit {record['commit']}.", "",
             "| kernel | pointers | descriptors | tensors µs | addresses µs | saved µs |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['pointers']} | {r['descriptors']} | {fmt(r['tensors_us'], 2)} | "
              f"{fmt(r['addresses_us'], 2)} | {fmt(r['saved_us'], 2)} |" for r in rows]
    total = {form: sum(r[f"{form}_us"] for r in rows) for form in ("tensors", "addresses")}
    lines += ["", f"{len(rows)} launches a step: tensors {fmt(total['tensors'], 1)} µs, addresses "
              f"{fmt(total['addresses'], 1)} µs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.launch_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(GPU_SHAPES), default="seed", help="benchmarks.host's shape (seed)")
    ap.add_argument("--reps", type=int, default=800, help="replays of each launch a round (default 800)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the two forms by turns (default 2)")
    ap.add_argument("--out", type=Path, help="folder for launch_cost.{json,md}")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools.launch_cost times Triton's launcher: it needs a CUDA GPU (through the interpreter nothing is "
              "launched)")
        return 2
    device = torch.device("cuda")
    shape = GPU_SHAPES[args.shape]
    q, k, v, grad = _inputs(shape, device, torch.bfloat16)
    step = _fwd_bwd(q, k, v, grad, topology=shape.topology, seg_lens=shape.seg_lens)
    for _ in range(10):  # plans, compiles and binds every launch
        step()
    torch.cuda.synchronize()
    captured = capture(step)
    torch.cuda.synchronize()
    rows = replay_costs(captured, args.reps, args.rounds, torch.cuda.synchronize)
    record = {**environment(device), "shape": args.shape, "reps": args.reps, "rounds": args.rounds, "rows": rows}
    table = markdown(record)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_record(args.out, TOPIC, record, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
