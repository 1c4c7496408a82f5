"""Whether a barrier between two ranks made of CUDA stream memory operations alone is safe: each rank writes a count
into its peer's memory (``cuStreamWriteValue32`` through CUDA IPC) and waits on its own (``cuStreamWaitValue32``),
with no kernel and no SM. Four checks, each under a host deadline (a hang is reported, not waited out):

- ``plain``: round trips on one stream of our own (does the wait see the peer's write; microseconds a round trip);
- ``beside_kernels``: round trips on a side stream while the compute stream runs matmuls that hold every SM and an
  NCCL all-reduce between them;
- ``collective_then_write``: a rank writes only after an NCCL collective on its compute stream, while the other
  waits on its side stream (the exchange's order);
- ``many_waiters``: 12 streams wait at once while the rank's own work goes on (more streams than the default
  ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues).

    torchrun --nproc-per-node 2 -m tools.cp_stream_waits [--deadline 25] [--out DIR]

Run it with ``CUDA_DEVICE_MAX_CONNECTIONS`` unset, 32 and 1; rank 0 writes ``cp_stream_waits_<connections>.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.env import environment, record_dir
from benchmarks.report import write_record

TOPIC = "cp_stream_waits"
WAITING_STREAMS = 12


def _wait_value(address: int, value: int, stream: int, device_index: int) -> None:
    """``stream`` waits until the 32-bit value at ``address`` is at least ``value`` (cuStreamWaitValue32)."""
    from mmsparse.runtime.cuda_driver import bind_context, call, driver

    wait = driver().cuStreamWaitValue32_v2
    wait.argtypes, wait.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint], ctypes.c_int
    bind_context(device_index)
    call("cuStreamWaitValue32_v2", ctypes.c_void_p(stream), ctypes.c_uint64(address), ctypes.c_uint32(value),
         ctypes.c_uint(0))  # flags 0: CU_STREAM_WAIT_VALUE_GEQ


class _Flags:
    """One int32 flag per rank in this rank's shared block (written by that rank) and the peer's block opened here."""

    def __init__(self, rank: int, device: torch.device) -> None:
        from mmsparse.runtime.ipc_memory import SharedBlock, open_block

        self.rank, self.peer, self.device = rank, 1 - rank, device
        self.block = SharedBlock(device, 4096)
        self.block.tensor.zero_()
        torch.cuda.synchronize(device)
        handles: list[Any] = [None, None]
        dist.all_gather_object(handles, self.block.handle)
        self.peer_address = open_block(handles[self.peer], device)
        self.count = 0

    def write(self, stream: torch.cuda.Stream, count: int) -> None:
        from mmsparse.runtime.cuda_driver import write_value_on_stream

        write_value_on_stream(self.peer_address + 4 * self.rank, count, stream.cuda_stream, self.device.index)

    def wait(self, stream: torch.cuda.Stream, count: int) -> None:
        _wait_value(self.block.address + 4 * self.peer, count, stream.cuda_stream, self.device.index)

    def seen(self) -> int:
        return int(self.block.tensor[:8].view(torch.int32)[self.peer].item())


def _checks(flags: _Flags, rank: int, device: torch.device, results: dict[str, Any]) -> None:
    """Run the four checks, each one's entry in ``results`` as it ends (a hang's report lists those before it)."""
    from mmsparse.runtime.streams import own_stream

    side = own_stream(device.index)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    token = torch.zeros(1, device=device)

    def busy(matmuls: int) -> None:
        nonlocal a
        for _ in range(matmuls):
            a = (a @ a).clamp_(-1, 1)

    rounds = 200
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(rounds):
        flags.count += 1
        flags.write(side, flags.count)
        flags.wait(side, flags.count)
    side.synchronize()
    results["plain"] = {"us_per_round": round((time.perf_counter() - start) / rounds * 1e6, 2),
                            "seen": flags.seen(), "expected": flags.count}
    start = time.perf_counter()
    for _ in range(20):
        compute = torch.cuda.current_stream(device)
        side.wait_stream(compute)
        busy(3)
        flags.count += 1
        flags.write(side, flags.count)
        flags.wait(side, flags.count)
        busy(3)
        compute.wait_stream(side)
        dist.all_reduce(token)
    torch.cuda.synchronize(device)
    results["beside_kernels"] = {"ms_per_iteration": round((time.perf_counter() - start) / 20 * 1e3, 3),
                                     "seen": flags.seen(), "expected": flags.count}
    for _ in range(20):
        compute = torch.cuda.current_stream(device)
        flags.count += 1
        if rank == 0:
            flags.wait(side, flags.count)
        busy(2)
        dist.all_reduce(token)
        flags.write(compute, flags.count)
        if rank == 1:
            flags.wait(side, flags.count)
        compute.wait_stream(side)
    torch.cuda.synchronize(device)
    results["collective_then_write"] = {"seen": flags.seen(), "expected": flags.count}
    waiting = [own_stream(device.index) for _ in range(WAITING_STREAMS)]
    flags.count += 1
    for stream in waiting:
        flags.wait(stream, flags.count)
    busy(4)
    dist.all_reduce(token)
    flags.write(torch.cuda.current_stream(device), flags.count)
    for stream in waiting:
        torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    results["many_waiters"] = {"seen": flags.seen(), "expected": flags.count}


def markdown(record: dict[str, Any]) -> str:
    lines = [f"Stream memory operations as a barrier between two ranks (`torchrun --nproc-per-node 2 -m "
             f"tools.cp_stream_waits`), `CUDA_DEVICE_MAX_CONNECTIONS={record['max_connections']}`. {record['gpu']}; "
             f"torch {record['torch']}, triton {record['triton']}; commit {record['commit']}.", "",
             "| check | result |", "|---|---|"]
    for name in ("plain", "beside_kernels", "collective_then_write", "many_waiters"):
        lines.append(f"| {name} | {json.dumps(record['checks'].get(name, 'hung (past the deadline)'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node 2 -m tools.cp_stream_waits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deadline", type=float, default=25.0, help="seconds before a hung check is reported")
    p.add_argument("--out", type=Path, default=None, help="folder of the record (default benchmarks/results/<gpu>/)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or os.environ.get("WORLD_SIZE") != "2":
        raise SystemExit("tools.cp_stream_waits needs two CUDA GPUs of one host, under torchrun --nproc-per-node 2")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    record: dict[str, Any] = {**environment(device), "checks": {},
                              "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")}
    out = args.out or record_dir(record["gpu"], TOPIC)
    suffix = record["max_connections"]

    def report_hang() -> None:  # past the deadline: the checks so far, and the one that hangs, then exit
        if rank == 0:
            write_record(out, f"{TOPIC}_{suffix}", record, markdown(record))
        print(json.dumps({"rank": rank, **record["checks"], "hung": True}), flush=True)
        os._exit(3)

    timer = threading.Timer(args.deadline, report_hang)
    timer.daemon = True
    timer.start()
    _checks(_Flags(rank, device), rank, device, record["checks"])
    timer.cancel()
    if rank == 0:
        print(f"-> {write_record(out, f'{TOPIC}_{suffix}', record, markdown(record))}")
    print(json.dumps({"rank": rank, **record["checks"]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
