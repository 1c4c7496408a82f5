"""The exchange by peer copies (``ContextParallel(transport="peer_copy")``) on CPU: processes over gloo that copy
from each other's shared memory, through Triton's interpreter. It moves the same bytes as point to point and sums
in the same order, so out and every gradient must be bitwise equal to the ``p2p`` transport's, and both must
match the float64 reference. The cases grow, so the slots grow between them (every rank at once), and a smaller
case after them reuses the slots (checked against the reference alone)."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import CYCLIC, check_outputs

pytestmark = pytest.mark.long_module  # spawned ranks through the interpreter

CASES = [
    # topology, seg_lens, causal, batch, heads, kv heads, dtype, dropout_p
    ([[1, 1], [0, 0]], (37, 20), False, 1, 2, 1, torch.float16, 0.0),  # one piece: bf16-style return, own first
    (CYCLIC, [(9, 30, 21), (5, 20, 10)], True, 2, 2, 1, torch.float32, 0.0),  # pieces, per-sample rows, float32
    ([[2, 0, 0], [1, 1, 0], [1, 2, 2]], (20, 45, 18), False, 1, 2, 1, torch.float32, 0.25),  # codes, dropout
    ([[1, 1], [0, 0]], (17, 20), False, 1, 2, 1, torch.float16, 0.0),  # smaller again: the slots are reused
]


def _run(rank: int, case, transport: str):
    from mmsparse.distributed import ContextParallel

    topology, lens, causal, batch, heads, kv_heads, dtype, dropout_p = case
    seq = max(sum(r) for r in (lens if isinstance(lens[0], tuple) else [lens]))
    gen = torch.Generator().manual_seed(seq)
    q, k, v, do = (torch.randn(batch, h, seq, 16, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads, heads))
    cp = ContextParallel(topology, lens, causal=causal, transport=transport)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(rank + 5)  # rank 0's seed reaches every rank
    o_l = cp.attention(*(cp.shard(t) for t in leaves), dropout_p=dropout_p)
    o_l.backward(cp.shard(do))
    grads = [t.grad.clone() for t in leaves]
    for g in grads:
        dist.all_reduce(g)
    return (q, k, v, do), cp.unshard(o_l.detach()), grads, (cp.bytes_sent, cp.bytes_received)


def _check_a_rank_that_cannot_open_the_slots(rank: int) -> None:
    """One rank fails to open a peer's slot: every rank hears of it (no rank waits for the others in a copy that
    never comes), with the reason, and ``auto`` would run point to point instead."""
    from mmsparse.distributed import ContextParallel, peer_memory

    group = dist.new_group(list(range(dist.get_world_size())))  # a group of its own: fresh peer memory
    opened = peer_memory.PeerMemory._open

    def refuse(self, handle, capacity):
        if rank == 1:
            raise OSError("cannot map the file")
        return opened(self, handle, capacity)

    peer_memory.PeerMemory._open = refuse
    try:
        cp = ContextParallel(CYCLIC, (9, 30, 21), group=group, transport="peer_copy")
        k = torch.randn(1, 1, cp.local_len, 16)
        try:
            cp.fetch_kv(k, k)
        except RuntimeError as error:
            assert "could not make or open the shared slots: OSError: cannot map the file" in str(error)
        else:
            raise AssertionError("a rank that cannot open a peer's slot must stop peer copies on every rank")
    finally:
        peer_memory.PeerMemory._open = opened


def _check_release(world: int) -> None:
    """release_peer_memory frees a group's slots on every rank (a later exchange makes new ones and moves the same
    bytes), and the map of memories does not keep a destroyed group alive."""
    import gc
    import weakref

    from mmsparse.distributed import ContextParallel, peer_memory, release_peer_memory

    group = dist.new_group(list(range(world)))
    cp = ContextParallel(CYCLIC, (9, 30, 21), group=group, transport="peer_copy")
    gen = torch.Generator().manual_seed(dist.get_rank())
    k, v = (torch.randn(1, 1, cp.local_len, 16, generator=gen) for _ in range(2))
    before = cp.fetch_kv(k, v)
    key = (id(group), torch.device("cpu"))
    memory = peer_memory._MEMORIES[key]
    assert memory.capacity > 0 and memory._mine
    release_peer_memory(group)
    assert key not in peer_memory._MEMORIES and memory.capacity == 0 and not memory._mine
    after = cp.fetch_kv(k, v)  # new slots
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    release_peer_memory(group)
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del cp, group
    gc.collect()
    assert ref() is None, "the peer memories kept a destroyed group alive"


def _worker(rank: int, world: int, init_file: str) -> None:
    from mmsparse import reference_mask

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(CASES):
            inputs, out, grads, moved = _run(rank, case, "peer_copy")
            if i < len(CASES) - 1:  # the last case checks the slots' reuse, against the reference alone
                _, out_p2p, grads_p2p, moved_p2p = _run(rank, case, "p2p")
                assert moved == moved_p2p, f"peer copies moved {moved} bytes (sent, received), p2p {moved_p2p}"
                for a, b in zip((out, *grads), (out_p2p, *grads_p2p)):
                    assert torch.equal(a, b), "peer copies must give the bits point to point gives"
            topology, lens, causal, *_, dropout_p = case
            if rank == 0 and not dropout_p:
                q, k, v, do = inputs
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                for t, g in zip(leaves, grads):
                    t.grad = g
                seq = q.shape[2]
                check_outputs(*leaves, out, do, reference_mask(topology, lens, seq, causal=causal))
        _check_a_rank_that_cannot_open_the_slots(rank)
        _check_release(world)
        dist.barrier()
        assert not glob.glob(f"/dev/shm/mmsparse-peer-{os.getpid()}-*"), "a slot's file outlived its mapping"
    finally:
        dist.destroy_process_group()


def test_peer_copies_give_the_bits_of_point_to_point(tmp_path):
    """Three ranks: each copies from two peers, at offsets past the first peer's in their slots."""
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo test; on GPUs benchmarks.cp_nccl checks copy engines against one GPU")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    mp.spawn(_worker, args=(3, str(tmp_path / "init")), nprocs=3, join=True)


def test_release_peer_memory_refuses_what_is_not_a_group():
    from mmsparse.distributed import release_peer_memory

    if dist.is_initialized():
        pytest.skip("a process group is up")
    with pytest.raises(RuntimeError, match="init_process_group"):
        release_peer_memory()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match=r"a 1-D DeviceMesh or None \(the default group\); got str"):
            release_peer_memory("cp")
        release_peer_memory()  # the default group, whose slots were never made: nothing to free
    finally:
        dist.destroy_process_group()


def test_an_unknown_transport_is_refused():
    from mmsparse.distributed import ContextParallel

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="transport must be one of 'auto', 'p2p', 'peer_copy'"):
            ContextParallel([[1]], (10,), transport="nccl")
    finally:
        if started:
            dist.destroy_process_group()
