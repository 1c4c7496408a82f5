"""The Gluon one-pass backward on Hopper (``deterministic=False``: mmsparse/kernels/gluon/dkdv.py with ``ONE_PASS``,
dQ added by TMA bulk reduce-adds from shared memory, mmsparse/kernels/gluon/dq_adds.py): the plan runs it, and output
and all three gradients match the float64 reference.

Fresh random inputs, NaN-poisoned outputs (tests/conftest.py); lengths that are not multiples of the tiles (64 query
rows, 128 keys), several query blocks per key block, several heads and GQA groups, D 96/128 (its head dims: the D=64
cases run the dQ writer, tests/kernels/test_hopper_dq_writer.py), bits, segment codes and dense masks, causal, a
window. Each call runs under the device's config without the dQ writer, which is the default one pass at D=64 and
D=128 (:func:`_bulk_config`). The kernel needs an sm_90 GPU; its plan is checked everywhere in
tests/kernels/test_one_pass.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE, mbs_attention, reference_mask
from mmsparse.attention.config import GLUON_ONE_PASS_BULK, head_dim_pad, kernel_config
from mmsparse.attention.plan import plan_attention
from mmsparse.tuning import use_tuning
from tests.helpers import CYCLIC, HUB, check_outputs, make_qkv

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


# The cases the bulk one pass runs: its head dims (D=64 runs the dQ writer, tests/kernels/test_hopper_dq_writer.py,
# which takes every case).
BULK_CASES = [name for name, case in CASES.items() if head_dim_pad(case[7]) in GLUON_ONE_PASS_BULK]


def _case_id(name: str) -> str:
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, window = CASES[name]
    return (f"{name}-B{batch}-H{heads}x{kv_heads}-Sq{seq_q or sum(lens)}-S{sum(lens)}-D{head_dim}-{str(dtype)[6:]}"
            f"{'-causal' if causal else ''}{f'-window{window}' if window else ''}")


@pytest.fixture
def one_pass_calls(monkeypatch):
    """Records each Gluon dK/dV launch as (one_pass, gluon dQ pass ran) and the one pass's tile in ``calls.tiles``;
    the tl kernels give the same gradients within tolerance, so only a spy on the Gluon launchers tells which kernel
    ran."""
    from mmsparse.attention import gluon_launch

    class Calls(list):
        tiles: list

    calls = Calls()
    calls.tiles = []
    real_dkdv, real_dq = gluon_launch.run_dkdv, gluon_launch.run_dq

    def dkdv(*args, **kwargs):
        dq_sum = args[14] if len(args) > 14 else kwargs.get("dq_sum")
        calls.append(("dkdv", dq_sum is not None))
        if dq_sum is not None:
            calls.tiles.append(args[12] if len(args) > 12 else kwargs["tile"])
        return real_dkdv(*args, **kwargs)

    def dq(*args, **kwargs):
        calls.append(("dq", False))
        return real_dq(*args, **kwargs)

    monkeypatch.setattr(gluon_launch, "run_dkdv", dkdv)
    monkeypatch.setattr(gluon_launch, "run_dq", dq)
    return calls


def _bulk_tile(head_dim: int):
    """The Gluon one pass's tile: the device's config has the table's (at D=128 one stage fewer than the dK/dV pass,
    for the staging tiles)."""
    tile = GLUON_ONE_PASS_BULK[head_dim_pad(head_dim)]
    assert kernel_config(head_dim, torch.bfloat16, torch.device("cuda")).gluon_one_pass == tile
    return tile


def _bulk_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, **thresholds: int):
    """The device's config without the dQ writer (deterministic=False's one pass at D=64 and 128): the bulk one pass
    is then what deterministic=False runs, below one_pass_max_keys keys."""
    cfg = kernel_config(head_dim, dtype, torch.device("cuda"))
    return replace(cfg, gluon_dq_writer=None, gluon_dq_writer_long=None, **thresholds)


def _planned_one_pass(q, k, dropout=False):
    dev = q.device
    cfg = _bulk_config(q.shape[-1], q.dtype)
    return plan_attention(cfg, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], dev, None, dropout,
                          deterministic=False)


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("name", BULK_CASES, ids=_case_id)
def test_gluon_one_pass_matches_float64(name, one_pass_calls):
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, window = CASES[name]
    dev = torch.device("cuda")
    seq = sum(lens)
    seq_q = seq_q or seq
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q, seq, head_dim, dtype, dev)
    plan = _planned_one_pass(q, k)
    assert plan.kernels()["dq"] == "one-pass" and plan.kernels()["dkdv"] == "gluon", plan.kernels()
    with use_tuning(_bulk_config(head_dim, dtype)):
        out = mbs_attention(q, k, v, topo, lens, causal=causal, window=window, deterministic=False)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert one_pass_calls == [("dkdv", True)] and one_pass_calls.tiles == [_bulk_tile(head_dim)]  # no dQ pass
    mask = reference_mask(topo, lens, seq, seq_q, causal, window=window)
    check_outputs(q, k, v, out, grad_out, mask)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128])
def test_gluon_one_pass_dense_mask(head_dim, one_pass_calls):
    """A user's bool mask with an empty row and an empty column: zero gradients there, not NaN."""
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 4, 2, 1100, 1100, head_dim, torch.bfloat16, dev)
    mask = torch.rand(1100, 1100, device=dev) < 0.3
    mask[5] = False
    mask[:, 7] = False
    with use_tuning(_bulk_config(head_dim)):
        out = mbs_attention(q, k, v, attn_mask=mask, deterministic=False)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert one_pass_calls == [("dkdv", True)] and one_pass_calls.tiles == [_bulk_tile(head_dim)]
    check_outputs(q, k, v, out, grad_out, mask.cpu())
    assert not q.grad[:, :, 5].any() and not k.grad[:, :, 7].any()


@pytest.mark.hopper
@pytest.mark.gpu
def test_gluon_one_pass_past_the_threshold_when_forced(one_pass_calls):
    """use_tuning(one_pass_max_keys=...) reaches the Gluon kernel (as tools/one_pass.py forces it): over 2048 keys
    and more query blocks per key block than the ring has stages (and than the bulk adds' one staging tile per
    warpgroup: each step waits for the previous step's reduce)."""
    dev = torch.device("cuda")
    lens = (700, 1500, 1001)
    q, k, v = make_qkv(1, 2, 1, sum(lens), sum(lens), 128, torch.bfloat16, dev)
    with use_tuning(_bulk_config(128, one_pass_max_keys=1 << 62)):
        out = mbs_attention(q, k, v, CYCLIC, lens, causal=True, deterministic=False)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert one_pass_calls == [("dkdv", True)] and one_pass_calls.tiles == [_bulk_tile(128)]
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, sum(lens), causal=True))
    one_pass_calls.clear()
    with use_tuning(_bulk_config(128)):
        out = mbs_attention(q, k, v, CYCLIC, lens, causal=True, deterministic=False)  # the default threshold
    out.backward(grad_out)
    assert sorted(one_pass_calls) == [("dkdv", False), ("dq", False)]


@pytest.mark.hopper
@pytest.mark.gpu
def test_gluon_one_pass_agrees_with_the_two_pass_backward(one_pass_calls):
    """The same numbers up to the order of float32 adds: both round dS to bf16 the same way, so dQ differs by its
    accumulation order only, and dK, dV (the same schedule; the one pass reads dS^T from shared memory rather than
    registers) by at most that."""
    dev = torch.device("cuda")
    lens = (300, 512, 211)
    q, k, v = make_qkv(1, 4, 2, sum(lens), sum(lens), 128, torch.bfloat16, dev)
    grad_out = torch.randn(1, 4, sum(lens), 128, device=dev, dtype=torch.bfloat16)
    grads = {}
    for deterministic in (True, False):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with use_tuning(_bulk_config(128)):
            out = mbs_attention(*leaves, HUB, lens, causal=True, deterministic=deterministic)
        out.backward(grad_out)
        grads[deterministic] = [t.grad for t in leaves]
    assert one_pass_calls.tiles == [_bulk_tile(128)]
    for name, two, one in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        a, b = two.double(), one.double()
        # float32 sums of ~1000 terms: 1e-5 relative to the largest gradient, plus a bf16 ulp of rounding apart
        tol = 1e-5 * a.abs().max() + 2.0**-7 * torch.maximum(a.abs(), b.abs())
        assert ((a - b).abs() <= tol).all(), f"{name}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.hopper
@pytest.mark.gpu
def test_dropout_keeps_the_tl_one_pass():
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 2, 1, 300, 300, 128, torch.bfloat16, dev)
    plan = _planned_one_pass(q, k, dropout=True)
    assert plan.kernels() == {"forward": "tl", "dq": "one-pass", "dkdv": "tl"}

