"""Context parallelism on CPU: 2, 3 and 4 processes over gloo, through Triton's interpreter.

Each world size is spawned once and runs its cases inside (two ranks all of them, three and four a sample). A case
shards full inputs, runs ``cp.attention`` forward and backward on each rank, puts the gradients back together, and
checks them (once, on the group's rank 0: every rank holds the same whole tensors) against the float64 reference and
the single-process ``mbs_attention``. With dropout the reference is the single-process call with the same seed: the
ranks draw the bits of the same global positions. At these sizes the default keeps the fetched K/V for the
backward; in a sample of the cases (``REFETCH_BY_WORLD``) a second run fetches it again (``keep_fetched_kv=False``)
and must be bitwise equal to the first on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import CYCLIC, HUB, REPO, check_outputs

pytestmark = pytest.mark.long_module  # spawned worlds of 2 and 3 ranks through the interpreter: minutes

CASES = [
    # topology, seg_lens, causal, batch, heads, kv heads, dtype[, dropout_p[, window]]
    ([[1, 0, 1], [1, 1, 0], [0, 1, 1]], (9, 30, 21), False, 1, 2, 2, torch.float32),
    (HUB, (12, 0, 41), True, 1, 4, 2, torch.float32),
    (CYCLIC, [(9, 30, 21), (5, 20, 10)], True, 2, 2, 1, torch.float16),
    # the second segment attends nothing; half precision: the dK/dV return travels in it (one piece a rank)
    ([[1, 1], [0, 0]], (37, 20), False, 1, 2, 1, torch.float16),
    # pair types: text causal over itself, the image full within itself and over the text before it
    ([[2, 0, 0], [1, 1, 0], [1, 2, 2]], (20, 25, 18), False, 1, 2, 1, torch.float32),
    ([[2, 1, 0], [0, 2, 1], [1, 0, 2]], [(20, 25, 18), (5, 40, 3)], True, 2, 2, 2, torch.float32),
    # dropout: bits with gathered keys, causal per-sample bits, pair types (codes) with the keys after a chunk
    ([[1, 0, 1], [1, 1, 0], [0, 1, 1]], (9, 30, 21), False, 1, 2, 2, torch.float32, 0.3),
    (CYCLIC, [(9, 30, 21), (5, 20, 10)], True, 2, 2, 1, torch.float32, 0.2),
    ([[2, 0, 0], [1, 1, 0], [1, 2, 2]], (20, 25, 18), False, 1, 2, 1, torch.float32, 0.25),
    # sliding windows: causal bits, pair types (codes) with the keys after a chunk, dropout
    (HUB, (12, 0, 41), True, 1, 4, 2, torch.float32, 0.0, 9),
    ([[2, 1, 0], [0, 2, 1], [1, 0, 2]], [(20, 25, 18), (5, 40, 3)], False, 2, 2, 1, torch.float32, 0.0, 14),
    (HUB, [(9, 30, 21), (5, 20, 10)], True, 2, 2, 1, torch.float32, 0.2, 11),
]


def _run_case(rank: int, world: int, case, group=None, refetch_run: bool = True) -> None:
    from mmsparse import mbs_attention, reference_mask
    from mmsparse.distributed import ContextParallel

    topology, lens, causal, batch, heads, kv_heads, dtype, *rest = case
    dropout_p = rest[0] if rest else 0.0
    window = rest[1] if len(rest) > 1 else None
    seq = max(sum(r) for r in (lens if isinstance(lens[0], tuple) else [lens]))
    gen = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(batch, h, seq, 16, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
    cp = ContextParallel(topology, lens, causal=causal, group=group, window=window)

    def run(cp=cp):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        q_l, k_l, v_l = (cp.shard(t) for t in leaves)
        torch.manual_seed(rank + 5)  # the ranks' generators differ: rank 0's seed must reach them all
        o_l = cp.attention(q_l, k_l, v_l, dropout_p=dropout_p)
        o_l.backward(cp.shard(do))
        grads = [t.grad.clone() for t in leaves]
        for g in grads:  # each token's gradient lives on the rank that holds it
            dist.all_reduce(g, group=cp.group)
        return cp.unshard(o_l.detach()), grads

    out, grads = run()
    # At these sizes the default ("auto") keeps the forward's fetched K/V for the backward
    assert cp.keeps_fetched_kv(k), "the gathered K/V here is far below KEEP_FETCHED_MAX_BYTES"
    if refetch_run:
        # The second run fetches the K/V again in the backward: the same kernels on the same keys, so a repeatable
        # run gives the same bits whether the backward fetches again or not.
        again = ContextParallel(topology, lens, causal=causal, group=group, window=window, keep_fetched_kv=False)
        out2, grads2 = run(again)
        for a, b in zip((out, *grads), (out2, *grads2)):
            assert torch.equal(a, b), "a second run (fetching the K/V again) must be bitwise equal to the first"
        # One fetch more: the difference is the K/V of one fetch, > 0 where this rank needs another rank's keys.
        remote = any(cp.plan.owner[c] != cp.rank for c in cp.plan.needed_kv[cp.rank])
        assert cp.bytes_received < again.bytes_received if remote else cp.bytes_received == again.bytes_received, (
            "with the fetched K/V kept the backward must not fetch again; without, it must")
    if cp.rank != 0:  # out and the gradients are the whole tensors on every rank (gathered, summed): one check
        return

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)  # rank 0's generator: the seed every rank used
    out_single = mbs_attention(*leaves, topology, lens if isinstance(lens[0], int) else [list(r) for r in lens],
                               causal=causal, dropout_p=dropout_p, window=window)
    torch.testing.assert_close(out, out_single, rtol=2e-3, atol=2e-3)
    if dropout_p:
        out_single.backward(do)
        assert out.isfinite().all() and not torch.equal(out_single, mbs_attention(
            q, k, v, topology, lens if isinstance(lens[0], int) else [list(r) for r in lens], causal=causal,
            window=window))
        for g, single in zip(grads, leaves):
            torch.testing.assert_close(g, single.grad, rtol=2e-3, atol=2e-3)
        return
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    for t, g in zip((qd, kd, vd), grads):
        t.grad = g
    mask = reference_mask(topology, lens, seq, causal=causal, window=window)
    check_outputs(qd, kd, vd, out, do, mask)


def _check_unshard(rank: int, world: int) -> None:
    from mmsparse.distributed import ContextParallel

    cp = ContextParallel([[1, 1], [1, 1]], (21, 30))
    x = torch.arange(2 * 51 * 3, dtype=torch.float32).reshape(2, 51, 3)
    x_l = cp.shard(x, seq_dim=1).requires_grad_()
    full = cp.unshard(x_l, seq_dim=1)
    assert torch.equal(full, x)
    (full * (rank + 1)).sum().backward()  # each rank's copy is a use: the gradient sums them
    assert torch.equal(x_l.grad, torch.full_like(x_l, world * (world + 1) / 2))


class _Attention(torch.nn.Module):
    """Projections and attention over one sequence: q, k, v from the tokens, one output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim)
        self.out = torch.nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:  # x: [B, S, dim]
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.out(attend(q, k, v).transpose(1, 2).reshape(b, s, -1))


def _check_fsdp2(mesh) -> None:
    """FSDP2 shards the weights over the mesh's dp dim while ContextParallel shards the sequence over its cp dim:
    the loss gradients, summed over the cp group as a training loop does (each cp rank holds part of the tokens),
    equal the single-process ones averaged over the dp batches."""
    from torch.distributed.fsdp import fully_shard

    from mmsparse import mbs_attention
    from mmsparse.distributed import ContextParallel

    topology, lens = [[1, 0, 1], [1, 1, 0], [0, 1, 1]], (9, 30, 21)
    torch.manual_seed(0)
    reference = _Attention(8, 2, 16)
    model = _Attention(8, 2, 16)
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=mesh["dp"])
    cp = ContextParallel(topology, lens, group=mesh["cp"])
    batches = torch.randn(2, 1, sum(lens), 8, generator=torch.Generator().manual_seed(3))
    dp_rank = mesh["dp"].get_local_rank()
    x_l = cp.shard(batches[dp_rank], seq_dim=1)
    (model(x_l, cp.attention) ** 2).sum().backward()
    for param in model.parameters():  # FSDP averaged over dp; the cp ranks' shares of the loss add up
        dist.all_reduce(param.grad.to_local(), group=mesh["cp"].get_group())
    for x in batches:
        (reference(x, lambda q, k, v: mbs_attention(q, k, v, topology, lens)) ** 2).sum().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), ref.grad / 2, rtol=1e-4, atol=1e-4, msg=name)


# Two ranks run every case; three and four ranks (each case costs more processes on the same CPUs) run a sample
# that keeps each feature: per-sample lengths, pair types (codes), dropout and windows, a segment seeing nothing.
CASES_BY_WORLD = {2: range(len(CASES)), 3: (2, 5, 8, 10), 4: (0, 3, 11)}
# The cases that also run a second time with keep_fetched_kv=False (the default keeps the fetched K/V at these
# sizes; the backward fetching again must give the same bits whatever the mask; it costs a second build of every
# list): on two ranks bits with per-sample lengths,
# GQA and fp16, where one rank needs no remote keys (2), segment codes with dropout (8), a window with dropout (11);
# on three ranks case 2 (a rank with no remote keys beside two that fetch from two peers); on four ranks case 11.
REFETCH_BY_WORLD = {2: (2, 8, 11), 3: (2,), 4: (11,)}


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _check_unshard(rank, world)
        for index in CASES_BY_WORLD[world]:
            _run_case(rank, world, CASES[index], refetch_run=index in REFETCH_BY_WORLD[world])
        if world == 4:  # context parallel x data parallel: the CP group is one dim of a 2-D mesh
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
            _run_case(rank, world, CASES[1], group=mesh["cp"], refetch_run=False)
            _check_fsdp2(mesh)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])  # 4 ranks: test_cp_mesh.py, a file of its own so that it runs beside these
def test_context_parallel_matches_the_reference(world, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo test; GPUs run the NCCL one")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    mp.spawn(_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


def test_plan_errors_without_a_process_group():
    from mmsparse.distributed import ContextParallel

    if dist.is_initialized():
        pytest.skip("a process group is up")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ContextParallel([[1]], (10,))


def test_the_torchrun_example_runs_on_cpu(tmp_path):
    """The README's torchrun command, on CPU over gloo: two processes against one."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo run")
    example = REPO / "examples" / "context_parallel.py"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example),
         "--causal"], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ok: tolerance" in result.stdout
