"""The backward's side stream against block lists built for it (GPU).

On a GPU the backward may run its dQ pass on a side stream, concurrently with dK/dV. The two passes' block lists
share work: the summaries of a tile's blocks (bit masks, whenever the two passes' tiles match) and the code runs of
a self-attention's queries and keys (segment codes). Any list the side stream built for itself would be read by
the dK/dV builder on the current stream before the side stream wrote it. These tests queue a long kernel on the
side stream just before the backward forks to it, so that such a race shows on every run instead of now and then;
each checks out, dq and dK/dV on every key row against the float64 reference, with a mask built inside the call
from lengths the process has not seen (a device tensor: no cache) and sizes above ``SHORT_KEYS``, where the side
stream runs.
"""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention import backward
from mmsparse.attention.config import SHORT_KEYS, KernelConfig, Tile, use_tuning
from mmsparse.distributed import RankProblem
from mmsparse.distributed.local import backward_pieces, forward_pieces
from tests.helpers import check_outputs, make_qkv

SLEEP_CYCLES = 1 << 28  # ~0.15-0.2 s at GPU clocks: far longer than building the lists and queueing the passes
CODES = [[2, 0, 0, 0, 0], [1, 1, 0, 0, 0], [2, 1, 2, 0, 0], [1, 1, 1, 1, 0], [2, 0, 2, 0, 2]]  # pair types
CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]  # the seed's topology (bit masks)
# The tl kernels' tiles at D=128 (as on GPUs without the Gluon kernels): 64 x 64 in both backward passes, so the
# dQ and dK/dV lists of a bit mask share one summary.
TL_D128 = KernelConfig(fwd=Tile(128, 64), bwd_dkdv=Tile(64, 64, num_stages=2), bwd_dq=Tile(64, 64, num_stages=3),
                       decode=Tile(16, 64, num_warps=2, num_stages=3))


@pytest.fixture
def slow_side_stream(monkeypatch):
    """The backward's side stream starts with a long kernel whenever the backward forks to it."""
    forks = []
    real = getattr(backward, "_streams", None)
    if real is None:  # no side stream: nothing can run beside the current stream
        yield forks
        return

    def slow_streams(*args):
        main, side = real(*args)
        if side is not None:
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
            forks.append(side)
        return main, side

    monkeypatch.setattr(backward, "_streams", slow_streams)
    yield forks
    torch.cuda.synchronize()


def _inputs(seq: int, seed: int, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(1, 4, kv_heads, seq, seq, 128, torch.bfloat16, torch.device("cuda"), gen)
    grad_out = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    return q, k, v, grad_out


def _run_fresh(topology, lens: list[int], warm_lens: list[int], seed: int) -> None:
    """Forward and backward once over ``warm_lens`` (compiles every kernel, so nothing waits on the host while the
    side stream sleeps), then over ``lens``, with the mask built in the call, checked against float64."""
    seq = sum(lens)
    assert seq >= SHORT_KEYS and sum(warm_lens) == seq
    q, k, v, grad_out = _inputs(seq, seed)
    dev = q.device
    warm = mbs_attention(q, k, v, topology, torch.tensor(warm_lens, device=dev))
    warm.backward(grad_out)
    torch.cuda.synchronize()
    for t in (q, k, v):
        t.grad = None
    out = mbs_attention(q, k, v, topology, torch.tensor(lens, device=dev))
    out.backward(grad_out)
    torch.cuda.synchronize()
    check_outputs(q, k, v, out, grad_out, reference_mask(topology, lens, seq))


@pytest.mark.gpu
def test_segment_codes_default_kernels(slow_side_stream):
    """Pair types (segment codes), the default kernels (Gluon on Hopper): the dQ lists' key runs are the dK/dV
    lists' query runs."""
    _run_fresh(CODES, [300, 1540, 120, 1640, 400], [280, 1600, 100, 1600, 420], 0)
    assert slow_side_stream or not hasattr(backward, "_streams")


@pytest.mark.gpu
def test_bit_mask_tl_kernels_same_tiles(slow_side_stream):
    """A 0/1 topology (bit masks) with the tl kernels at D=128, whose two backward passes share one tile."""
    with use_tuning(TL_D128):
        _run_fresh(CYCLIC, [300, 2460, 1240], [320, 2400, 1280], 1)
    assert slow_side_stream or not hasattr(backward, "_streams")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [512, 1024])
def test_context_parallel_pieces_tl_kernels(slow_side_stream, chunk):
    """Every rank's pieces of a 2-rank context-parallel plan, run on one GPU with the tl kernels: pieces have
    different query and key bits, and the ones over a long run of gathered keys fork the dQ pass."""
    lens, world = [300, 1640, 120, 1640, 400], 2
    seq = sum(lens)
    q, k, v, grad_out = _inputs(seq, 2)
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    hkv = k.shape[1]
    with use_tuning(TL_D128):
        for rank in range(world):
            problem = RankProblem(CODES, lens, rank, world, chunk=chunk)
            pieces = problem.pieces(q.device)
            own = problem.token_index.to(q.device)
            gathered = problem.gathered_positions().to(q.device)

            def gather(gathered=gathered):
                return k[:, :, gathered], v[:, :, gathered]

            seeds = [None] * len(pieces)
            local = [t[:, :, own].contiguous() for t in (q, k, v)]
            out_r, lse_r = forward_pieces(*local, pieces, seeds, scale, 0.0, gather)
            dq_r, dkv_own, dkv_gathered = backward_pieces(grad_out[:, :, own].contiguous(), *local, out_r, lse_r,
                                                          pieces, seeds, scale, 0.0, gather)
            out[:, :, own] = out_r
            dq[:, :, own] += dq_r
            dk[:, :, own] += dkv_own[:, :hkv]
            dv[:, :, own] += dkv_own[:, hkv:]
            dk[:, :, gathered] += dkv_gathered[:, :hkv]
            dv[:, :, gathered] += dkv_gathered[:, hkv:]
    torch.cuda.synchronize()
    assert slow_side_stream or not hasattr(backward, "_streams")
    for t, g in ((q, dq), (k, dk), (v, dv)):
        t.grad = g.to(t.dtype)
    check_outputs(q, k, v, out, grad_out, reference_mask(CODES, lens, seq))
