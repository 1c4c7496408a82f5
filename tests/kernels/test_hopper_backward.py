"""The Gluon Hopper backward passes (mmsparse/kernels/gluon/dkdv.py, dq.py): where they run, what they compute,
and the fall-backs.

Like the Gluon forward, the kernels need an sm_90 GPU; their dispatch and the fall-back after a failed build are
tested everywhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention import config
from mmsparse.attention.config import KernelConfig, Tile, head_dim_pad, kernel_config, use_tuning
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from tests.helpers import (
    CYCLIC,
    HOPPER_CASES,
    HUB,
    check_against_reference,
    check_outputs,
    hopper_case_id,
    make_qkv,
    spy_on_gluon_launchers,
)


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records which Gluon backward passes ran ("dkdv", "dq"). The tl passes give the same gradients within
    tolerance, so only a spy on the Gluon launchers tells which ones ran."""
    return spy_on_gluon_launchers(monkeypatch, ("dkdv", "dq"))


def _with_gluon_backward(head_dim: int, dtype: torch.dtype) -> KernelConfig:
    """The shipped Gluon tiles of the head dim, at every key length (by default D=64 runs the tl dQ tile over
    short key lists: see config._GLUON_DQ), as two passes also where the ordered dQ writer would run instead (bit
    masks without the causal flag: tests/kernels/test_hopper_ordered_writer.py)."""
    cfg, pad = kernel_config(head_dim, dtype, torch.device("cuda")), head_dim_pad(head_dim)
    return replace(cfg, bwd_dq=config._GLUON_DQ[pad], bwd_dq_short=None, bwd_dkdv=config._GLUON_DKDV[pad],
                   ordered_max_keys=0)


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_CASES, ids=hopper_case_id)
def test_against_float64(case, gluon_calls):
    """Ragged segments, causal, GQA, per-sample lengths, fewer queries than keys, a segment that sees nothing, a
    zero-length segment, D 64/96/128, fp16/bf16, a sequence shorter than one tile: output and all three
    gradients."""
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = max(sum(r) for r in lens) if isinstance(lens, list) else sum(lens)
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q or seq_k, seq_k, head_dim, dtype, torch.device("cuda"))
    with use_tuning(_with_gluon_backward(head_dim, dtype)):
        check_against_reference(q, k, v, topo, lens, causal=causal)
    assert sorted(gluon_calls) == ["dkdv", "dq"]


def test_dkdv_tiles_are_checked_as_their_kernels():
    """The D <= 128 Gluon dK/dV kernel takes 64 query rows a step and as many stages as a CTA's shared memory holds;
    the dQ-writer one pass, planned as the dK/dV pass, is checked as its own kernel (128 query rows a step at D=64
    over longer key lists): said when the call is planned, not found at the launch."""
    from mmsparse.attention.plan import BackwardPass, check_passes

    tile = config._GLUON_DKDV[64]
    assert config.gluon_tile_problem("dkdv", tile, 64) is None
    assert "query rows" in config.gluon_tile_problem("dkdv", replace(tile, block_m=128), 64)
    assert "query rows" in config.gluon_tile_problem("dkdv", replace(tile, block_m=32), 128)
    assert "shared memory" in config.gluon_tile_problem("dkdv", replace(config._GLUON_DKDV[128], gluon_stages=5), 128)
    assert config.gluon_tile_problem("dkdv", replace(tile, gluon_stages=8), 64) is None  # 172,032 B at D=64
    writer = BackwardPass(config.GLUON_DQ_WRITER_LONG[64], True, True, one_pass=True, dq_writer=True)
    check_passes((("dkdv", writer),), 64, 2)
    with pytest.raises(ValueError, match="dQ-writer kernel .* shared memory"):  # 237,568 B of 232,448
        check_passes((("dkdv", replace(writer, tile=replace(writer.tile, gluon_stages=4))),), 64, 2)
    two_pass = BackwardPass(replace(tile, block_m=128), True, True)
    with pytest.raises(ValueError, match="query rows"):
        check_passes((("dkdv", two_pass),), 64, 2)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_with_an_empty_row_and_column(causal, gluon_calls):
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 4, 2, 1500, 1500, 128, torch.bfloat16, dev)
    mask = torch.rand(1500, 1500, device=dev) < 0.3
    mask[5] = False
    mask[:, 7] = False
    out = mbs_attention(q, k, v, None, None, causal=causal, attn_mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want = mask & torch.ones_like(mask).tril() if causal else mask
    check_outputs(q, k, v, out, grad_out, want.cpu())
    assert sorted(gluon_calls) == ["dkdv", "dq"]
    assert not q.grad[:, :, 5].any() and not k.grad[:, :, 7].any()


@pytest.mark.hopper
@pytest.mark.gpu
def test_default_tiles_and_dropout(gluon_calls):
    """By default the Gluon passes run in half precision (at D=64 the dQ pass over SHORT_KEYS keys or more only);
    dropout runs the tl kernels at the Gluon tiles."""
    dev = torch.device("cuda")
    bf16, fp32 = kernel_config(128, torch.bfloat16, dev), kernel_config(128, torch.float32, dev)
    fp16_d64 = kernel_config(64, torch.float16, dev)
    assert bf16.bwd_dq.gluon and bf16.bwd_dkdv.gluon and bf16.dq_tile(925).gluon and fp16_d64.bwd_dkdv.gluon
    assert fp16_d64.dq_tile(config.SHORT_KEYS).gluon and not fp16_d64.dq_tile(925).gluon
    assert not (fp32.bwd_dq.gluon or fp32.bwd_dkdv.gluon)
    lens = (300, 1000, 777)
    q, k, v = make_qkv(1, 4, 2, 2077, 2077, 128, torch.bfloat16, dev)
    torch.manual_seed(7)
    out = mbs_attention(q, k, v, HUB, lens, dropout_p=0.2)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.manual_seed(7)
    keep = dropout_keep_mask(new_dropout_seed(dev), 1, 4, 2077, 2077, 0.2)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 2077), dropout_keep=keep, dropout_p=0.2)
    assert gluon_calls == []


@pytest.mark.parametrize("failing", ["dkdv", "dq"])
def test_a_failing_gluon_pass_raises(failing, monkeypatch, device):
    """An error inside a Gluon backward pass reaches the caller: no silent fallback to the tl kernels, which would
    turn a bug into a slowdown. Later calls still try the Gluon pass."""
    from mmsparse.attention import gluon_launch

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(gluon_launch, f"run_{failing}", broken)  # no other way to fail
    base = kernel_config(32, torch.float32, device)
    gluon = {"dkdv": "bwd_dkdv", "dq": "bwd_dq"}[failing]
    # the Gluon kernel's fixed block: 128 keys and 64 query rows a step in dK/dV, 128 query rows in dQ (KernelConfig
    # and the plan refuse other tiles)
    fixed = {"bwd_dkdv": {"block_n": config.GLUON_BLOCK, "block_m": config.GLUON_WG_ROWS},
             "bwd_dq": {"block_m": config.GLUON_BLOCK}}[gluon]
    cfg = replace(base, **{gluon: replace(getattr(base, gluon), gluon_stages=2, **fixed)})
    q, k, v = make_qkv(2, 4, 2, 60, 60, 32, torch.float32, device)
    with use_tuning(cfg):
        for _ in range(2):
            out = mbs_attention(q, k, v, CYCLIC, (9, 30, 21))
            with pytest.raises(RuntimeError, match="simulated kernel failure"):
                out.sum().backward()
    assert calls == [1, 1]


def test_short_key_lists_take_the_short_dq_tile(monkeypatch, device):
    """Below SHORT_KEYS keys the dQ pass runs ``bwd_dq_short`` (at D=64 on Hopper: the tl tile instead of the
    Gluon one), over block lists prepared for that tile; the gradients stay exact on both sides."""
    from mmsparse.attention.kernel_args import KernelArgs

    long, short = Tile(16, 16), Tile(32, 32)
    cfg = replace(kernel_config(32, torch.float32, device), bwd_dq=long, bwd_dq_short=short)
    cfg = replace(cfg, short_keys=64)  # the real threshold takes thousands of keys: too slow here
    lists = []

    def spy(self, block_m, block_n, by_key=False, _real=KernelArgs.tile):
        lists.append((block_m, block_n, by_key))
        return _real(self, block_m, block_n, by_key)

    monkeypatch.setattr(KernelArgs, "tile", spy)  # both tiles give exact gradients: only a spy sees the lists
    for seq, want, other in ((60, short, long), (70, long, short)):
        lists.clear()
        q, k, v = make_qkv(1, 2, 2, seq, seq, 32, torch.float32, device)
        with use_tuning(cfg):
            check_against_reference(q, k, v, CYCLIC, (9, 30, seq - 39))
        assert (want.block_m, want.block_n, False) in lists
        assert (other.block_m, other.block_n, False) not in lists
