"""The links between the ranks, measured where the context-parallel rows are: all-gather bus bandwidth at a large
message (as nccl-tests reports it) and the send/recv bandwidth from rank 0 to rank 1 (one direction, the others
idle): the bandwidth per direction that :mod:`benchmarks.cp_traffic` takes."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .cp_dist import all_gather_single, barrier, gather_lists, slowest_rank_ms, timed_ms

GPU_MIB, CPU_MIB = 256, 1  # bytes each rank contributes to the all-gather, and sends rank to rank
REPS, WARMUP = 10, 3


def measure(device: torch.device, mib: int | None = None) -> dict:
    """``all_gather_busbw_gbs``: all-gather of ``mib`` MiB a rank, bus bandwidth = (P - 1) / P x the gathered
    bytes / the slowest rank's time (median of :data:`REPS`); ``send_recv_gbs``: ``mib`` MiB from rank 0 to rank
    1 over the time rank 1 waits for them."""
    mib = mib or (GPU_MIB if device.type == "cuda" else CPU_MIB)
    world, rank = dist.get_world_size(), dist.get_rank()
    n = mib * 2**20 // 2
    mine = torch.ones(n, dtype=torch.bfloat16, device=device)
    gathered = torch.empty(world * n, dtype=torch.bfloat16, device=device)
    ag_ms, _ = slowest_rank_ms(timed_ms(lambda: all_gather_single(gathered, mine), device, REPS, WARMUP),
                               device)
    total = world * n * 2
    row = {"message_mib": mib, "all_gather_ms": ag_ms,
           "all_gather_busbw_gbs": total * (world - 1) / world / (ag_ms / 1e3) / 1e9}

    def send_recv() -> None:
        if rank == 0:
            dist.send(mine, dst=1)
        elif rank == 1:
            dist.recv(mine, src=0)

    sr_ms = gather_lists([statistics.median(timed_ms(send_recv, device, REPS, WARMUP))], device)[1][0]
    row.update(send_recv_ms=sr_ms, send_recv_gbs=n * 2 / (sr_ms / 1e3) / 1e9)
    barrier(device)
    return row

