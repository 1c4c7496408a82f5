"""The warp-specialised one-pass backward (mmsparse/kernels/gluon/bwd_dq_writer.py: two MMA warpgroups, a producer
warp and a dQ writer warp), the deterministic=False backward at D=64 by default (``GLUON_DQ_WRITER_HEAD_DIMS``) and
turned on per config elsewhere (``cuda_kernel_config(..., gluon_dq_writer=True)``): its plan everywhere, and on an
sm_90 GPU output and all three gradients against the float64 reference.

The GPU tests take bits, segment codes, causal, a window, GQA groups 1 and 2, D 64/96/128 and ragged lengths
(:data:`CASES`), a dense mask with an empty row and column, GQA group 4 past the ring's stages, and agreement with
the two passes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE, mbs_attention, reference_mask
from mmsparse.attention.config import (
    GLUON_DQ_WRITER,
    GLUON_DQ_WRITER_HEAD_DIMS,
    GLUON_DQ_WRITER_LONG,
    HOPPER_SHARED_BYTES,
    Tile,
    cuda_kernel_config,
    dq_writer_shared_bytes,
    gluon_tile_problem,
    head_dim_pad,
    kernel_config,
)
from mmsparse.attention.plan import plan_attention, plan_call
from mmsparse.kernels.constants import MASK_BITS
from mmsparse.tuning import use_tuning
from tests.helpers import CYCLIC, HUB, check_outputs, make_qkv, writer_config

CUDA = torch.device("cuda")

PAIR_TYPES = [[CAUSAL, FULL, NONE], [FULL, CAUSAL, NONE], [CAUSAL, NONE, FULL]]  # the segment-code mask

# name: (topology, seg_lens, causal, batch, heads, kv_heads, seq_q or None, head_dim, dtype, window); fewer than
# one_pass_max_keys (2048) keys, where the plan runs the one pass by default
CASES = {
    "bits-gqa2-D128": (CYCLIC, (300, 1000, 577), False, 1, 4, 2, None, 128, torch.bfloat16, None),
    "bits-causal-D64-fp16": (HUB, (513, 1049, 431), True, 1, 2, 2, None, 64, torch.float16, None),
    "codes-gqa2-D128": (PAIR_TYPES, (210, 333, 456), False, 2, 4, 2, None, 128, torch.bfloat16, None),
    "codes-causal-window-D64": (PAIR_TYPES, (190, 400, 297), True, 1, 3, 1, None, 64, torch.bfloat16, 150),
    "bits-window-D128-mqa": (HUB, (99, 700, 350), False, 1, 4, 1, None, 128, torch.bfloat16, 200),
    "bits-D96-fewer-queries": (CYCLIC, (500, 600, 301), True, 1, 2, 1, 333, 96, torch.bfloat16, None),
    "bits-short": (HUB, (10, 40, 27), False, 1, 1, 1, None, 128, torch.bfloat16, None),
}


def _case_id(name: str) -> str:
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, window = CASES[name]
    return (f"{name}-B{batch}-H{heads}x{kv_heads}-Sq{seq_q or sum(lens)}-S{sum(lens)}-D{head_dim}-{str(dtype)[6:]}"
            f"{'-causal' if causal else ''}{f'-window{window}' if window else ''}")


# ---------------------------------------------------------------------------------------------------------------
# The switch and the plan (any machine)


def test_default_head_dims():
    """By default the dQ writer is deterministic=False's backward at D=64 and 128 (head dims padded to those), at
    every length (dq_writer_max_keys), while dropout keeps the tl one pass below one_pass_max_keys and the two passes
    from there; at D=256 nothing changes unless it is asked for, and that config is the object that
    gluon_dq_writer=False gives."""
    assert GLUON_DQ_WRITER_HEAD_DIMS == {64, 128}
    cpu = torch.device("cpu")
    for head_dim in (48, 64, 96, 128):
        cfg = cuda_kernel_config(head_dim, torch.bfloat16)
        assert cfg.gluon_dq_writer == GLUON_DQ_WRITER[head_dim_pad(head_dim)] and cfg.one_pass_runs_dq_writer()
        assert cfg is cuda_kernel_config(head_dim, torch.bfloat16, gluon_dq_writer=True)
        for keys in (1000, 13000, 130000):
            plan = plan_attention(cfg, 1, 4, 2, keys, keys, cpu, sms=132, deterministic=False)
            assert plan.dq is None and plan.dkdv.dq_writer and plan.kernels()["dkdv"] == "gluon-dq-writer"
            dropout = plan_attention(cfg, 1, 4, 2, keys, keys, cpu, sms=132, dropout=True, deterministic=False)
            assert not dropout.dkdv.dq_writer and (dropout.dq is None) == (keys < cfg.one_pass_max_keys)
            determined = plan_attention(cfg, 1, 4, 2, keys, keys, cpu, sms=132, deterministic=True)
            assert determined.dq is not None and not determined.dkdv.dq_writer
        off = cuda_kernel_config(head_dim, torch.bfloat16, gluon_dq_writer=False)
        assert off.gluon_dq_writer is None and off.gluon_dq_writer_long is None and not off.one_pass_runs_dq_writer()
    cfg = cuda_kernel_config(256, torch.bfloat16)
    assert cfg.gluon_dq_writer is None and cfg.gluon_dq_writer_long is None
    assert not cfg.one_pass_runs_dq_writer()
    assert cfg is cuda_kernel_config(256, torch.bfloat16, gluon_dq_writer=False)
    plan = plan_attention(cfg, 1, 4, 2, 1000, 1000, cpu, sms=132, deterministic=False)
    assert not plan.dkdv.dq_writer and plan.kernels()["dkdv"] != "gluon-dq-writer"


@pytest.mark.parametrize("head_dim", [48, 64])
def test_longer_calls_take_the_128_row_tile(head_dim):
    """From short_keys keys the dQ writer runs 128 query rows a step (GLUON_DQ_WRITER_LONG), except for a pack of
    samples of up to short_samples tokens, eager and traced alike; at D=128 it has no such tile."""
    cfg = cuda_kernel_config(head_dim, torch.bfloat16)
    short, long = GLUON_DQ_WRITER[64], GLUON_DQ_WRITER_LONG[64]
    assert cfg.gluon_dq_writer_long == long and long.block_m == 128
    assert gluon_tile_problem("dq_writer", long, 64) is None
    cpu = torch.device("cpu")
    cases = [(cfg.short_keys - 1, None, short), (cfg.short_keys, None, long), (64000, None, long),
             (64000, 512, short), (64000, cfg.short_samples, short), (64000, cfg.short_samples + 1, long)]
    for keys, sample_len, tile in cases:
        assert cfg.dq_writer_tile(keys, sample_len) == tile
        plan = plan_attention(cfg, 1, 4, 2, keys, keys, cpu, sample_len, sms=132, deterministic=False)
        assert plan.dkdv.dq_writer and plan.dkdv.tile == tile and plan.dkdv.lists == (tile.block_m, 128, True)
        traced = plan_call(cfg, keys, keys, cpu, sample_len, False, False, MASK_BITS, False, None, 3)
        assert traced.dkdv == plan.dkdv
    assert cfg.dq_writer_tile() == short  # no length: the tile every length can take
    without = dataclasses.replace(cfg, gluon_dq_writer_long=None)
    assert plan_attention(without, 1, 4, 2, 64000, 64000, cpu, sms=132, deterministic=False).dkdv.tile == short
    assert writer_config(128).gluon_dq_writer_long is None
    with pytest.raises(ValueError, match="gluon_dq_writer_long is the Gluon dQ-writer kernel's tile"):
        dataclasses.replace(cfg, gluon_dq_writer_long=Tile(128, 128))


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_switch_plans_the_dq_writer(head_dim):
    """On, it is the one-pass backward's kernel (deterministic=False, below dq_writer_max_keys: at every length by
    default), at the table's tile; the two passes stay as they were, and dropout keeps the tl one pass."""
    cfg = writer_config(head_dim)
    tile = GLUON_DQ_WRITER[head_dim_pad(head_dim)]
    assert cfg.gluon_dq_writer == tile and cfg.one_pass_kernel_tile() == tile
    cpu = torch.device("cpu")
    plan = plan_attention(cfg, 1, 4, 2, 1000, 1000, cpu, sms=132, deterministic=False)
    assert plan.dq is None and plan.dkdv.dq_writer and plan.dkdv.tile == tile
    assert plan.kernels()["dq"] == "one-pass" and plan.kernels()["dkdv"] == "gluon-dq-writer"
    plan.check_head_dim(head_dim, 2)
    two = plan_attention(cfg, 1, 4, 2, 1000, 1000, cpu, sms=132, deterministic=True)
    default = cuda_kernel_config(head_dim, torch.bfloat16)
    assert two == plan_attention(default, 1, 4, 2, 1000, 1000, cpu, sms=132, deterministic=True)
    dropout = plan_attention(cfg, 1, 4, 2, 1000, 1000, cpu, sms=132, dropout=True, deterministic=False)
    assert not dropout.dkdv.dq_writer and dropout.kernels()["dkdv"] == "tl"
    long = plan_attention(cfg, 1, 4, 2, 13000, 13000, cpu, sms=132, deterministic=False)
    assert long.dq is None and long.dkdv.dq_writer  # past one_pass_max_keys: the older one passes' threshold
    with use_tuning(cfg, dq_writer_max_keys=13000):
        capped = plan_attention(kernel_config(head_dim, torch.bfloat16, cpu), 1, 4, 2, 13000, 13000, cpu, sms=132,
                                deterministic=False)
    assert capped.dq is not None and not capped.dkdv.dq_writer
    assert plan_attention(dataclasses.replace(cfg, dq_writer_max_keys=13001), 1, 4, 2, 13000, 13000, cpu, sms=132,
                          deterministic=False).dkdv.dq_writer


@pytest.mark.parametrize("head_dim,dtype", [(256, torch.bfloat16), (128, torch.float32)])
def test_switch_leaves_other_head_dims_and_float32(head_dim, dtype):
    assert writer_config(head_dim, dtype).gluon_dq_writer is None


def test_shared_memory_budget():
    """The tables' tiles fit a CTA; one stage more does not at D=128 (the module docstring's table)."""
    assert dq_writer_shared_bytes(GLUON_DQ_WRITER[128], 128) == 216_064
    assert dq_writer_shared_bytes(GLUON_DQ_WRITER[64], 64) == 152_576  # 5 stages
    for d_pad, tile in GLUON_DQ_WRITER.items():
        assert gluon_tile_problem("dq_writer", tile, d_pad) is None
    four = dataclasses.replace(GLUON_DQ_WRITER[128], gluon_stages=4)
    assert dq_writer_shared_bytes(four, 128) > HOPPER_SHARED_BYTES
    assert "shared memory" in gluon_tile_problem("dq_writer", four, 128)
    assert "head dims up to 128" in gluon_tile_problem("dq_writer", GLUON_DQ_WRITER[128], 256)
    assert "128 keys" in gluon_tile_problem("dq_writer", Tile(64, 64, gluon_stages=3), 128)


def test_a_tl_tile_is_refused():
    with pytest.raises(ValueError, match="gluon_dq_writer is the Gluon dQ-writer kernel's tile"):
        dataclasses.replace(writer_config(128), gluon_dq_writer=Tile(64, 128))


# ---------------------------------------------------------------------------------------------------------------
# On an sm_90 GPU


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize("name", list(CASES), ids=_case_id)
def test_dq_writer_matches_float64(name, ordered, writer_calls):
    """Each case, deterministic=False (adds in any order) and, with ``ordered_dq_writer``, deterministic=True (adds
    in order: tests/kernels/test_hopper_ordered_writer.py)."""
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, window = CASES[name]
    seq = sum(lens)
    seq_q = seq_q or seq
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q, seq, head_dim, dtype, CUDA)
    with use_tuning(dataclasses.replace(writer_config(head_dim, dtype), ordered_dq_writer=ordered)):
        out = mbs_attention(q, k, v, topo, lens, causal=causal, window=window, deterministic=ordered)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert writer_calls == [GLUON_DQ_WRITER[head_dim_pad(head_dim)]]  # no dQ pass, no other dK/dV kernel
    assert writer_calls.ordered == [ordered]
    check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, seq, seq_q, causal, window=window))


# Cases of the 128-row tile beyond the shared ones at D <= 64: fewer queries than keys (the last query block's
# second half past the end), a zero-length segment, a head dim padded to 64, GQA 4 (topology, lengths, causal,
# batch, heads, kv heads, queries, head dim, dtype, window).
LONG_CASES = {
    "bits-D48-fewer-queries-gqa4": (CYCLIC, (500, 0, 1301), True, 2, 8, 2, 877, 48, torch.bfloat16, None),
    "bits-D64-empty-first-segment": (HUB, (0, 1000, 555), False, 1, 2, 1, None, 64, torch.float16, None),
}
LONG_RUNS = {**{n: CASES[n] for n in CASES if head_dim_pad(CASES[n][7]) in GLUON_DQ_WRITER_LONG}, **LONG_CASES}


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize("name", list(LONG_RUNS))
def test_dq_writer_128_rows_matches_float64(name, ordered, writer_calls):
    """The same cases at the 128-row tile (each step's rows whole, or in two halves under segment codes with the
    causal flag), at every length, and a few of its own; with its adds unordered and ordered."""
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, window = LONG_RUNS[name]
    seq = sum(lens)
    seq_q = seq_q or seq
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q, seq, head_dim, dtype, CUDA)
    tile = GLUON_DQ_WRITER_LONG[head_dim_pad(head_dim)]
    config = dataclasses.replace(writer_config(head_dim, dtype), gluon_dq_writer=tile, ordered_dq_writer=ordered)
    with use_tuning(config):
        out = mbs_attention(q, k, v, topo, lens, causal=causal, window=window, deterministic=ordered)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert writer_calls == [tile] and writer_calls.ordered == [ordered]
    check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, seq, seq_q, causal, window=window))


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,rows", [(64, 64), (128, 64), (64, 128)], ids=["D64", "D128", "D64-128rows"])
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_dq_writer_dense_mask(head_dim, rows, ordered, writer_calls):
    """A user's bool mask with an empty row and an empty column: zero gradients there, not NaN; with the adds
    unordered and ordered, at the 64-row tile and the 128-row one (whole steps: lse in the scores)."""
    q, k, v = make_qkv(1, 4, 2, 1100, 1100, head_dim, torch.bfloat16, CUDA)
    mask = torch.rand(1100, 1100, device=CUDA) < 0.3
    mask[5] = False
    mask[:, 7] = False
    tile = GLUON_DQ_WRITER_LONG[head_dim] if rows == 128 else GLUON_DQ_WRITER[head_dim]
    config = dataclasses.replace(writer_config(head_dim), gluon_dq_writer=tile, ordered_dq_writer=ordered)
    with use_tuning(config):
        out = mbs_attention(q, k, v, attn_mask=mask, deterministic=ordered)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert writer_calls == [tile] and writer_calls.ordered == [ordered]
    check_outputs(q, k, v, out, grad_out, mask.cpu())
    assert not q.grad[:, :, 5].any() and not k.grad[:, :, 7].any()


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,causal", [(128, True), (64, False)])
def test_dq_writer_gqa4_past_the_threshold(head_dim, causal, writer_calls):
    """GQA group 4 over 3.2k keys (past one_pass_max_keys, which the dQ writer does not read): many more steps per key
    block than the ring has stages, each staging half refilled many times, the group's heads one after another in
    each CTA."""
    lens = (700, 1500, 1001)
    q, k, v = make_qkv(1, 8, 2, sum(lens), sum(lens), head_dim, torch.bfloat16, CUDA)
    with use_tuning(writer_config(head_dim)):
        out = mbs_attention(q, k, v, CYCLIC, lens, causal=causal, deterministic=False)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert writer_calls == [writer_config(head_dim).dq_writer_tile(sum(lens))]  # D=64: the 128-row tile
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, sum(lens), causal=causal))


@pytest.mark.hopper
@pytest.mark.gpu
def test_d64_default_runs_the_dq_writer(writer_calls):
    """A user's deterministic=False call at D=64, default settings, lengths past one_pass_max_keys and short_keys
    new to the process: the dQ writer runs at its 128-row tile, and the output and all three gradients match
    float64."""
    lens = (1200, 37, 2011)
    q, k, v = make_qkv(2, 4, 2, sum(lens), sum(lens), 64, torch.bfloat16, CUDA)
    out = mbs_attention(q, k, v, HUB, lens, causal=True, deterministic=False)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert writer_calls == [GLUON_DQ_WRITER_LONG[64]]
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, sum(lens), causal=True))


@pytest.mark.hopper
@pytest.mark.gpu
def test_dq_writer_agrees_with_the_two_pass_backward(writer_calls):
    """The same numbers up to the order of float32 adds: both round P and dS to bf16 the same way, so dQ differs by
    its accumulation order only, and dK, dV by at most that."""
    lens = (300, 512, 211)
    q, k, v = make_qkv(1, 4, 2, sum(lens), sum(lens), 128, torch.bfloat16, CUDA)
    grad_out = torch.randn(1, 4, sum(lens), 128, device=CUDA, dtype=torch.bfloat16)
    grads = {}
    with use_tuning(writer_config(128)):
        for deterministic in (True, False):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = mbs_attention(*leaves, HUB, lens, causal=True, deterministic=deterministic)
            out.backward(grad_out)
            grads[deterministic] = [t.grad for t in leaves]
    assert GLUON_DQ_WRITER[128] in writer_calls
    for name, two, one in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        a, b = two.double(), one.double()
        # float32 sums of ~1000 terms: 1e-5 relative to the largest gradient, plus a bf16 ulp of rounding apart
        tol = 1e-5 * a.abs().max() + 2.0**-7 * torch.maximum(a.abs(), b.abs())
        assert ((a - b).abs() <= tol).all(), f"{name}: max diff {(a - b).abs().max().item():.3e}"
