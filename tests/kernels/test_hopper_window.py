"""Sliding windows on the Gluon Hopper passes (forward, dQ, dK/dV) and on the GPU's tl kernels: output and all
three gradients against the float64 reference, at sizes past the tile thresholds (Gluon tiles, side-stream dQ,
split key lists, packed lists), and the windowed lists visiting only the band.

The Gluon kernels need an sm_90 GPU (``hopper``); the tl cases need any CUDA GPU (``gpu``). Both skip without one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import mbs_attention, mbs_attention_varlen, reference_packed_mask
from mmsparse.attention import config
from mmsparse.attention.config import head_dim_pad, kernel_config, use_tuning
from mmsparse.mask.build import build_mask_info
from tests.helpers import CYCLIC, HUB, check_against_reference, check_outputs, make_qkv, spy_on_gluon_launchers

# (topology, seg_lens (or per-sample), causal, window, batch, heads, kv_heads, seq_q or None, head_dim, dtype)
CASES = [
    ([[1]], (4096,), True, 1024, 1, 4, 2, None, 128, torch.bfloat16),  # Gemma's local layers: causal + W
    ([[2, 0, 0], [1, 1, 0], [1, 2, 2]], (700, 1500, 900), False, 300, 1, 2, 1, None, 128, torch.bfloat16),
    (HUB, (513, 2049, 1031), True, 77, 1, 2, 2, None, 64, torch.float16),  # W under a tile
    (CYCLIC, [(100, 900, 300), (700, 200, 77)], False, 500, 2, 2, 1, None, 128, torch.bfloat16),
    (HUB, (999, 1300, 700), True, 1, 1, 2, 1, None, 96, torch.bfloat16),  # one key
    ([[1, 2], [2, 1]], (1000, 1600), True, 333, 1, 2, 1, 600, 128, torch.bfloat16),  # fewer queries than keys
]


def _case_id(case) -> str:
    topo, lens, causal, window, b, h, hk, sq, d, dtype = case
    return (f"k{len(topo)}-W{window}-B{b}-H{h}x{hk}-Sq{sq}-D{d}-{str(dtype)[6:]}{'-causal' if causal else ''}-"
            f"{lens}")


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records which Gluon passes ran: only a spy on their launchers tells (the tl ones agree within tolerance)."""
    return spy_on_gluon_launchers(monkeypatch, ("forward", "dkdv", "dq"))


def _gluon_everywhere(head_dim: int, dtype: torch.dtype):
    """The shipped Gluon tiles at every key length (short key ranges and D=64's dQ take tl tiles by default), as two
    passes also where the ordered dQ writer would run instead (bit masks without the causal flag)."""
    cfg, pad = kernel_config(head_dim, dtype, torch.device("cuda")), head_dim_pad(head_dim)
    cfg = replace(cfg, bwd_dq=config._GLUON_DQ[pad], bwd_dq_short=None, bwd_dkdv=config._GLUON_DKDV[pad],
                  ordered_max_keys=0)
    return use_tuning(cfg, short_keys=0)


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_passes_against_float64(case, gluon_calls):
    topo, lens, causal, window, batch, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = max(sum(r) for r in lens) if isinstance(lens, list) else sum(lens)
    # Enough heads for 2 programs per SM: a smaller grid splits the key lists (the tl forward's job).
    programs = -(-(seq_q or seq_k) // 128) * batch * heads
    more = -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // programs)
    q, k, v = make_qkv(batch, heads * more, kv_heads * more, seq_q or seq_k, seq_k, head_dim, dtype,
                       torch.device("cuda"))
    with _gluon_everywhere(head_dim, dtype):
        check_against_reference(q, k, v, topo, lens, causal=causal, window=window)
    assert sorted(gluon_calls) == ["dkdv", "dq", "forward"]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_dense_mask_with_a_window(causal, gluon_calls):
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 64, 32, 1500, 1500, 128, torch.bfloat16, dev)
    mask = torch.rand(1500, 1500, device=dev) < 0.3
    with _gluon_everywhere(128, torch.bfloat16):
        out = mbs_attention(q, k, v, None, None, causal=causal, attn_mask=mask, window=200)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    pos = torch.arange(1500, device=dev)
    want = mask & (pos[None, :] > pos[:, None] - 200)
    want = want & (pos[None, :] <= pos[:, None]) if causal else want
    check_outputs(q, k, v, out, grad_out, want.cpu())
    assert sorted(gluon_calls) == ["dkdv", "dq", "forward"]


@pytest.mark.gpu
def test_decoding_and_packs_on_the_gpu():
    """The GPU's tl paths: a decode step over an 8k cache (split key lists, GQA-packed rows) with per-sample
    first queries, and a pack of samples (varlen) under a window."""
    dev = torch.device("cuda")
    lens, q_start = [(1000, 6000, 1192), (3000, 3000, 2000)], [8000, 7000]
    q, k, v = make_qkv(2, 8, 2, 4, 8192, 128, torch.bfloat16, dev)
    check_against_reference(q, k, v, HUB, lens, causal=True, window=2048, q_start=q_start)
    packs = [[300, 500, 200], [1000, 0, 40], [20, 1500, 700]]
    total = sum(map(sum, packs))
    q, k, v = make_qkv(1, 4, 2, total, total, 64, torch.float16, dev)
    out = mbs_attention_varlen(q, k, v, HUB, packs, causal=True, window=256)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(HUB, packs, causal=True, window=256))


@pytest.mark.gpu
def test_band_lists_at_the_gpu_tiles():
    """Causal W = 1024 over 16k tokens at the GPU forward's tile: each query block lists about W / block_n + 2 key
    blocks, not the causal triangle's up to 256; the packed (CSR) lists give the same visits."""
    dev = torch.device("cuda")
    seq, w = 16384, 1024
    info = build_mask_info([[1]], (seq,), seq, seq, True, dev, window=w)
    tile = kernel_config(128, torch.bfloat16, dev).forward_tile(seq, seq, None)
    info.prepare([(tile.block_m, tile.block_n, False)])
    counts = info.lists(tile.block_m, tile.block_n).counts[0, :, :2].sum(-1).cpu()
    assert int(counts.max()) <= -(-(w + tile.block_m) // tile.block_n) + 1
    assert int(counts[-1]) >= w // tile.block_n


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("topology", [HUB, [[2, 1, 0], [1, 1, 2], [0, 2, 2]]], ids=["bits", "codes"])
def test_gluon_packs_of_short_samples(topology, gluon_calls):
    """A pack of short samples (the forward's short-samples Gluon tile), causal, under a window: all three Gluon
    passes against the float64 reference."""
    dev = torch.device("cuda")
    packs = [[300, 500, 200], [1000, 0, 40], [20, 1500, 700], [64, 64, 64]]
    total = sum(map(sum, packs))
    q, k, v = make_qkv(1, 16, 4, total, total, 128, torch.bfloat16, dev)
    with _gluon_everywhere(128, torch.bfloat16):
        out = mbs_attention_varlen(q, k, v, topology, packs, causal=True, window=300)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(topology, packs, causal=True, window=300))
    assert sorted(gluon_calls) == ["dkdv", "dq", "forward"]
