"""Where context parallelism's exchange goes, phase by phase, against other ways to move the same bytes:
``torchrun --nproc-per-node N -m benchmarks.cp_phases [--configs ...] [--out DIR]``.

A step's exchange is three phases, each synchronised over the ranks: the forward's K/V fetch, the backward's fetch
(the same bytes again, unless ``keep_fetched_kv``) and the return of dK/dV. Per config and phase:

- **bytes**: the message from each rank to each other rank, from the plan (``sizes``, row: sender), checked against
  ``ContextParallel``'s own counters over one call (``bytes_match``);
- **the phase** as ``ContextParallel`` runs it by default (``phase_ms``: with ``transport="auto"``, peer copies on
  GPUs of one host, point to point elsewhere; the slowest rank's median over calls that each start at a barrier),
  and with ``transport="p2p"`` (``phase_p2p_ms``: packing, NCCL's point to point, unpacking);
- **the same messages moved three ways**, raw buffers, timed alike:
  - ``p2p``: NCCL's batched isend/irecv to every peer at once (the transfer ``ContextParallel`` uses);
  - ``all_gather``: one all-gather in which each rank gives its largest message to the phase (each rank receives
    P - 1 of them: at least what the phase moves);
  - ``copy_engine``: each rank pulls its messages out of the peers' memory with copy engines, one stream per peer
    (buffers shared by CUDA IPC, ``cudaMemcpyPeerAsync`` over NVLink, no SMs); ``None`` with the reason where it
    cannot run (gloo);
- **GB/s** of each: the most bytes a rank received, over the slowest rank's time; ``phase_share``: the phase's GB/s
  over the fastest way's.

NVLink multicast is off, as in :mod:`.cp_nccl`. Writes ``DIR/cp_phases.{json,md}`` (default
``benchmarks/results/<gpu>/``). Without CUDA (or with ``--device cpu``) it runs over gloo on ``tiny_cyclic``: a check
that the tool works, its times mean nothing.

    torchrun --nproc-per-node 2 -m benchmarks.cp_phases --configs mm43k_cyclic
    torchrun --nproc-per-node 2 -m benchmarks.cp_phases --device cpu --out /tmp/cp
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter  # noqa: F401
from mmsparse.distributed import ContextParallel

from . import cp_dist
from .cp_cases import ALL_CASES, CPCase, rank_tool_parser
from .env import environment, record_dir
from .report import log, same_commit_rows

PHASES = ("fetch", "return")  # a step runs the fetch twice (once with keep_fetched_kv) and the return once
WAYS = ("p2p", "all_gather", "copy_engine")
MiB = 2**20


def token_matrix(cp: ContextParallel) -> list[list[int]]:
    """``m[a][b]``: the key tokens rank ``a`` owns that rank ``b``'s queries see (a fetch sends them from a to b, the
    return sends their gradients from b to a)."""
    plan = cp.plan
    return [[0 if a == b else sum(plan.chunk_tokens(c) for c in plan.needed_kv[b] if plan.owner[c] == a)
             for b in range(cp.world_size)] for a in range(cp.world_size)]


def message_bytes(tokens: list[list[int]], token_bytes: int, phase: str) -> list[list[int]]:
    """``sizes[a][b]``: the bytes rank ``a`` sends rank ``b`` in ``phase``."""
    if phase == "fetch":
        return [[n * token_bytes for n in row] for row in tokens]
    return [[tokens[b][a] * token_bytes for b in range(len(tokens))] for a in range(len(tokens))]


def _p2p(sizes: list[list[int]], rank: int, device: torch.device) -> Callable[[], None]:
    """Every message of ``sizes`` at once by NCCL's batched isend/irecv (gloo's on a CPU)."""
    world = len(sizes)
    sends = {p: torch.empty(sizes[rank][p], dtype=torch.uint8, device=device) for p in range(world) if sizes[rank][p]}
    recvs = {p: torch.empty(sizes[p][rank], dtype=torch.uint8, device=device) for p in range(world) if sizes[p][rank]}

    def move() -> None:
        ops = [dist.P2POp(dist.isend, t, p) for p, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, p) for p, t in recvs.items()]
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
    return move


def _all_gather(sizes: list[list[int]], device: torch.device) -> Callable[[], None]:
    """One all-gather of the phase's largest message from every rank."""
    largest = max(max(row) for row in sizes)
    mine = torch.empty(largest, dtype=torch.uint8, device=device)
    gathered = torch.empty(len(sizes) * largest, dtype=torch.uint8, device=device)
    return lambda: cp_dist.all_gather_single(gathered, mine)


def _copy_engine(sizes: list[list[int]], rank: int, device: torch.device) -> Callable[[], None]:
    """Each rank pulls its messages out of the peers' memory, each peer's on a stream of its own: a rank's buffer
    holds its messages to every rank end to end (``sizes`` row order), shared with the other processes by CUDA IPC,
    and a copy between two GPUs' tensors is ``cudaMemcpyPeerAsync``: copy engines over NVLink, no SMs."""
    if device.type != "cuda":
        raise RuntimeError("copy engines between GPUs: needs CUDA")
    from torch.multiprocessing.reductions import reduce_tensor

    world = len(sizes)
    buffer = torch.empty(max(1, sum(sizes[rank])), dtype=torch.uint8, device=device)
    handles: list[Any] = [None] * world
    dist.all_gather_object(handles, reduce_tensor(buffer))
    pulls = []
    for peer in range(world):
        n = sizes[peer][rank]
        if peer != rank and n:
            rebuild, rebuild_args = handles[peer]
            offset = sum(sizes[peer][:rank])
            source = rebuild(*rebuild_args)[offset:offset + n]  # on the peer's GPU, opened in this process
            pulls.append((torch.cuda.Stream(device), source, torch.empty(n, dtype=torch.uint8, device=device)))
    cp_dist.barrier(device)
    return _Pulls(device, pulls, (buffer, handles))


class _Pulls:
    """Each ``(stream, source, target)`` copy on its stream after the current stream's work, which then waits for
    them all. ``shared``: the rank's own buffer, which the peers read, and the handles it was shared by, held as
    long as the copies may run."""

    def __init__(self, device: torch.device, pulls: list[tuple[Any, torch.Tensor, torch.Tensor]],
                 shared: tuple[torch.Tensor, list[Any]]) -> None:
        self.device, self.pulls, self.shared = device, pulls, shared

    def __call__(self) -> None:
        main = torch.cuda.current_stream(self.device)
        for stream, source, target in self.pulls:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
        for stream, _, _ in self.pulls:
            main.wait_stream(stream)


def _mover(way: str, sizes: list[list[int]], rank: int, device: torch.device) -> Callable[[], None]:
    if way == "p2p":
        return _p2p(sizes, rank, device)
    if way == "all_gather":
        return _all_gather(sizes, device)
    return _copy_engine(sizes, rank, device)


def _time_ways(sizes: list[list[int]], received: int, rank: int, device: torch.device, reps: int,
               warmup: int) -> dict[str, Any]:
    """``<way>_ms`` and ``<way>_gbs`` of each way to move ``sizes``; None and ``<way>_problem`` where a rank cannot
    run it."""
    world, fields = len(sizes), {}
    for way in WAYS:
        problem = None
        try:
            move = _mover(way, sizes, rank, device)
        except Exception as err:  # noqa: BLE001  (recorded: a way this machine cannot run)
            move, problem = None, f"{type(err).__name__}: {err}"
        if not cp_dist.all_ranks(move is not None, device):
            fields.update({f"{way}_ms": None, f"{way}_gbs": None,
                           f"{way}_problem": problem or "another rank could not run it"})
            continue
        ms, _ = cp_dist.slowest_rank_ms(cp_dist.timed_ms(move, device, reps, warmup), device)
        # the all-gather gives each rank P - 1 messages of the largest size
        moved = (world - 1) * max(max(r) for r in sizes) if way == "all_gather" else received
        fields.update({f"{way}_ms": ms, f"{way}_gbs": _gbs(moved, ms)})
    return fields


def _gbs(received: int, ms: float) -> float:
    return received / (ms / 1e3) / 1e9 if ms > 0 else float("inf")


def measure_phases(case: CPCase, device: torch.device, dtype: torch.dtype, reps: int, warmup: int) -> list[dict]:
    """One row per phase of ``case`` on this group (every rank calls it; every rank gets the same rows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = ContextParallel(case.topology, case.seg_lens, causal=case.causal)
    b, hkv, d = case.batch, case.heads_kv, case.head_dim
    k, v = cp_dist.shared_randn([(b, hkv, case.seq_len, d)] * 2, dtype, device, seed=1)
    k, v = cp.shard(k), cp.shard(v)
    k_gathered, _ = cp.fetch_kv(k, v)
    wire = cp.kv_grad_dtype(dtype)
    dkv_gathered = torch.zeros((b, 2 * hkv, k_gathered.shape[2], d), dtype=wire, device=device)
    dkv_local = None if cp.one_piece() else torch.zeros((b, 2 * hkv, *k.shape[2:]), dtype=torch.float32,
                                                        device=device)
    tokens = token_matrix(cp)
    element = {"fetch": torch.empty((), dtype=dtype).element_size(),
               "return": torch.empty((), dtype=wire).element_size()}
    by_p2p = ContextParallel(case.topology, case.seg_lens, causal=case.causal, transport="p2p")
    calls = {"fetch": lambda: cp.fetch_kv(k, v), "return": lambda: cp.return_kv_grads(dkv_gathered, dkv_local)}
    p2p_calls = {"fetch": lambda: by_p2p.fetch_kv(k, v),
                 "return": lambda: by_p2p.return_kv_grads(dkv_gathered, dkv_local)}
    rows = []
    for phase in PHASES:
        sizes = message_bytes(tokens, b * 2 * hkv * d * element[phase], phase)
        cp.bytes_sent = cp.bytes_received = 0
        calls[phase]()
        counted = cp_dist.gather_lists([cp.bytes_sent, cp.bytes_received], device)
        received_by = [sum(row[r] for row in sizes) for r in range(world)]
        planned = [[sum(sizes[r]), received_by[r]] for r in range(world)]
        received = max(received_by)
        row: dict[str, Any] = {
            "config": case.name, "gpus": world, "phase": phase, "sizes": sizes,
            "bytes_match": [[int(x) for x in c] for c in counted] == planned,
            "received_max_bytes": received, "message_max_bytes": max(max(r) for r in sizes),
        }
        row["phase_ms"], row["phase_ms_ranks"] = cp_dist.slowest_rank_ms(
            cp_dist.timed_ms(calls[phase], device, reps, warmup), device)
        row["phase_gbs"] = _gbs(received, row["phase_ms"])
        row["phase_p2p_ms"], _ = cp_dist.slowest_rank_ms(cp_dist.timed_ms(p2p_calls[phase], device, reps, warmup),
                                                         device)
        row["phase_p2p_gbs"] = _gbs(received, row["phase_p2p_ms"])
        row.update(_time_ways(sizes, received, rank, device, reps, warmup))
        fastest = max(row[f"{w}_gbs"] for w in WAYS if row[f"{w}_gbs"] is not None)
        row["fastest_way"] = next(w for w in WAYS if row[f"{w}_gbs"] == fastest)
        row["phase_share"] = row["phase_gbs"] / fastest
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as markdown, one line per (config, GPUs, phase)."""
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["| config | GPUs | phase | MiB a rank receives (most) | largest message MiB | phase ms | phase GB/s | "
             "phase by p2p ms | p2p GB/s | all-gather GB/s | copy engines GB/s | fastest | phase / fastest | "
             "bytes match |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['gpus']} | {r['phase']} | {r['received_max_bytes'] / MiB:.1f} | "
                     f"{r['message_max_bytes'] / MiB:.1f} | {r['phase_ms']:.3f} | {num(r['phase_gbs'], '.1f')} | "
                     f"{r['phase_p2p_ms']:.3f} | "
                     f"{num(r['p2p_gbs'], '.1f')} | {num(r['all_gather_gbs'], '.1f')} | "
                     f"{num(r['copy_engine_gbs'], '.1f')} | {r['fastest_way']} | {r['phase_share']:.2f} | "
                     f"{r['bytes_match']} |")
    problems = sorted({f"{w}: {r[f'{w}_problem']}" for r in rows for w in WAYS if r.get(f"{w}_problem")})
    return "\n".join(lines + [""] + [f"- not run: {p}" for p in problems]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = rank_tool_parser("cp_phases", __doc__)
    parser.add_argument("--out", type=Path, default=None, help="folder of cp_phases.{json,md} (default: "
                        "benchmarks/results/<gpu>/)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    parser.add_argument("--reps", type=int, default=None, help="timed calls of each measurement (default 20 on "
                        "GPUs, 1 on CPU)")
    args = parser.parse_args(argv)
    nccl_env, device, dtype = cp_dist.start_ranks("cp_phases", args.device)
    cuda = device.type == "cuda"
    reps = args.reps or (20 if cuda else 1)
    env = environment(device)
    rows = []
    for name in args.configs or (["mm43k_cyclic"] if cuda else ["tiny_cyclic"]):
        rows += measure_phases(ALL_CASES[name], device, dtype, reps, warmup=3 if cuda else 0)
    if dist.get_rank() == 0:
        out = args.out or record_dir(env["gpu"], "cp_phases")
        out.mkdir(parents=True, exist_ok=True)
        record = {**env, "nccl": nccl_env, "dtype": str(dtype).removeprefix("torch."), "reps": reps,
                  "rows": same_commit_rows(out / "cp_phases.json", env["commit"], rows) + rows}
        (out / "cp_phases.json").write_text(json.dumps(record, indent=1))
        head = (f"Run: {env['gpu']}, torch {env['torch']}, commit {env['commit']}, "
                f"{record['dtype']}; {nccl_env}; medians of {reps} calls, each from a barrier, the slowest rank's "
                "time.\n\n")
        (out / "cp_phases.md").write_text(head + table(record["rows"]))
        print(table(rows), end="", flush=True)
        log(f"wrote {out / 'cp_phases.json'} and its .md")
    cp_dist.barrier(device)
    dist.destroy_process_group()
    return 0 if all(r["bytes_match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
