"""The Gluon forward and dQ pass at head dims 129-256 (``config.GLUON_D256``), beside
the tl dK/dV pass: output and all three gradients against the float64 reference, and which kernel ran each pass.

The kernels need an sm_90 GPU (``hopper``); the config's choices and the refusal of tiles a head dim cannot run are
checked everywhere (no kernel runs in those)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.config import (
    GLUON_D256,
    GLUON_D256_ENABLED,
    HOPPER,
    Tile,
    cuda_kernel_config,
    gluon_tile_problem,
    use_tuning,
)
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from mmsparse.attention.plan import plan_attention
from tests.helpers import CYCLIC, FOUR, HUB, check_against_reference, check_outputs, make_qkv

TEXT_IMAGE_TEXT = [[2, 0, 0], [1, 1, 0], [1, 1, 2]]  # Gemma 3: text causal, the image whole, both see the past
TL_DKDV_D256 = Tile(32, 64, num_warps=4, num_stages=1)  # the tl table's dK/dV tile at D=256

# (topology, seg_lens (or per-sample), causal, window, batch, heads, kv_heads, seq_q or None, head_dim, dtype):
# bits and segment codes (pair types), causal, GQA, per-sample lengths, fewer queries than keys, a segment that
# sees nothing, a zero-length segment, a window, head dims 256, 192 and 136 (padded to 256), fp16 and bf16.
CASES = [
    (CYCLIC, (300, 1000, 777), False, None, 1, 4, 2, None, 256, torch.bfloat16),
    (HUB, (513, 2049, 1031), True, None, 1, 2, 2, None, 256, torch.float16),
    (TEXT_IMAGE_TEXT, (700, 256, 1100), False, None, 1, 4, 1, None, 256, torch.bfloat16),
    (HUB, [(100, 900, 300), (700, 200, 77)], False, None, 2, 2, 1, None, 192, torch.bfloat16),
    (CYCLIC, (500, 1200, 900), True, None, 1, 2, 1, 300, 136, torch.bfloat16),
    (FOUR, (999, 130, 700, 1100), False, None, 1, 2, 1, None, 256, torch.float16),
    (CYCLIC, (0, 2000, 600), True, None, 1, 2, 1, None, 256, torch.bfloat16),
    (TEXT_IMAGE_TEXT, (900, 512, 1400), False, 700, 1, 2, 1, None, 192, torch.float16),
]


def _case_id(case) -> str:
    topo, lens, causal, window, b, h, hk, sq, d, dtype = case
    return (f"k{len(topo)}-B{b}-H{h}x{hk}-Sq{sq}-D{d}-{str(dtype)[6:]}{'-causal' if causal else ''}"
            f"{'' if window is None else f'-W{window}'}-{lens}")


def d256_config(dtype: torch.dtype):
    """The D=256 candidate tiles (``cuda_kernel_config(..., gluon_d256=True)``), independent of the default table."""
    return cuda_kernel_config(256, dtype, HOPPER, gluon=True, gluon_d256=True)


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records which Gluon passes ran: only a spy on their launchers tells (the tl ones agree within tolerance)."""
    from mmsparse.attention import gluon_launch

    calls = []
    for name in ("forward", "dkdv", "dq"):
        real = getattr(gluon_launch, f"run_{name}")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(gluon_launch, f"run_{name}", spy)
    return calls


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_forward_and_dq_against_float64(case, gluon_calls):
    topo, lens, causal, window, batch, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = max(sum(r) for r in lens) if isinstance(lens, list) else sum(lens)
    # Enough heads for 2 programs per SM: a smaller grid splits the key lists (the tl forward's job).
    programs = -(-(seq_q or seq_k) // 128) * batch * heads
    more = -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // programs)
    q, k, v = make_qkv(batch, heads * more, kv_heads * more, seq_q or seq_k, seq_k, head_dim, dtype,
                       torch.device("cuda"))
    with use_tuning(d256_config(dtype), short_keys=0):  # these lengths are short: the Gluon forward at any length
        check_against_reference(q, k, v, topo, lens, causal=causal, window=window)
    assert sorted(gluon_calls) == ["dq", "forward"]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_with_an_empty_row_and_column(causal, gluon_calls):
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 64, 16, 1500, 1500, 256, torch.bfloat16, dev)
    mask = torch.rand(1500, 1500, device=dev) < 0.3
    mask[5] = False
    mask[:, 7] = False
    with use_tuning(d256_config(torch.bfloat16), short_keys=0):
        out = mbs_attention(q, k, v, None, None, causal=causal, attn_mask=mask)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    want = mask & torch.ones_like(mask).tril() if causal else mask
    check_outputs(q, k, v, out, grad_out, want.cpu())
    assert sorted(gluon_calls) == ["dq", "forward"]
    assert not out[:, :, 5].any() and not q.grad[:, :, 5].any() and not k.grad[:, :, 7].any()


@pytest.mark.hopper
@pytest.mark.gpu
def test_dropout_and_small_grids_run_the_tl_kernels_at_the_gluon_tiles(gluon_calls):
    """Dropout runs the tl forward and dQ kernels at the candidate tiles (128 rows, 8 warps); a grid too small to
    fill the GPU splits the forward's key lists (tl) while the dQ pass stays Gluon."""
    dev = torch.device("cuda")
    lens = (300, 1000, 777)
    with use_tuning(d256_config(torch.bfloat16), short_keys=0):
        q, k, v = make_qkv(1, 2, 1, 2077, 2077, 256, torch.bfloat16, dev)
        check_against_reference(q, k, v, CYCLIC, lens)  # 17 x 2 programs: split
        assert gluon_calls == ["dq"]
        gluon_calls.clear()
        q, k, v = make_qkv(1, 16, 4, 2077, 2077, 256, torch.bfloat16, dev)
        torch.manual_seed(7)
        out = mbs_attention(q, k, v, HUB, lens, dropout_p=0.2)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    torch.manual_seed(7)
    keep = dropout_keep_mask(new_dropout_seed(dev), 1, 16, 2077, 2077, 0.2)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 2077), dropout_keep=keep, dropout_p=0.2)
    assert gluon_calls == []


@pytest.mark.hopper
@pytest.mark.gpu
def test_default_thresholds_over_4k_keys(gluon_calls):
    """At the candidate's own thresholds (no short_keys override) 4,100 keys take the Gluon forward and dQ pass."""
    q, k, v = make_qkv(1, 16, 4, 4100, 4100, 256, torch.bfloat16, torch.device("cuda"))
    with use_tuning(d256_config(torch.bfloat16)):
        check_against_reference(q, k, v, TEXT_IMAGE_TEXT, (1800, 256, 2044))
    assert sorted(gluon_calls) == ["dq", "forward"]


def test_candidate_config_runs_gluon_forward_and_dq_only():
    """Where the candidate applies (half precision, head dims 129-256), which kernel and tile each pass gets: the
    Gluon forward over SHORT_KEYS keys or more (the tl tile below), the Gluon dQ pass at every length, the tl dK/dV
    pass and tl one-pass backwards; the default table is it; float32 never runs Gluon."""
    cuda = torch.device("cuda")  # planned, not run: no device is asked for
    tl_only = cuda_kernel_config(256, torch.bfloat16, HOPPER, gluon=True, gluon_d256=False)
    assert not (tl_only.fwd.gluon or tl_only.bwd_dq.gluon or tl_only.bwd_dkdv.gluon)
    assert cuda_kernel_config(256, torch.bfloat16).fwd.gluon == GLUON_D256_ENABLED
    for head_dim in (136, 192, 256):
        for dtype in (torch.bfloat16, torch.float16):
            cfg = cuda_kernel_config(head_dim, dtype, HOPPER, gluon=True, gluon_d256=True)
            assert cfg.fwd == GLUON_D256["fwd"] and cfg.bwd_dq == GLUON_D256["dq"]
            assert cfg.bwd_dkdv == TL_DKDV_D256 and cfg.gluon_one_pass is None and cfg.one_pass_tile() == TL_DKDV_D256
            assert not cfg.fwd_short.gluon and cfg.bwd_dq_short is None and cfg.fwd_short_samples is None
            long = plan_attention(cfg, 1, 16, 4, 16384, 16384, cuda, sms=132)
            assert long.kernels() == {"forward": "gluon", "dq": "gluon", "dkdv": "tl"}
            long.check_head_dim(head_dim, 2)
            short = plan_attention(cfg, 1, 16, 4, 1500, 1500, cuda, sms=132)
            assert short.kernels() == {"forward": "tl", "dq": "gluon", "dkdv": "tl"}
            one_pass = plan_attention(cfg, 1, 16, 4, 1500, 1500, cuda, sms=132, deterministic=False)
            assert one_pass.kernels() == {"forward": "tl", "dq": "one-pass", "dkdv": "tl"}
            dropout = plan_attention(cfg, 1, 16, 4, 16384, 16384, cuda, sms=132, dropout=True)
            assert dropout.kernels() == {"forward": "tl", "dq": "tl", "dkdv": "tl"}
    fp32 = cuda_kernel_config(256, torch.float32, HOPPER, gluon=True, gluon_d256=True)
    assert not (fp32.fwd.gluon or fp32.bwd_dq.gluon or fp32.bwd_dkdv.gluon)
    for kind, tile in GLUON_D256.items():
        assert tile.block_m == 128 and tile.gluon and gluon_tile_problem(kind, tile, 256) is None


def test_tiles_a_head_dim_cannot_run_are_refused(device):
    """A Gluon tile that cannot run at the call's head dim (the D=128 table's at D=256: its dK/dV accumulators and
    its forward's 128-key stages) is refused before anything compiles, with the reason."""
    assert gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=4), 256) is not None
    assert gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=4), 128) is None
    assert gluon_tile_problem("fwd", Tile(128, 128, gluon_stages=3), 256) is not None
    assert gluon_tile_problem("fwd", Tile(128, 128, gluon_stages=3), 128) is None
    assert gluon_tile_problem("dq", Tile(128, 64, gluon_stages=2), 256) is not None  # Q and dO take 128 KB
    assert gluon_tile_problem("dq", replace(GLUON_D256["dq"], gluon_stages=4), 256) is not None
    q, k, v = make_qkv(1, 2, 1, 60, 60, 256, torch.float32, device)
    d128 = cuda_kernel_config(128, torch.bfloat16, HOPPER, gluon=True)
    assert d128.bwd_dkdv.gluon
    with use_tuning(d128), pytest.raises(ValueError, match="mmsparse: the Gluon (dq|dK/dV) kernel"):
        mbs_attention(q, k, v, HUB, (9, 30, 21))
