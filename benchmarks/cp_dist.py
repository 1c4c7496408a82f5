"""Process-group chores of the multi-GPU tools: NCCL's environment, start-up, inputs every rank shares, step times
over the ranks, and errors summed over the ranks' shards.

Under ``torchrun`` each process drives the GPU of its ``LOCAL_RANK`` over NCCL; without CUDA (or with
``--device cpu``) the processes run on the CPU over gloo, the kernels through Triton's interpreter.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .devices import sync

# The GPU image's torch (2.11) has all_gather_into_tensor and reduce_scatter_tensor; later ones name them
# all_gather_single and reduce_scatter_single (the old names warn).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# NVLink multicast (NVLS) off for NCCL, torch's symmetric memory and NVSHMEM: the settings the recorded links and
# speedups were measured with (NVLS also changes NCCL's algorithms, hence its reduction order).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_environment(defaults: dict[str, str]) -> dict[str, str]:
    """``os.environ.setdefault`` for each variable (a value the caller set wins); call it before NCCL starts.
    Returns the values in force, for the record."""
    return {name: os.environ.setdefault(name, value) for name, value in defaults.items()}


def start(device_arg: str | None = None, timeout_s: float = 300) -> torch.device:
    """``init_process_group``: NCCL on the GPU of ``LOCAL_RANK``, or gloo on the CPU (``device_arg`` "cpu", or no
    CUDA). The launcher's variables (``torchrun``) say where the other ranks are. ``timeout_s``: how long a
    collective may wait for a stuck rank before the run fails (torch's default is 10 minutes; the longest wait
    here, a rank ahead of another by a step, is well under a minute)."""
    cuda = torch.cuda.is_available() and device_arg != "cpu"
    timeout = datetime.timedelta(seconds=timeout_s)
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def start_ranks(tool: str, device_arg: str | None = None) -> tuple[dict[str, str], torch.device, torch.dtype]:
    """A multi-GPU tool's start: NVLink multicast off (:data:`MULTICAST_OFF`, before NCCL starts), the process group
    (:func:`start`), and its dtype (bf16 on GPUs, float32 on the CPU). Returns (the NCCL settings in force, the
    device, the dtype); a SystemExit that says how to launch ``tool`` (``benchmarks.<tool>``) with fewer than 2
    ranks."""
    nccl_env = set_environment(MULTICAST_OFF)
    device = start(device_arg)
    if dist.get_world_size() < 2:
        dist.destroy_process_group()
        raise SystemExit(f"{tool} needs 2 ranks or more: torchrun --nproc-per-node N -m benchmarks.{tool}")
    return nccl_env, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def barrier(device: torch.device) -> None:
    """Every rank here, and its device idle."""
    sync(device)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    sync(device)


def timed_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 0) -> list[float]:
    """This rank's wall time of ``fn`` in ms, ``reps`` times after ``warmup`` untimed calls; every call starts
    with all ranks at a barrier and ends when this rank's device is done."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        barrier(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def back_to_back_ms(fn: Callable[[], Any], device: torch.device, calls: int, rounds: int = 3) -> float:
    """This rank's time per call of ``fn`` called ``calls`` times back to back, with no sync between calls (the
    host queues ahead, so the device's own time shows, not the host's), the least of ``rounds`` runs that each
    start with all ranks at a barrier."""
    best = float("inf")
    for _ in range(rounds):
        barrier(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) * 1e3 / calls)
    return best


def gather_lists(values: Sequence[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (one length on all ranks), by rank."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def slowest_rank_ms(times: Sequence[float], device: torch.device) -> tuple[float, list[float]]:
    """(median over the calls of the slowest rank's time of each call, each rank's median): a step ends when its
    last rank is done."""
    per_rank = gather_lists(times, device)
    worst = [max(column) for column in zip(*per_rank)]
    return statistics.median(worst), [statistics.median(r) for r in per_rank]


def reduce_value(value: float, device: torch.device, op: Any = None) -> float:
    """``value`` reduced over the ranks (sum by default)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op)
    return float(t.item())


def all_ranks(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank."""
    return reduce_value(1.0 if flag else 0.0, device, dist.ReduceOp.MIN) == 1.0


def shared_randn(shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device,
                 seed: int) -> list[torch.Tensor]:
    """Standard normal tensors of ``shapes``, the same on every rank: drawn on rank 0 and broadcast."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for shape in shapes:
        t = (torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype) if dist.get_rank() == 0
             else torch.empty(tuple(shape), device=device, dtype=dtype))
        dist.broadcast(t, src=0)
        out.append(t)
    return out


def sharded_error(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Relative L2 error and max abs error of the whole tensor whose shard on this rank is ``got`` (against
    ``want``, the same shard of the reference): sums of squares over every rank's shard, one head at a time (no
    float32 copy of a whole shard)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    worst = torch.zeros(1, dtype=torch.float64, device=device)
    for h in range(got.shape[1]):
        a, b = got[:, h].double(), want[:, h].double()
        sums[0] += (a - b).square().sum()
        sums[1] += b.square().sum()
        if a.numel():
            worst = torch.maximum(worst, (a - b).abs().max().reshape(1))
    dist.all_reduce(sums)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    err, ref = sums.tolist()
    return {"rel_l2": (err**0.5) / max(ref**0.5, 1e-30), "max_abs": float(worst.item())}
