"""Context parallelism on several GPUs over NCCL, against the same problem on one GPU and against an all-gather
baseline, in one run: ``torchrun --nproc-per-node N -m benchmarks.cp_nccl [--configs ...] [--out DIR]``.

NVLink multicast is turned off before NCCL starts (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``, each only where the environment does not set it already). Per run:

- **links**: all-gather bus bandwidth at 256 MiB a rank, send/recv from rank 0 to rank 1 (:mod:`.cp_links`);
- per config (:mod:`.cp_cases`) and impl (``mmsparse_cp``: ``ContextParallel`` with its defaults, which keep the
  fetched K/V for the backward below ``KEEP_FETCHED_MAX_BYTES``; ``mmsparse_cp_keep``: the same with
  ``keep_fetched_kv=True``, no second fetch in the backward; ``mmsparse_cp_refetch``: ``keep_fetched_kv=False``,
  the backward fetches again; ``mmsparse_cp_p2p``: the defaults with
  ``transport="p2p"``, NCCL's point to point where ``auto`` takes peer copies (``same_bits_as_p2p`` on the
  ``mmsparse_cp`` row: out and every gradient bitwise equal across the two); ``all_gather``: contiguous shards, K/V
  all-gathered, :mod:`.cp_allgather`):
  - **correctness**: out, dq, dk, dv against ``mbs_attention`` on the whole sequence with the same inputs (every
    rank runs it on its own GPU), relative L2 and max abs over the union of the shards; a second run must be
    bitwise equal;
  - **step time**: forward + backward, the slowest rank's time of each step, median over the steps;
    ``one_gpu_step_ms``: the whole problem's step on one GPU, timed in the same run by every rank on its own GPU at
    the same time (rank 0's median; every rank's in ``one_gpu_step_ms_ranks``); speedup = one_gpu / step. Each
    step starts with the ranks at a barrier and ends with a sync, so the host's time per step counts; ``step_b2b_ms``
    and ``one_gpu_step_b2b_ms`` time the same steps back to back with no sync between them (the host queues
    ahead, as in a model whose layers keep the GPU busy: the GPU's own time), ``speedup_b2b`` their ratio;
  - **overlap** (``mmsparse_cp``): the local attention of the rank's pieces alone (``compute_ms``, the gathered K/V
    already there, as ``tools.cp_local`` times it), the exchange alone (``exchange_ms``: K/V fetched for the forward
    and again for the backward unless the call keeps it, dK/dV returned), ``hidden_ms`` = compute + exchange - step,
    and ``hidden_fraction``, its share of the exchange;
  - **bytes** each rank sent and received in one step (``ContextParallel.bytes_sent`` / ``bytes_received``) against
    the plan's prediction (:func:`.cp_traffic.rank_bytes`); the all-gather baseline's are computed;
  - **model**: :func:`.cp_traffic.predicted_speedup` from this run's one-GPU step and send/recv bandwidth;
- **dropout with pair types** (:mod:`.cp_dropout`): the ranks draw the single-GPU mask bit for bit.

Writes ``DIR/cp_nccl.{json,md}`` (default ``benchmarks/results/<gpu>/``), merged by (config, GPUs) with the rows
already there of the same commit (rows of other commits are dropped): a 2-GPU run and a 4-GPU run fill one
record. A config whose estimated peak does not fit the free GPU memory is recorded as skipped. Without CUDA (or
with ``--device cpu``) it runs over gloo through Triton's interpreter on the ``tiny_*`` configs: a check that the
tool works, its times mean nothing. The exit status is 1 when a correctness check fails.

    torchrun --nproc-per-node 2 -m benchmarks.cp_nccl --configs mm43k_cyclic,hub_causal_256k,video_256k
    torchrun --nproc-per-node 4 -m benchmarks.cp_nccl --configs long_1m
    torchrun --nproc-per-node 2 -m benchmarks.cp_nccl --device cpu --out /tmp/cp     # tiny_hub_causal, gloo
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter
from mmsparse.distributed import ContextParallel

from . import cp_dist, cp_dropout, cp_links, cp_record
from .cp_allgather import AllGatherCP
from .cp_cases import ALL_CASES, CASES, DROPOUT_CASE, TINY_DROPOUT_CASE, CPCase, case_names
from .cp_rank import RankInputs, local_backward, local_forward
from .cp_record import IMPLS
from .cp_traffic import predicted_speedup, rank_bytes
from .env import environment, record_dir
from .report import log

NAMES = ("out", "dq", "dk", "dv")


class Problem:
    """A config's inputs on every rank, and the whole problem's result on this rank's GPU (the reference)."""

    def __init__(self, case: CPCase, device: torch.device, dtype: torch.dtype) -> None:
        self.case, self.device = case, device
        self.topology = mmsparse.Topology(case.topology)
        b, hq, hkv, d, s = case.batch, case.heads_q, case.heads_kv, case.head_dim, case.seq_len
        self.q, self.k, self.v, self.dout = cp_dist.shared_randn(
            [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d)], dtype, device, seed=0)
        for t in (self.q, self.k, self.v):
            t.requires_grad_()
        out = self.step()
        self.ref = {"out": out.detach(), "dq": self.q.grad, "dk": self.k.grad, "dv": self.v.grad}

    def step(self) -> torch.Tensor:
        """The whole problem's forward + backward on this GPU."""
        for t in (self.q, self.k, self.v):
            t.grad = None
        out = mmsparse.mbs_attention(self.q, self.k, self.v, self.topology, self.case.seg_lens,
                                     causal=self.case.causal)
        out.backward(self.dout)
        return out

    def inputs(self) -> list[torch.Tensor]:
        return [t.detach() for t in (self.q, self.k, self.v)]


def _check(step, leaves: list[torch.Tensor], ref: dict[str, torch.Tensor], pick, device: torch.device) -> dict:
    """Two steps: the errors of the second against the reference (``pick`` takes this rank's share of a reference
    tensor), and whether the two are bitwise equal on every rank."""
    first = [step().detach(), *(t.grad for t in leaves)]
    second = [step().detach(), *(t.grad for t in leaves)]
    equal = all(torch.equal(a, b) for a, b in zip(first, second))
    errors = {n: cp_dist.sharded_error(g, pick(ref[n]), device) for n, g in zip(NAMES, second)}
    return {**{f"{n}_rel_l2": e["rel_l2"] for n, e in errors.items()},
            **{f"{n}_max_abs": e["max_abs"] for n, e in errors.items()},
            "repeatable": cp_dist.all_ranks(equal, device), "_bits": second}


def _counts(case: CPCase, args: argparse.Namespace) -> tuple[int, int]:
    """(timed steps, untimed steps before them): the command line's, else the config's."""
    return (case.reps if args.reps is None else args.reps, case.warmup if args.warmup is None else args.warmup)


def _timed(fn, case: CPCase, device: torch.device, args: argparse.Namespace) -> tuple[float, list[float]]:
    """(the slowest rank's median, each rank's median) of ``fn``."""
    return cp_dist.slowest_rank_ms(cp_dist.timed_ms(fn, device, *_counts(case, args)), device)


def _back_to_back(fn, case: CPCase, device: torch.device, args: argparse.Namespace) -> float:
    """The slowest rank's time per call of ``fn``, called the config's timed steps back to back."""
    return cp_dist.reduce_value(_back_to_back_ms(fn, device, _counts(case, args)[0]), device, dist.ReduceOp.MAX)


def _back_to_back_ms(fn, device: torch.device, reps: int) -> float:
    """This rank's back-to-back time per call: the least of 3 runs of ``reps`` calls where steps are short (10
    timed steps or more), one run where a step takes seconds and the host's share is small anyway."""
    return cp_dist.back_to_back_ms(fn, device, reps, rounds=3 if reps >= 10 else 1)


def _step_fn(attention, leaves: list[torch.Tensor], dout: torch.Tensor):
    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        out = attention(*leaves)
        out.backward(dout)
        return out

    return step


def run_mmsparse(p: Problem, args: argparse.Namespace, bandwidth: float, keep_fetched_kv: bool | str = "auto",
                 transport: str = "auto") -> dict:
    """The ``mmsparse_cp`` row of a config (without its one-GPU fields); ``mmsparse_cp_keep`` and
    ``mmsparse_cp_refetch`` with ``keep_fetched_kv`` True and False (the K/V fetched in the forward kept for the
    backward, or fetched again), and ``mmsparse_cp_p2p`` with ``transport`` "p2p" (their step, check and bytes
    only)."""
    case, device = p.case, p.device
    cp = ContextParallel(case.topology, case.seg_lens, causal=case.causal, keep_fetched_kv=keep_fetched_kv,
                         transport=transport)
    index = cp.token_index.to(device)
    leaves = [t.index_select(2, index).requires_grad_() for t in p.inputs()]
    dout = p.dout.index_select(2, index)
    step = _step_fn(cp.attention, leaves, dout)
    cp.bytes_sent = cp.bytes_received = 0
    row = _check(step, leaves, p.ref, lambda t: t.index_select(2, index), device)
    sent, received = cp.bytes_sent // 2, cp.bytes_received // 2  # the two checked steps move the same bytes
    row["step_ms"], row["step_ms_ranks"] = _timed(step, case, device, args)
    row["step_b2b_ms"] = _back_to_back(step, case, device, args)

    element = p.q.element_size()
    dkv_element = torch.empty((), dtype=cp.kv_grad_dtype(p.q.dtype)).element_size()
    kv_token, dkv_token = (case.batch * 2 * case.heads_kv * case.head_dim * n for n in (element, dkv_element))
    kept = cp.keeps_fetched_kv(leaves[1])
    fetches = 1 if kept else 2
    plan = [rank_bytes(cp.plan.summary(1), r, kv_token, dkv_token, fetches) for r in range(cp.world_size)]
    measured = cp_dist.gather_lists([sent, received], device)
    row.update(
        bytes_sent=[int(m[0]) for m in measured], bytes_received=[int(m[1]) for m in measured],
        plan_bytes_sent=[s for s, _ in plan], plan_bytes_received=[r for _, r in plan],
        chunk=cp.plan.chunk, imbalance=cp.plan.imbalance(), model_bandwidth_gbs=bandwidth / 1e9,
        kept_fetched_kv=kept,
    )
    row["bytes_match"] = (row["bytes_sent"], row["bytes_received"]) == (row["plan_bytes_sent"],
                                                                         row["plan_bytes_received"])
    if keep_fetched_kv != "auto" or transport != "auto":
        return row

    q, k, v = (t.detach() for t in leaves)
    k_g, v_g = cp.fetch_kv(k, v)
    x = RankInputs(q, k, v, dout, k_g, v_g)
    scale = case.head_dim**-0.5

    def compute() -> None:
        out, lse = local_forward(cp, x, scale)
        local_backward(cp, x, out, lse, scale)

    # The backward's dK/dV as the attention has them: own keys' (float32; none in one piece) and gathered keys'
    dkv_l = None if cp.one_piece() else torch.zeros((case.batch, 2 * case.heads_kv, *k.shape[2:]),
                                                   dtype=torch.float32, device=device)
    dkv_g = torch.zeros((case.batch, 2 * case.heads_kv, *k_g.shape[2:]), dtype=cp.kv_grad_dtype(k.dtype),
                        device=device)

    def exchange() -> None:
        for _ in range(fetches):
            cp.fetch_kv(k, v)
        cp.return_kv_grads(dkv_g, dkv_l)

    row["compute_ms"], row["compute_ms_ranks"] = _timed(compute, case, device, args)
    row["exchange_ms"], row["exchange_ms_ranks"] = _timed(exchange, case, device, args)
    row["hidden_ms"] = row["compute_ms"] + row["exchange_ms"] - row["step_ms"]
    row["hidden_fraction"] = row["hidden_ms"] / row["exchange_ms"] if row["exchange_ms"] > 0 else None
    row["_summary"] = cp.plan.summary(kv_token)  # for the model, once the one-GPU time is known
    row["_dkv_ratio"] = dkv_element / element
    row["_fetches"] = fetches
    return row


def run_all_gather(p: Problem, args: argparse.Namespace) -> dict:
    """The ``all_gather`` row of a config (without its one-GPU fields)."""
    case, device = p.case, p.device
    ag = AllGatherCP(p.topology, case.seg_lens, case.causal, device)
    leaves = [ag.shard(t).requires_grad_() for t in p.inputs()]
    step = _step_fn(ag.attention, leaves, ag.shard(p.dout))
    row = _check(step, leaves, p.ref, ag.shard, device)
    row["step_ms"], row["step_ms_ranks"] = _timed(step, case, device, args)
    row["step_b2b_ms"] = _back_to_back(step, case, device, args)
    sent, received = ag.bytes_per_rank(case.batch, case.heads_kv, case.head_dim, p.q.element_size())
    row.update(bytes_sent=[sent] * ag.world_size, bytes_received=[received] * ag.world_size)
    return row


def run_case(case: CPCase, device: torch.device, dtype: torch.dtype, args: argparse.Namespace, links: dict,
             base: dict) -> list[dict]:
    """The config's rows: ``mmsparse_cp``, ``mmsparse_cp_keep``, ``mmsparse_cp_refetch``, ``mmsparse_cp_p2p`` and
    ``all_gather``, or one skipped row."""
    world = dist.get_world_size()
    rows = [{**base, "config": case.name, "gpus": world, "impl": impl, "layout": case.layout,
             "seq_len": case.seq_len, "shape": case.describe()} for impl in IMPLS]
    need = case.memory_bytes(world, torch.empty((), dtype=dtype).element_size())
    if device.type == "cuda":
        free = cp_dist.reduce_value(torch.cuda.mem_get_info(device)[0], device, dist.ReduceOp.MIN)
        if need > free:
            return [{**rows[0], "skipped": f"needs ~{need / 2**30:.0f} GiB per GPU, {free / 2**30:.0f} GiB free"}]
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    p = Problem(case, device, dtype)
    reps, warmup = _counts(case, args)
    single = cp_dist.timed_ms(p.step, device, reps, warmup)  # every rank at once, each on its own GPU
    single_ranks = [statistics.median(r) for r in cp_dist.gather_lists(single, device)]
    single_b2b = cp_dist.gather_lists([_back_to_back_ms(p.step, device, reps)], device)
    one_gpu = {"one_gpu_step_ms": single_ranks[0], "one_gpu_step_ms_ranks": single_ranks,
               "one_gpu_step_b2b_ms": single_b2b[0][0]}
    for t in (p.q, p.k, p.v):
        t.grad = None
    bandwidth = links["send_recv_gbs"] * 1e9
    done = [run_mmsparse(p, args, bandwidth), run_mmsparse(p, args, bandwidth, keep_fetched_kv=True),
            run_mmsparse(p, args, bandwidth, keep_fetched_kv=False),
            run_mmsparse(p, args, bandwidth, transport="p2p"), run_all_gather(p, args)]
    bits = [row.pop("_bits") for row in done]
    done[0]["same_bits_as_p2p"] = cp_dist.all_ranks(all(torch.equal(a, b) for a, b in zip(bits[0], bits[3])), device)
    del bits
    for row, result in zip(rows, done):
        row.update(result, **one_gpu, speedup=one_gpu["one_gpu_step_ms"] / result["step_ms"],
                   speedup_b2b=one_gpu["one_gpu_step_b2b_ms"] / result["step_b2b_ms"])
        row["correct"] = all(row[f"{n}_rel_l2"] <= args.tolerance for n in NAMES) and row.get(
            "same_bits_as_p2p", True)
    summary, dkv_ratio, fetches = (rows[0].pop(key) for key in ("_summary", "_dkv_ratio", "_fetches"))
    rows[0]["model_speedup"], rows[0]["model_speedup_overlap"] = predicted_speedup(
        summary, one_gpu["one_gpu_step_ms"] / 1e3, links["send_recv_gbs"] * 1e9, dkv_ratio, fetches)
    if device.type == "cuda":
        peak = cp_dist.reduce_value(torch.cuda.max_memory_allocated(device), device, dist.ReduceOp.MAX)
        for row in rows:
            row.update(peak_gib=peak / 2**30, estimate_gib=need / 2**30)
    for row in rows:
        row["seconds"] = time.perf_counter() - t0
    del p
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m benchmarks.cp_nccl",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=case_names, default=None,
                        help=f"comma-separated, from: {', '.join(ALL_CASES)} (default: {', '.join(CASES)} on GPUs, "
                             "tiny_hub_causal on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="folder of cp_nccl.{json,md} (default: "
                        "benchmarks/results/<gpu>/)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    parser.add_argument("--reps", type=int, default=None, help="timed steps of each measurement (default: per config)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default: per config)")
    parser.add_argument("--no-dropout-check", action="store_true", help="skip the dropout / pair types check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    nccl_env, device, dtype = cp_dist.start_ranks("cp_nccl", args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    args.tolerance = 2e-2 if cuda else 1e-4  # relative L2 against the single-GPU call
    names = args.configs or (list(CASES) if cuda else ["tiny_hub_causal"])
    env = environment(device)
    base = {**env, "nccl": nccl_env, "nccl_version": _nccl_version(cuda), "dtype": str(dtype).removeprefix("torch.")}
    if rank == 0:
        log(f"{world} ranks on {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; "
            f"{nccl_env}")
    links = {**base, "gpus": world, **cp_links.measure(device)}
    if rank == 0:
        log(f"links: all-gather bus bandwidth {links['all_gather_busbw_gbs']:.1f} GB/s at {links['message_mib']} MiB "
            f"a rank; send/recv rank 0 -> 1 {links['send_recv_gbs']:.1f} GB/s")
    rows = []
    for name in names:
        case = ALL_CASES[name]
        if rank == 0:
            log(f"== {name}: {case.describe()}")
        for row in run_case(case, device, dtype, args, links, base):
            rows.append(row)
            if rank == 0:
                log(cp_record.console_line(row))
    dropout = []
    if not args.no_dropout_check:
        check_case = DROPOUT_CASE if cuda else TINY_DROPOUT_CASE
        dropout = [{**base, "gpus": world, **cp_dropout.check(check_case, device, dtype, args.tolerance)}]
        if rank == 0:
            log(cp_record.dropout_line(dropout[0]))
    ok = all(r.get("correct", True) for r in rows) and all(d["ok"] for d in dropout)
    if rank == 0:
        out = args.out or record_dir(env["gpu"], "cp_nccl")
        record = cp_record.merge(out, {"rows": rows, "links": [links], "dropout": dropout}, env["commit"])
        table = cp_record.write(out, record)
        print(table, end="", flush=True)
        log(f"wrote {out / 'cp_nccl.json'} and its .md" + ("" if ok else "; a correctness check FAILED"))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _nccl_version(cuda: bool) -> str | None:
    if not cuda:
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


if __name__ == "__main__":
    raise SystemExit(main())
