"""What runs alone in one rank's context-parallel step: ``torchrun --nproc-per-node N -m benchmarks.cp_timeline
[--configs ...] [--keep-fetched-kv {auto,true,false}] [--steps 5] [--out DIR]``.

Each rank profiles ``--steps`` forward + backward steps of ``ContextParallel.attention`` back to back (no sync between
them, as in a model whose layers keep the GPU busy) under ``torch.profiler``, after a few untimed steps and a
barrier, and reads its own GPU events out of the exported chrome trace. Each event is one of:

- ``exchange``: NCCL kernels (a name with ``nccl``) and copies between GPUs: a memcpy named ``PtoP``, one whose
  trace arguments name two different devices, or a ``DtoD`` one on a stream that runs no kernel (the peer copies'
  own streams; the profiler may name a copy out of a peer's memory DtoD);
- ``compute``: every other kernel;
- ``copy``: every other memcpy and memset.

Over the window from the first GPU event to the last, per step: ``busy`` (any event), each class's own time (its
events' union), ``exchange_alone`` (an exchange event and no compute kernel: the exchange the attention does not
hide), ``compute_alone``, ``overlap`` (both) and ``idle`` (no event at all: the GPU waits for the host or for a
peer); the events that fill the exchange-alone time, the longest events, the longest idle gaps with the events on
either side, and every memcpy and memset by stream with its kind (to check the rules above on a new machine).
Stream memory operations (the peer copies' arrival flags) and waits are no event of the trace: a wait shows as idle
time or as the gap before the event it held back. ``host_ms``: the host's time to queue a step (to the last step's
return, before the sync; the profiler's own overhead included); ``wall_ms``: the same to the end of the sync;
``host_plain_ms``: queueing the same steps with no profiler; then the same steps under cProfile: the host's
functions of most own time, and mmsparse's of most time with their callees (where a rank's host time goes, when a
slower host makes the others wait at the exchange's barrier).

NVLink multicast is off, as in :mod:`.cp_nccl`. Writes ``DIR/cp_timeline.{json,md}`` (default
``benchmarks/results/<gpu>/``): one row per (config, GPUs, rank), and the slowest rank's lists. Without CUDA (or with
``--device cpu``) it runs over gloo on ``tiny_cyclic``: there are no GPU events, every time but the host's is 0; a
check that the tool works.

    torchrun --nproc-per-node 4 -m benchmarks.cp_timeline --configs mm43k_cyclic
    torchrun --nproc-per-node 2 -m benchmarks.cp_timeline --configs mm43k_cyclic --keep-fetched-kv false
    torchrun --nproc-per-node 2 -m benchmarks.cp_timeline --device cpu --out /tmp/cpt
"""

from __future__ import annotations

import bisect
import cProfile
import json
import os
import pstats
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter  # noqa: F401
from mmsparse.distributed import ContextParallel, release_peer_memory

from . import cp_dist
from .arguments import at_least_one
from .cp_cases import ALL_CASES, CPCase, rank_tool_parser
from .devices import sync
from .env import environment, record_dir
from .report import log, same_commit_rows, write_record

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's GPU activities (not gpu_user_annotation)
KINDS = ("exchange", "compute", "copy")
TOP = 8  # events listed by exchange-alone time and by total time
GAPS = 5  # idle gaps listed
HOST_TOP = 12  # host functions listed by own time and by mmsparse's cumulative time
KEEP = {"auto": None, "true": True, "false": False}  # None: the constructor's default

Interval = tuple[float, float]


class Event(NamedTuple):
    """One GPU activity of the trace, in µs."""

    name: str
    start: float
    end: float
    kind: str  # one of KINDS
    stream: int | None = None


def classify(name: str, category: str, args: dict[str, Any] | None = None, kernel_stream: bool = True) -> str:
    """The kind of a GPU event: ``exchange``, ``compute`` or ``copy``. ``kernel_stream``: whether the event's
    stream runs any kernel in the trace."""
    category, lowered = category.lower(), name.lower()
    if category == "kernel":
        return "exchange" if "nccl" in lowered else "compute"
    if category == "gpu_memcpy":
        if "ptop" in lowered:
            return "exchange"
        # A copy out of a peer's IPC-opened memory may be named DtoD: a CUPTI MEMCPY2 record names both devices
        # (torch's profiler asks for plain MEMCPY records, which do not), and the peer copies run on streams of
        # their own, where no kernel runs
        args = args or {}
        for src, dst in (("fromDevice", "toDevice"), ("srcDevice", "dstDevice")):
            if src in args and dst in args and args[src] != args[dst]:
                return "exchange"
        if "dtod" in lowered and not kernel_stream:
            return "exchange"
    return "copy"


def gpu_events(trace: dict[str, Any], device_index: int | None = None) -> list[Event]:
    """The GPU events of a chrome trace (``prof.export_chrome_trace``'s JSON), sorted by start; with
    ``device_index``, only those its arguments place on that device (where they say)."""
    raw = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in GPU_CATEGORIES or "dur" not in e:
            continue
        args = e.get("args") or {}
        device = args.get("device", args.get("inDevice"))
        if device_index is not None and isinstance(device, (int, float)) and int(device) != device_index:
            continue
        stream = args.get("stream", e.get("tid"))
        raw.append((e, args, int(stream) if isinstance(stream, (int, float)) else None))
    kernel_streams = {stream for e, _, stream in raw if str(e["cat"]).lower() == "kernel"}
    events = [Event(str(e.get("name", "")), float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                    classify(str(e.get("name", "")), str(e["cat"]), args, stream is None or stream in kernel_streams),
                    stream)
              for e, args, stream in raw]
    return sorted(events, key=lambda ev: (ev.start, ev.end))


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (touching ones joined)."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def union_us(intervals: Iterable[Interval]) -> float:
    """The length of the union of ``intervals``."""
    return sum(b - a for a, b in merge(intervals))


def subtract(keep: Sequence[Interval], remove: Sequence[Interval]) -> list[Interval]:
    """The parts of ``keep`` outside ``remove`` (both sorted and disjoint, as :func:`merge` gives them)."""
    out, j = [], 0
    for start, end in keep:
        while j < len(remove) and remove[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(remove) and remove[k][0] < end:
            if remove[k][0] > cursor:
                out.append((cursor, remove[k][0]))
            cursor = max(cursor, remove[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def covered_us(start: float, end: float, intervals: Sequence[Interval], starts: Sequence[float]) -> float:
    """How much of [start, end) lies in ``intervals`` (sorted, disjoint; ``starts`` their starts)."""
    total, i = 0.0, max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(intervals) and intervals[i][0] < end:
        total += max(0.0, min(end, intervals[i][1]) - max(start, intervals[i][0]))
        i += 1
    return total


def _ranked(times: dict[tuple[str, str], float], counts: dict[tuple[str, str], int], steps: int,
            n: int) -> list[dict[str, Any]]:
    best = sorted((item for item in times.items() if item[1] > 0), key=lambda item: -item[1])[:n]
    return [{"name": name, "kind": kind, "ms": us / steps / 1e3, "events": counts[name, kind] / steps}
            for (name, kind), us in best]


def idle_gaps(events: Sequence[Event], n: int = GAPS) -> list[dict[str, Any]]:
    """The ``n`` longest stretches with no GPU event, each with the event that ends at its start (``before``), the
    one that starts at its end (``after``) and its offset from the first event (``at_us``)."""
    ordered = sorted(events, key=lambda ev: (ev.start, ev.end))
    gaps, last = [], None  # last: the event of the latest end so far
    for event in ordered:
        if last is not None and event.start > last.end:
            gaps.append({"us": event.start - last.end, "at_us": last.end - ordered[0].start, "before": last.name,
                         "after": event.name})
        if last is None or event.end > last.end:
            last = event
    return sorted(gaps, key=lambda g: -g["us"])[:n]


def summarize(events: Sequence[Event], steps: int) -> dict[str, Any]:
    """The timeline's sums over the window of ``events`` (totals in µs, ``*_ms`` per step), the events that fill
    the exchange-alone time and the longest ones (per step), and the longest idle gaps. No events: all zeros."""
    steps = max(steps, 1)
    events = sorted(events, key=lambda ev: (ev.start, ev.end))
    # the window ends at the last event's end, which need not be the last to start
    span = max((ev.end for ev in events), default=0.0) - (events[0].start if events else 0.0)
    by_kind = {kind: merge((ev.start, ev.end) for ev in events if ev.kind == kind) for kind in KINDS}
    busy = union_us((ev.start, ev.end) for ev in events)
    exchange, compute = by_kind["exchange"], by_kind["compute"]
    both = union_us([*exchange, *compute])
    sums = {"span_us": span, "busy_us": busy, **{f"{kind}_us": union_us(by_kind[kind]) for kind in KINDS}}
    sums.update(exchange_alone_us=both - sums["compute_us"], compute_alone_us=both - sums["exchange_us"],
                overlap_us=sums["exchange_us"] + sums["compute_us"] - both, idle_us=span - busy)
    alone = subtract(exchange, compute)
    starts = [a for a, _ in alone]
    in_alone: dict[tuple[str, str], float] = defaultdict(float)
    total: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for ev in events:
        key = (ev.name, ev.kind)
        in_alone[key] += covered_us(ev.start, ev.end, alone, starts)
        total[key] += ev.end - ev.start
        counts[key] += 1
    per_step = {key.removesuffix("_us") + "_ms": value / steps / 1e3 for key, value in sums.items()}
    per_step["step_ms"] = per_step.pop("span_ms")
    return {**sums, **per_step, "steps": steps, "gpu_events": len(events),
            "exchange_alone_top": _ranked(in_alone, counts, steps, TOP), "top": _ranked(total, counts, steps, TOP),
            "idle_gaps": idle_gaps(events), "copies": copies(events, steps)}


def copies(events: Sequence[Event], steps: int) -> list[dict[str, Any]]:
    """Memcpys and memsets by (name, stream, kind), longest first, per step: how each was classified, to check the
    rules against what the profiler names a copy between GPUs."""
    time_by: dict[tuple[str, int | None, str], float] = defaultdict(float)
    count_by: dict[tuple[str, int | None, str], int] = defaultdict(int)
    for ev in events:
        if ev.name.lower().startswith(("memcpy", "memset")):
            time_by[ev.name, ev.stream, ev.kind] += ev.end - ev.start
            count_by[ev.name, ev.stream, ev.kind] += 1
    steps = max(steps, 1)
    return [{"name": name, "stream": stream, "kind": kind, "ms": us / steps / 1e3,
             "events": count_by[name, stream, kind] / steps}
            for (name, stream, kind), us in sorted(time_by.items(), key=lambda item: -item[1])]


def _build(case: CPCase, device: torch.device, dtype: torch.dtype,
           keep: bool | None) -> tuple[Callable[[], None], ContextParallel, torch.Tensor]:
    """(step, cp, k): one forward + backward of the rank's shard, its ``ContextParallel`` and its keys."""
    kwargs = {} if keep is None else {"keep_fetched_kv": keep}  # unset: the constructor's default
    cp = ContextParallel(case.topology, case.seg_lens, causal=case.causal, **kwargs)
    b, hq, hkv, d, s = case.batch, case.heads_q, case.heads_kv, case.head_dim, case.seq_len
    q, k, v, dout = cp_dist.shared_randn([(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d)], dtype,
                                         device, seed=0)
    index = cp.token_index.to(device)
    leaves = [t.index_select(2, index).requires_grad_() for t in (q, k, v)]
    dout = dout.index_select(2, index)
    del q, k, v  # the whole sequence's tensors: only the shards are needed

    def step() -> None:
        for t in leaves:
            t.grad = None
        out = cp.attention(*leaves)
        out.backward(dout)

    return step, cp, leaves[1]


def profile_steps(case: CPCase, device: torch.device, dtype: torch.dtype, keep: bool | None, steps: int,
                  warmup: int) -> dict[str, Any]:
    """This rank's row of ``case``: :func:`summarize` of ``steps`` profiled steps, and the host's time."""
    from torch.profiler import ProfilerActivity, profile

    step, cp, k = _build(case, device, dtype, keep)
    for _ in range(warmup):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cp_dist.barrier(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        queued = time.perf_counter()
        sync(device)
        done = time.perf_counter()
    handle, path = tempfile.mkstemp(prefix="cp_timeline-", suffix=".json")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        trace = json.loads(Path(path).read_text())
    finally:
        os.unlink(path)
    events = gpu_events(trace, device.index if device.type == "cuda" else None)
    row = {"config": case.name, "gpus": dist.get_world_size(), "rank": dist.get_rank(),
           "keeps_fetched_kv": cp.keeps_fetched_kv(k), "host_ms": (queued - t0) * 1e3 / steps,
           "wall_ms": (done - t0) * 1e3 / steps, **summarize(events, steps)}
    return {**row, **host_time(step, device, steps)}


def host_time(step: Callable[[], None], device: torch.device, steps: int) -> dict[str, Any]:
    """The host's time a step with no torch profiler (``host_plain_ms``: queueing ``steps`` steps back to back), and
    where it goes under cProfile: the functions of most own time (``host_self``) and mmsparse's functions of most
    time with their callees (``host_mmsparse``), in ms a step."""
    cp_dist.barrier(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    queued = time.perf_counter()
    sync(device)
    cp_dist.barrier(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    sync(device)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, ...)

    def ranked(index: int, keep: Callable[[str], bool]) -> list[dict[str, Any]]:
        chosen = sorted((v[index], f) for f, v in stats.items() if keep(f[0]))[::-1][:HOST_TOP]
        return [{"function": f"{Path(f[0]).name}:{f[1]}({f[2]})" if f[1] else f[2], "ms": t * 1e3 / steps,
                 "calls": stats[f][0] / steps} for t, f in chosen]

    return {"host_plain_ms": (queued - t0) * 1e3 / steps, "host_self": ranked(2, lambda _: True),
            "host_mmsparse": ranked(3, lambda path: f"{os.sep}mmsparse{os.sep}" in path)}


COLUMNS = ("step_ms", "host_ms", "host_plain_ms", "busy_ms", "compute_ms", "exchange_ms", "exchange_alone_ms",
           "compute_alone_ms", "overlap_ms", "idle_ms")


def _short(name: str, width: int = 90) -> str:
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[:width - 3] + "..."


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown, one line per (config, GPUs, rank), then the slowest rank's lists of each config."""
    lines = ["| config | GPUs | rank | keeps K/V | step ms | host ms | host ms, no profiler | busy | compute | "
             "exchange | exchange alone | compute alone | overlap | idle |",
             "|---|---:|---:|---|" + "---:|" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {r['config']} | {r['gpus']} | {r['rank']} | {r['keeps_fetched_kv']} | "
                     + " | ".join(f"{r[c]:.3f}" for c in COLUMNS) + " |")
    lines.append("")
    lines.append("Times in ms a step; step: first GPU event to last over the steps; host: the host's time to queue a "
                 "step, under the profiler and without it.")
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["config"], r["gpus"]].append(r)
    for (config, gpus), ranks in groups.items():
        worst = max(ranks, key=lambda r: (r["step_ms"], -r["rank"]))
        lines += ["", f"**{config}, {gpus} GPUs, rank {worst['rank']}** (the slowest): exchange alone "
                      f"{worst['exchange_alone_ms']:.3f} ms a step, filled by:", ""]
        lines += [f"- `{_short(e['name'])}` ({e['kind']}): {e['ms']:.3f} ms, {e['events']:g} a step"
                  for e in worst["exchange_alone_top"]] or ["- nothing"]
        lines += ["", "the longest events (ms a step):", ""]
        lines += [f"- `{_short(e['name'])}` ({e['kind']}): {e['ms']:.3f} ms, {e['events']:g} a step"
                  for e in worst["top"]] or ["- none"]
        lines += ["", "the longest idle gaps:", ""]
        lines += [f"- {g['us'] / 1e3:.3f} ms at {g['at_us'] / 1e3:.3f} ms: after `{_short(g['before'])}`, before "
                  f"`{_short(g['after'])}`" for g in worst["idle_gaps"]] or ["- none"]
        lines += ["", "memcpys and memsets (ms a step):", ""]
        lines += [f"- `{c['name']}` on stream {c['stream']} ({c['kind']}): {c['ms']:.3f} ms, {c['events']:g} a step"
                  for c in worst["copies"]] or ["- none"]
        for key, title in (("host_self", "the host's functions of most own time, under cProfile"),
                           ("host_mmsparse", "mmsparse's functions of most time with their callees, under cProfile")):
            lines += ["", f"{title} (ms a step):", ""]
            lines += [f"- `{_short(h['function'])}`: {h['ms']:.3f} ms, {h['calls']:g} calls a step"
                      for h in worst.get(key, [])] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = rank_tool_parser("cp_timeline", __doc__)
    parser.add_argument("--keep-fetched-kv", choices=tuple(KEEP), default="auto",
                        help="ContextParallel's keep_fetched_kv (default auto: the constructor's default)")
    parser.add_argument("--steps", type=at_least_one, default=None, help="profiled steps (default 5 on GPUs, 1 on "
                        "CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 3 on GPUs, 1 "
                        "on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="folder of cp_timeline.{json,md} (default: "
                        "benchmarks/results/<gpu>/)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    args = parser.parse_args(argv)
    nccl_env, device, dtype = cp_dist.start_ranks("cp_timeline", args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    steps = args.steps or (5 if cuda else 1)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    env = environment(device)
    rows = []
    for name in args.configs or (["mm43k_cyclic"] if cuda else ["tiny_cyclic"]):
        mine = profile_steps(ALL_CASES[name], device, dtype, KEEP[args.keep_fetched_kv], steps, warmup)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        rows += gathered
    if rank == 0:
        out = args.out or record_dir(env["gpu"], "cp_timeline")
        out.mkdir(parents=True, exist_ok=True)
        rows = same_commit_rows(out / "cp_timeline.json", env["commit"], rows) + rows
        record = {**env, "nccl": nccl_env, "dtype": str(dtype).removeprefix("torch."),
                  "keep_fetched_kv": args.keep_fetched_kv, "steps": steps, "warmup": warmup, "rows": rows}
        head = (f"Run: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
                f"{record['dtype']}; {nccl_env}; keep_fetched_kv {args.keep_fetched_kv}; {steps} profiled "
                "steps back to back.\n\n")
        body = table(rows)
        path = write_record(out, "cp_timeline", record, head + body)
        print(body, end="", flush=True)
        log(f"wrote {path} and its .md")
    release_peer_memory()  # a collective, before the group goes: the peer-copy slots the peers have opened
    cp_dist.barrier(device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
