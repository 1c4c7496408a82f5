"""Context parallel x data parallel training against one GPU, and its bitwise repeatability:
``torchrun --nproc-per-node 4 -m benchmarks.cp_fsdp [--out DIR]``.

A 2-D ``DeviceMesh`` (``dp`` x ``cp``, default 2 x P/2): FSDP2's ``fully_shard`` shards the weights over ``dp``,
``ContextParallel`` the sequence over ``cp``. The model (:mod:`.cp_fsdp_model`: a few pre-norm blocks, bf16 compute
on GPUs, float32 weights) trains for 50 steps with AdamW on synthetic token streams of a hub topology, causal;
each dp rank takes its own sequence of the step, and the cp ranks' gradients are summed over ``cp`` after FSDP's
average over ``dp`` (docs/context_parallel.md, "With FSDP2 and a 2-D mesh"). Rank 0 then trains the same model
(same initial weights, the same sequences as one batch of dp) alone, while the others wait; then the CP x DP run
is repeated from scratch. Recorded: the three loss curves, the largest absolute and relative difference between
the single-GPU and the CP x DP curve, and whether the two CP x DP runs agree bit for bit (losses and final
weights). Writes ``DIR/cp_fsdp.{json,md}`` (default ``benchmarks/results/<gpu>/``).

Deterministic reductions. NCCL sums in an order set by its algorithm (ring, tree, NVLS), its protocol (LL, LL128,
Simple: how a buffer is cut into steps), its number of channels (how a buffer is split over parallel rings) and
its buffer size; it picks the first three per message size from a model of the topology it detects. With the same
machine and sizes that choice repeats, but it is not a contract, so the tool pins it (``os.environ.setdefault``
before NCCL starts, recorded with the results):

- ``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple``: one reduction order for every size, whatever the tuner would pick;
- ``NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS=4``: the split over rings fixed, not derived from the detected links;
- ``NCCL_NVLS_ENABLE=0`` (and torch's and NVSHMEM's multicast off): NVLink SHARP reduces inside the switch;
- ``NCCL_BUFFSIZE`` left at its default (4 MiB): it sets the chunking too;

then bitwise repeatability holds for a fixed GPU count, NCCL version and launch, not across them (a different
number of ranks sums in another order). ContextParallel itself needs none of this: it moves K/V and dK/dV point
to point and sums on the owner in a fixed order; the pins are for FSDP's all-gather/reduce-scatter and the
gradient all-reduce over ``cp``. On the GPU, ``torch.use_deterministic_algorithms(True, warn_only=True)`` with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS needs it for repeatable matmuls); ops that warn are listed in the
record. Without CUDA the processes run over gloo through Triton's interpreter (``--tiny``): a check that the
script works.

    torchrun --nproc-per-node 4 -m benchmarks.cp_fsdp                      # dp 2 x cp 2, 50 steps
    torchrun --nproc-per-node 4 -m benchmarks.cp_fsdp --device cpu --tiny --steps 2 --out /tmp/f
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter
from mmsparse.distributed import ContextParallel

from . import cp_dist
from .configs import HUB
from .cp_fsdp_model import ModelShape, MultimodalLM, labels_of, loss_sum, segment_ids, synthetic_batches
from .env import environment, record_dir
from .report import log, write_record

TOPIC = "cp_fsdp"
DETERMINISTIC_NCCL = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "4",
                      "NCCL_MAX_NCHANNELS": "4", **cp_dist.MULTICAST_OFF}
GPU_SHAPE = ModelShape(vocab=512, dim=512, heads=8, kv_heads=4, head_dim=64, layers=4, seg_lens=(1024, 5120, 2048))
TINY_SHAPE = ModelShape(vocab=32, dim=32, heads=2, kv_heads=1, head_dim=16, layers=1, seg_lens=(8, 20, 12))
LR, SEED = 1e-3, 0


class Data:
    """Every step's sequences (one per dp rank) with their labels, positions and segments, ``[steps, dp, S]``."""

    def __init__(self, shape: ModelShape, steps: int, dp: int, device: torch.device) -> None:
        self.ids = synthetic_batches(steps, dp, shape, SEED).to(device)
        self.labels = labels_of(self.ids)
        self.positions = torch.arange(shape.seq_len, device=device).expand_as(self.ids)
        self.segments = segment_ids(shape.seg_lens).to(device).expand_as(self.ids)
        self.label_count = int((self.labels[0, 0] != -100).sum())  # per sequence


def _model(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> MultimodalLM:
    torch.manual_seed(SEED)  # the same initial weights on every rank and in every run
    return MultimodalLM(shape, dtype).to(device)


def train_single(shape: ModelShape, data: Data, steps: int, dtype: torch.dtype, device: torch.device) -> list[float]:
    """One GPU, the dp sequences of each step as one batch: the loss curve."""
    model = _model(shape, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mmsparse.mbs_attention(q, k, v, HUB, shape.seg_lens, causal=True)

    losses = []
    for step in range(steps):
        logits = model(data.ids[step], data.positions[step], data.segments[step], attend)
        loss = loss_sum(logits, data.labels[step]) / (data.label_count * data.ids.shape[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_cp_dp(shape: ModelShape, data: Data, steps: int, dtype: torch.dtype, mesh: DeviceMesh,
                device: torch.device) -> tuple[list[float], list[torch.Tensor]]:
    """CP x DP on ``mesh``: the loss curve (the mean over the dp sequences, as the single run's) and the final
    weights (each rank's shards)."""
    from torch.distributed.fsdp import fully_shard

    model = _model(shape, dtype, device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    cp = ContextParallel(HUB, shape.seg_lens, causal=True, group=mesh["cp"])
    cp_group, dp_rank, dp = mesh["cp"].get_group(), mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses = []
    for step in range(steps):
        ids, positions, segments, labels = (cp.shard(t[step, dp_rank][None], seq_dim=1)
                                            for t in (data.ids, data.positions, data.segments, data.labels))
        # each cp rank's share of its sequence's mean loss: the shares add up over cp
        loss = loss_sum(model(ids, positions, segments, cp.attention), labels) / data.label_count
        loss.backward()
        for p in model.parameters():  # FSDP averaged over dp; the cp ranks hold parts of one sequence's loss
            dist.all_reduce(p.grad.to_local(), group=cp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach() / dp
        dist.all_reduce(total)  # sum over cp, mean over dp
        losses.append(total.item())
    return losses, [p.detach().to_local().clone() for p in model.parameters()]


def _differences(a: list[float], b: list[float]) -> dict[str, float]:
    abs_diff = [abs(x - y) for x, y in zip(a, b)]
    return {"max_abs_diff": max(abs_diff), "max_rel_diff": max(d / max(abs(y), 1e-30) for d, y in zip(abs_diff, b))}


def markdown(row: dict) -> str:
    lines = [f"Run: {row['gpu']}, torch {row['torch']}, triton {row['triton']}, commit {row['commit']}. "
             f"{row['gpus']} processes, mesh dp {row['dp']} x cp {row['cp']}; model {row['model']}; "
             f"{row['steps']} steps, AdamW lr {row['lr']}, {row['dtype']} compute.", "",
             f"NCCL environment: {row['nccl']}; deterministic algorithms: {row['deterministic_algorithms']}; "
             f"ops that warned: {row['nondeterministic_ops'] or 'none'}.", "",
             "| | value |", "|---|---|",
             f"| max abs difference, one GPU vs CP x DP | {row['max_abs_diff']:.3e} |",
             f"| max relative difference | {row['max_rel_diff']:.3e} |",
             f"| second CP x DP run bitwise equal (losses / weights) | {row['repeatable_losses']} / "
             f"{row['repeatable_weights']} |",
             f"| s a step: one GPU (first calls included) / CP x DP (second run) | {row['single_s_per_step']:.4f} / "
             f"{row['cp_dp_s_per_step']:.4f} |",
             "", "| step | one GPU | CP x DP | CP x DP again |", "|---:|---:|---:|---:|"]
    for i, (a, b, c) in enumerate(zip(row["losses_single"], row["losses_cp_dp"], row["losses_cp_dp_again"])):
        lines.append(f"| {i} | {a:.6f} | {b:.6f} | {c:.6f} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node 4 -m benchmarks.cp_fsdp",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (cp = world / dp)")
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke test's model and lengths")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    parser.add_argument("--out", type=Path, default=None, help=f"folder of {TOPIC}.{{json,md}}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    nccl_env = cp_dist.set_environment(DETERMINISTIC_NCCL)  # before NCCL starts
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = cp_dist.start(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.dp or world // args.dp < 2:
        raise SystemExit(f"{world} ranks do not make dp {args.dp} x cp >= 2")
    mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "cp"))
    shape = TINY_SHAPE if args.tiny or not cuda else GPU_SHAPE
    dtype = torch.bfloat16 if cuda else torch.float32
    data = Data(shape, args.steps, args.dp, device)
    env = environment(device)
    if rank == 0:
        log(f"{world} ranks, dp {args.dp} x cp {world // args.dp}, {env['gpu']}; {shape}; NCCL {nccl_env}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, weights = train_cp_dp(shape, data, args.steps, dtype, mesh, device)
        t0 = time.perf_counter()  # the second run: the kernels are compiled
        again, weights_again = train_cp_dp(shape, data, args.steps, dtype, mesh, device)
        cp_dp_s = (time.perf_counter() - t0) / args.steps
        single, single_s = [], 0.0
        if rank == 0:  # the others wait at the barrier below
            t0 = time.perf_counter()
            single = train_single(shape, data, args.steps, dtype, device)
            single_s = (time.perf_counter() - t0) / args.steps
        cp_dist.barrier(device)
    flagged = sorted({str(w.message).split(".")[0][:160] for w in caught if "deterministic" in str(w.message)})
    same_losses = cp_dist.all_ranks(losses == again, device)
    same_weights = cp_dist.all_ranks(all(torch.equal(a, b) for a, b in zip(weights, weights_again)), device)
    ok = same_losses and same_weights
    if rank == 0:
        row = {**env, "gpus": world, "dp": args.dp, "cp": world // args.dp, "model": str(shape), "steps": args.steps,
               "lr": LR, "dtype": str(dtype).removeprefix("torch."), "nccl": nccl_env,
               "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
               "deterministic_algorithms": "on, warn only" if cuda else "off (CPU)",
               "nondeterministic_ops": flagged, "losses_single": single, "losses_cp_dp": losses,
               "losses_cp_dp_again": again, **_differences(losses, single), "repeatable_losses": same_losses,
               "repeatable_weights": same_weights, "single_s_per_step": single_s, "cp_dp_s_per_step": cp_dp_s}
        table = markdown(row)
        print(table, end="", flush=True)
        out = args.out or record_dir(env["gpu"], TOPIC)
        out.mkdir(parents=True, exist_ok=True)
        write_record(out, TOPIC, [row], table)
        log(f"wrote {out / (TOPIC + '.json')} and its .md" + ("" if ok else "; the CP x DP runs DIFFER"))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
