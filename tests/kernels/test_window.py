"""Sliding windows (key position > query position - W) on the kernels: output and dq/dk/dv against the float64
reference over random topologies, pair types and windows (one key, under a tile, across tiles, past the sequence),
causal, GQA, decoding (per-sample first queries, the split and GQA-packed forwards), packs, per-sample lengths,
dense masks, dropout, the compiled op; and the Triton-built block lists against the torch classes."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import (
    Topology,
    TritonMBSAttnKernel,
    mbs_attention,
    mbs_attention_varlen,
    reference_mask,
    reference_packed_mask,
)
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from mmsparse.mask.bit_lists import build_block_lists
from mmsparse.mask.blocks import lists_from_classes
from mmsparse.mask.build import build_mask_info
from mmsparse.mask.code_lists import CodeRuns, build_segment_lists
from mmsparse.mask.info import MaskInfo
from mmsparse.nn import MultimodalSelfAttention
from tests.helpers import HUB, RING, check_against_reference, check_outputs, make_qkv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _random_case(seed: int) -> dict:
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    types = (0, 1, 2) if seed % 2 else (0, 1)  # odd seeds: pair types (segment codes); even: 0/1 (token bits)
    # Each segment sees itself (so no case is empty), the other pairs at random.
    topo = [[rng.choice(types[1:]) if r == c else rng.choice(types) for c in range(k)] for r in range(k)]
    lens = [rng.choice([0, 1, rng.randint(2, 20), rng.randint(20, 60), rng.randint(40, 90)]) for _ in range(k)]
    if sum(lens) < 60:  # several tiles of 16 and 32
        lens[-1] += 60
    seq_k = sum(lens)
    # The interpreter's tiles are 16 and 32 wide: one key, under a tile, a tile, across tiles, past the sequence.
    window = [1, 5, 16, 23, 40, seq_k - 1, seq_k + 10][seed % 7]
    heads, kv_heads = rng.choice([(2, 2), (4, 2), (3, 1)])
    return dict(topology=topo, seg_lens=lens, causal=rng.random() < 0.5, window=window,
                seq_q=seq_k if rng.random() < 0.7 else rng.randint(1, seq_k), batch=rng.choice([1, 2]),
                heads=heads, kv_heads=kv_heads, head_dim=[16, 32, 40][seed % 3], dtype=DTYPES[seed % 3])


def _case_id(seed: int) -> str:
    c = _random_case(seed)
    return (f"k{len(c['seg_lens'])}-W{c['window']}-B{c['batch']}-H{c['heads']}x{c['kv_heads']}-Sq{c['seq_q']}"
            f"-S{sum(c['seg_lens'])}-D{c['head_dim']}-{str(c['dtype'])[6:]}{'-causal' if c['causal'] else ''}")


@pytest.mark.parametrize("seed", range(21), ids=_case_id)
def test_random_topologies_and_windows(seed, device):
    c = _random_case(seed)
    gen = torch.Generator().manual_seed(500 + seed)
    q, k, v = make_qkv(c["batch"], c["heads"], c["kv_heads"], c["seq_q"], sum(c["seg_lens"]), c["head_dim"],
                       c["dtype"], device, gen)
    _, mask = check_against_reference(q, k, v, c["topology"], c["seg_lens"], causal=c["causal"], window=c["window"])
    assert mask.any()


@pytest.mark.parametrize("topology", [RING, [[2, 1, 0], [1, 2, 1], [0, 1, 1]]], ids=["bits", "codes"])
@pytest.mark.parametrize("window", [1, 7, 33])
def test_future_keys_of_full_pairs_stay(topology, window, device):
    """Without causal a FULL pair keeps every later key of its segment: the window bounds only the past."""
    lens = (21, 30, 19)
    q, k, v = make_qkv(1, 2, 1, 70, 70, 16, torch.float32, device)
    check_against_reference(q, k, v, topology, lens, window=window)
    mask = reference_mask(topology, lens, 70, window=window)[0]
    assert mask[0, 30] and mask[25, 60] and not mask[40, 40 - window]  # future keys kept, the far past not


def test_per_sample_lengths_with_padding(device):
    lens = [(4, 20, 10), (0, 31, 5), (0, 0, 0)]
    q, k, v = make_qkv(3, 2, 1, 40, 40, 16, torch.float32, device)
    out, mask = check_against_reference(q, k, v, HUB, lens, causal=True, window=9)
    assert mask[:2].flatten(1).any(1).all() and not mask[2].any()
    assert torch.all(out[0, :, 34:] == 0) and torch.all(out[2] == 0)


@pytest.mark.parametrize("heads,kv_heads,q_len", [(4, 2, 1), (8, 2, 3), (2, 2, 1), (8, 1, 16)])
def test_decoding_with_per_sample_first_queries(heads, kv_heads, q_len, device):
    """Decode steps over caches of different lengths: the split-KV forward (few programs) and the GQA-packed
    tile; each query's band starts at its own absolute position (q_start)."""
    lens, q_start = [(5, 30, 7), (12, 20, 20)], [30, 52 - q_len]
    q, k, v = make_qkv(2, heads, kv_heads, q_len, 52, 32, torch.float32, device)
    for topology in (HUB, [[2, 1, 0], [1, 2, 2], [2, 1, 2]]):
        for t in (q, k, v):
            t.grad = None
        check_against_reference(q, k, v, topology, lens, causal=True, window=13, q_start=q_start)


def test_decoding_plans_split_with_a_window(device):
    """A decode step takes the split forward on the CPU, with the band's edge inside a key tile (the query at 69
    keeps keys 55 on: of key tile 48-63, which holds segment 2 from 50, keys 55-63): the split path masks it."""
    from mmsparse.attention.kernel_args import kernel_args

    q, k, v = make_qkv(1, 2, 1, 1, 70, 16, torch.float32, device)
    check_against_reference(q, k, v, HUB, (10, 40, 20), causal=True, window=15)
    info = build_mask_info(HUB, (10, 40, 20), 1, 70, True, q.device, window=15)
    (call,) = kernel_args(info).calls.values()
    plan = call.forward
    if device.type == "cpu":
        assert plan.n_splits > 1


@pytest.mark.parametrize("topology", [HUB, [[1, 2], [2, 1]]], ids=["bits", "codes"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_samples(topology, causal, device):
    """mbs_attention_varlen: the window runs over the packed positions inside each sample."""
    lens = [[5, 9, 3][: len(topology)], [20, 0, 14][: len(topology)], [1, 30, 2][: len(topology)]]
    total = sum(sum(r) for r in lens)
    q, k, v = make_qkv(1, 4, 2, total, total, 16, torch.float32, device)
    out = mbs_attention_varlen(q, k, v, topology, lens, causal=causal, window=6)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(topology, lens, causal=causal, window=6))


def test_dense_mask_with_a_window(device):
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 45, 45, generator=gen) < 0.5
    q, k, v = make_qkv(2, 2, 2, 45, 45, 16, torch.float32, device, gen)
    out = mbs_attention(q, k, v, attn_mask=mask.to(device), causal=True, window=10)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    pos = torch.arange(45)
    check_outputs(q, k, v, out, grad_out, mask & (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 10))


def test_dropout_with_a_window(device):
    p, lens = 0.3, (9, 30, 21)
    q, k, v = make_qkv(2, 2, 1, 60, 60, 32, torch.float32, device)
    torch.manual_seed(77)
    out = mbs_attention(q, k, v, HUB, lens, causal=True, dropout_p=p, window=17)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.manual_seed(77)
    keep = dropout_keep_mask(new_dropout_seed(q.device), 2, 2, 60, 60, p)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 60, causal=True, window=17), dropout_keep=keep,
                  dropout_p=p)
    assert not torch.equal(out, mbs_attention(q, k, v, HUB, lens, causal=True, window=17))


@pytest.mark.parametrize("topology", [RING, [[1, 2, 0], [2, 1, 1], [0, 0, 2]]], ids=["bits", "codes"])
def test_a_window_of_the_sequence_or_more_is_none(topology, device):
    """W >= S keeps every key: bit for bit the call without a window (the no-window kernels run)."""
    lens = (11, 20, 15)
    results = []
    for window in (None, 46, 1000):
        gen = torch.Generator().manual_seed(9)
        q, k, v = make_qkv(1, 2, 1, 46, 46, 16, torch.float16, device, gen)
        out = mbs_attention(q, k, v, topology, lens, causal=True, window=window)
        out.backward(torch.randn(out.shape, generator=gen).to(device, out.dtype))
        results.append((out, q.grad, k.grad, v.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    assert build_mask_info(topology, lens, 46, 46, True, torch.device(device), window=46).window is None
    assert build_mask_info(topology, lens, 46, 46, True, torch.device(device), window=45).window == 45


def test_the_cache_keeps_windows_apart(device):
    """The mask cache keys on the window: W = 3 after W = 30 (same topology and lengths) is not the W = 30 mask."""
    lens = (10, 20, 15)
    q, k, v = make_qkv(1, 2, 2, 45, 45, 16, torch.float32, device)
    for window in (30, 3, None):
        for t in (q, k, v):
            t.grad = None
        check_against_reference(q, k, v, HUB, lens, causal=True, window=window)


@pytest.mark.parametrize(
    "window, error, match",
    [(0, ValueError, "positive int"), (-4, ValueError, "positive int"), (2.5, TypeError, "positive int"),
     ("16", TypeError, "positive int"), (True, TypeError, "positive int")],
)
def test_bad_windows_raise(window, error, match, device):
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, torch.float32, device)
    with pytest.raises(error, match=match):
        mbs_attention(q, k, v, HUB, (5, 5, 10), window=window)
    with pytest.raises(error, match=match):
        mbs_attention(q, k, v, attn_mask=torch.ones(20, 20, dtype=torch.bool, device=device), window=window)
    with pytest.raises(error, match=match):
        mbs_attention_varlen(q, k, v, HUB, [(5, 5, 10)], window=window)
    with pytest.raises(error, match=match):
        TritonMBSAttnKernel(HUB, (5, 5, 10), window=window)
    with pytest.raises(error, match=match):
        MultimodalSelfAttention(32, 2, HUB, (5, 5, 10), window=window)


def test_module_and_layer(device):
    """TritonMBSAttnKernel and MultimodalSelfAttention carry the window to the kernels."""
    lens = (7, 25, 12)
    attn = TritonMBSAttnKernel(HUB, lens, causal_mask=True, window=11)
    q, k, v = make_qkv(2, 2, 1, 44, 44, 16, torch.float32, device)
    torch.testing.assert_close(attn(q, k, v), mbs_attention(q, k, v, HUB, lens, causal=True, window=11),
                               rtol=0, atol=0)
    assert "window=11" in repr(attn)
    layer = MultimodalSelfAttention(32, 2, HUB, lens, num_kv_heads=1, causal=True, window=11).to(device)
    x = torch.randn(2, 44, 32, device=device)
    expected = layer.out_proj(mbs_attention(
        layer.q_proj(x).view(2, 44, 2, 16).transpose(1, 2), layer.k_proj(x).view(2, 44, 1, 16).transpose(1, 2),
        layer.v_proj(x).view(2, 44, 1, 16).transpose(1, 2), HUB, lens, causal=True, window=11,
    ).transpose(1, 2).reshape(2, 44, 32))
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    no_window = MultimodalSelfAttention(32, 2, HUB, lens, num_kv_heads=1, causal=True).to(device)
    no_window.load_state_dict(layer.state_dict())
    assert not torch.equal(no_window(x), layer(x))


def test_compiled_call(device):
    """torch.compile(fullgraph=True): the custom ops carry the window."""
    torch._dynamo.reset()
    lens, topology = (10, 20, 18), [[2, 0, 0], [1, 1, 0], [1, 1, 2]]
    q, k, v = make_qkv(1, 2, 1, 48, 48, 16, torch.float32, device)
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, topology, lens, window=9), fullgraph=True,
                             backend="eager")
    out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = mbs_attention(q, k, v, topology, lens, window=9)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=1e-6, atol=1e-6)


def _same_lists(got, want, columns: int) -> None:
    (got_counts, got_ids), (want_counts, want_ids) = got.padded(columns), want.padded(columns)
    assert torch.equal(got_counts, want_counts), f"counts differ at {(got_counts != want_counts).nonzero()[:5]}"
    assert torch.equal(got_ids, want_ids), f"ids differ at {(got_ids != want_ids).nonzero()[:5]}"


@pytest.mark.parametrize("mode", ["bits", "codes"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 9, 40])
def test_triton_lists_match_the_torch_classes(mode, causal, window, device):
    """The Triton builders (token bits; segment-code runs) give the torch classes' lists, by query and by key,
    fixed-slot and packed, with per-sample first queries; no listed tile lies wholly before the band."""
    topo = RING if mode == "bits" else [[2, 1, 0], [0, 2, 1], [1, 0, 1]]
    lens = torch.tensor([(13, 40, 22), (30, 0, 41)], device=device)
    seq_q, seq_k = 50, 75
    q_start = torch.tensor([25, 12], device=device, dtype=torch.int32)
    topology = Topology(topo)
    if mode == "bits":
        info = MaskInfo.from_topology(topology, lens, seq_q, seq_k, causal, q_start, window)
    else:
        info = MaskInfo.from_segments(topology, lens, seq_q, seq_k, causal, q_start, window=window)
    # Both shapes of tile (more rows than keys, and fewer): the interpreter's forward / dQ and dK/dV tiles. The
    # square decode tile's windowed lists run end to end in the decoding tests above, against the reference.
    for bm, bn in ((32, 16), (16, 32)):
        live, full = info.classes(bm, bn)
        nq, nk = live.shape[1:]
        # Before the band: the tile's last key is at or before its first query minus W.
        k_last = torch.clamp(torch.arange(1, nk + 1) * bn, max=seq_k) - 1
        q_first = q_start.cpu().long()[:, None] + torch.arange(nq) * bm
        before = k_last[None, None, :] <= q_first[:, :, None] - window
        assert not (live.cpu() & before).any()
        for by_key in (False, True):
            ref = lists_from_classes(*(x.transpose(1, 2) if by_key else x for x in (live, full)))
            columns = nq if by_key else nk
            for compact in (False, True):
                if mode == "bits":
                    got = build_block_lists(info.q_bits, info.k_bits, 3, bm, bn, causal, q_start, by_key,
                                            compact=compact, window=window)
                else:
                    runs = CodeRuns(info.q_codes), CodeRuns(info.k_codes)
                    got = build_segment_lists(*runs, info.table, bm, bn, causal, q_start, by_key, compact=compact,
                                              window=window)
                _same_lists(got, ref, columns)
