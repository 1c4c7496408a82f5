"""Sparse vs dense: output and dq/dk/dv of the Triton kernels against the float64 dense reference."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import TritonMBSAttnKernel, mbs_attention, reference_mask
from tests.helpers import CYCLIC, check_against_reference, check_outputs, make_qkv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [16, 40, 64, 128]


def _random_case(seed: int) -> dict:
    rng = random.Random(seed)
    k = rng.randint(1, 6)
    topo = [[int(rng.random() < 0.5) for _ in range(k)] for _ in range(k)]
    lens = [rng.choice([0, 1, rng.randint(2, 20), rng.randint(20, 60)]) for _ in range(k)]
    if sum(lens) == 0:
        lens[0] = 7
    seq_k = sum(lens)
    heads, kv_heads = rng.choice([(2, 2), (4, 2), (3, 1)])
    return dict(
        topology=topo,
        seg_lens=lens,
        causal=rng.random() < 0.5,
        seq_q=seq_k if rng.random() < 0.6 else rng.randint(1, seq_k),
        batch=rng.choice([1, 2]),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=HEAD_DIMS[seed % len(HEAD_DIMS)],
        dtype=DTYPES[seed % len(DTYPES)],
    )


def _case_id(seed: int) -> str:
    c = _random_case(seed)
    return (f"k{len(c['seg_lens'])}-B{c['batch']}-H{c['heads']}x{c['kv_heads']}-Sq{c['seq_q']}-S{sum(c['seg_lens'])}"
            f"-D{c['head_dim']}-{str(c['dtype'])[6:]}{'-causal' if c['causal'] else ''}")


@pytest.mark.parametrize("seed", range(24), ids=_case_id)
def test_random_topologies(seed, device):
    c = _random_case(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    q, k, v = make_qkv(c["batch"], c["heads"], c["kv_heads"], c["seq_q"], sum(c["seg_lens"]), c["head_dim"],
                       c["dtype"], device, gen)
    check_against_reference(q, k, v, c["topology"], c["seg_lens"], causal=c["causal"])


# fp16 on the GPU only: on a CPU every dtype gets the same tiles, so fp16 would rerun bf16's kernels and block
# lists at a 16-bit dtype (fp16 runs end to end in the random topologies and the empty-row test).
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.gpu), torch.bfloat16],
                         ids=lambda d: str(d)[6:])
def test_seed_example(dtype, device):
    """The seed's own case: cyclic topology, segments (50, 375, 500); one head, as the CI-sized demo runs it (GQA
    is covered by the random topologies)."""
    q, k, v = make_qkv(1, 1, 1, 925, 925, 16, dtype, device)
    check_against_reference(q, k, v, CYCLIC, (50, 375, 500))


def test_module_matches_functional_and_reference(device):
    attn = TritonMBSAttnKernel(CYCLIC, (5, 30, 21), causal_mask=True, softmax_scale=0.3)
    q, k, v = make_qkv(2, 2, 2, 40, 56, 32, torch.float32, device)
    out = attn(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, mbs_attention(q, k, v, CYCLIC, (5, 30, 21), causal=True, softmax_scale=0.3),
                               rtol=0, atol=0)
    check_against_reference(q, k, v, CYCLIC, (5, 30, 21), causal=True, softmax_scale=0.3)


def test_rows_that_attend_nothing_are_zero(device):
    """Segment 1 sees nothing: its rows output exactly 0, its q gradients are 0, and nothing is NaN."""
    topo = [[1, 1, 0], [0, 0, 0], [1, 0, 1]]
    lens = (13, 22, 9)
    q, k, v = make_qkv(1, 2, 2, 44, 44, 16, torch.float16, device)
    out, _ = check_against_reference(q, k, v, topo, lens)
    assert torch.all(out[:, :, 13:35] == 0)
    assert torch.all(q.grad[:, :, 13:35] == 0)


def test_zero_length_segments_and_single_tokens(device):
    q, k, v = make_qkv(2, 2, 1, 35, 35, 40, torch.bfloat16, device)
    check_against_reference(q, k, v, [[1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1], [1, 1, 1, 1]], (0, 1, 34, 0),
                            causal=True)


def test_decode_like_short_queries(device):
    """q_len < kv_len: the queries are the last positions (the seed's PAST_LEN), with causal."""
    q, k, v = make_qkv(2, 4, 2, 3, 70, 64, torch.float32, device)
    check_against_reference(q, k, v, CYCLIC, (10, 40, 20), causal=True)


def test_topology_path_equals_dense_mask_path(device):
    """The same mask given as a topology or as a dense bool mask: equal outputs and gradients. Bit for bit
    through the interpreter; compiled for a GPU the two kernel variants may reduce rows in a different order
    (the loaded mask tile changes Triton's layouts), so there they must agree to fp16 rounding."""
    topo, lens = [[1, 0, 1], [1, 1, 0], [0, 1, 1]], (17, 29, 20)
    results = []
    for use_mask in (False, True):
        gen = torch.Generator().manual_seed(7)
        q, k, v = make_qkv(2, 2, 2, 50, 66, 32, torch.float16, device, gen)
        if use_mask:
            out = mbs_attention(q, k, v, causal=True, attn_mask=reference_mask(topo, lens, 66, 66)[0])
        else:
            out = mbs_attention(q, k, v, topo, lens, causal=True)
        out.backward(torch.randn(out.shape, generator=gen).to(device, out.dtype))
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        if device.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_dense_mask_batch(device):
    """Arbitrary per-sample masks [B, S, S] against the reference."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 45, 45, generator=gen) < 0.3
    mask[1, 7] = False  # a row that sees nothing
    q, k, v = make_qkv(2, 2, 2, 45, 45, 16, torch.float32, device, gen)
    out = mbs_attention(q, k, v, None, None, attn_mask=mask.to(device))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)


def test_backward_is_deterministic(device):
    q, k, v = make_qkv(1, 4, 1, 60, 60, 32, torch.bfloat16, device)
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        out = mbs_attention(q, k, v, CYCLIC, (11, 27, 22))
        out.backward(torch.ones_like(out))
        grads.append((out.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_non_contiguous_inputs(device):
    """q, k, v as transposed views of [B, S, H, D] tensors: strides are honoured without copies."""
    base = [torch.randn(2, 50, 2, 40, device=device, dtype=torch.float16) for _ in range(3)]
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in base)
    assert not q.is_contiguous()
    check_against_reference(q, k, v, CYCLIC, (9, 21, 20), causal=True)


def test_kernel_layout_copies_only_what_the_kernels_cannot_read():
    """Unit head-dim stride, other strides multiples of 8 elements, a 16-byte aligned base: passed as is; else one
    contiguous copy."""
    from mmsparse.attention.layouts import kernel_layout

    x = torch.randn(2, 3, 5, 16)
    for view in (x, torch.randn(2, 5, 3, 16).transpose(1, 2), x[..., :8]):
        assert kernel_layout(view) is view
    odd_rows = torch.randn(2, 3, 5, 20)[..., :16]  # row stride 20
    misaligned = torch.randn(2 * 3 * 5 * 16 + 1)[1:].view(2, 3, 5, 16)  # base 4 bytes off
    column_major = torch.randn(2, 3, 16, 5).transpose(2, 3)  # head dim not unit-stride
    for view in (odd_rows, misaligned, column_major):
        fixed = kernel_layout(view)
        assert fixed is not view and fixed.is_contiguous() and torch.equal(fixed, view)
        assert not fixed.data_ptr() & 15


def test_per_sample_lengths_with_padding(device):
    """Per-sample [B, k] lengths: each sample's tail is padding; padded queries give 0 and zero gradients."""
    lens = [(4, 20, 10), (0, 31, 5), (0, 0, 0)]
    q, k, v = make_qkv(3, 2, 1, 40, 40, 16, torch.float32, device)
    out = mbs_attention(q, k, v, CYCLIC, lens)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    mask = reference_mask(CYCLIC, lens, 40)
    check_outputs(q, k, v, out, grad_out, mask)
    assert torch.all(out[0, :, 34:] == 0) and torch.all(out[2] == 0)
    assert torch.all(k.grad[1, :, 36:] == 0) and torch.all(v.grad[2] == 0)


def test_pointer_loads_match_tensor_descriptors(device):
    """The pre-Hopper path (plain pointer loads) gives bit-for-bit the results of the TMA descriptor path."""
    from dataclasses import replace

    from mmsparse.attention.config import kernel_config, use_tuning

    results = []
    for use_tma in (True, False):
        gen = torch.Generator().manual_seed(11)
        q, k, v = make_qkv(2, 2, 1, 37, 53, 40, torch.float16, device, gen)
        with use_tuning(replace(kernel_config(40, torch.float16, device), use_tma=use_tma)):
            out = mbs_attention(q, k, v, CYCLIC, (3, 31, 19), causal=True)
            out.backward(torch.randn(out.shape, generator=gen).to(device, out.dtype))
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)



@pytest.mark.parametrize("topology", [CYCLIC, [[2, 0, 1], [1, 1, 0], [2, 2, 2]]], ids=["bits", "codes"])
def test_packed_block_lists(topology, device):
    """Lists packed end to end (CSR, what large masks get) give bit for bit the fixed-slot lists' results, and
    match the reference: forward and the three gradients, per-sample lengths, GQA, causal."""
    from mmsparse import clear_caches
    from mmsparse.mask import bit_lists
    from mmsparse.mask.cache import CACHE
    from mmsparse.tuning import use_tuning

    # Several query and key tiles a sample at the device's tiles (a GPU's are 4-8x the interpreter's): with one
    # row of tiles, packed lists start where fixed slots do and the layouts cannot be told apart.
    scale = 1 if device.type == "cpu" else 8
    lens = [tuple(n * scale for n in row) for row in [(5, 30, 9), (17, 0, 20), (1, 2, 3)]]
    results = []
    for compact_bytes in (bit_lists.COMPACT_BYTES, 0):
        clear_caches()  # masks built afresh, with this layout
        with use_tuning(compact_bytes=compact_bytes):
            gen = torch.Generator().manual_seed(5)
            q, k, v = make_qkv(3, 4, 2, 44 * scale, 44 * scale, 32, torch.float32, device, gen)
            torch.manual_seed(6)  # the same output gradient
            out, _ = check_against_reference(q, k, v, topology, lens, causal=True)
        results.append((out, q.grad, k.grad, v.grad))
        lists = [lst for mask in CACHE.masks() for lst in mask._lists.values()]
        # fixed slots start row r at r * C; packed lists end to end, the first empty row's start shared by the next
        packed = [bool((lst.counts[..., 2] != torch.arange(lst.counts.shape[1], device=device) *
                        (lst.indices.shape[1] // max(lst.counts.shape[1], 1))).any()) for lst in lists]
        assert lists and all(packed) == (compact_bytes == 0) and any(packed) == (compact_bytes == 0), packed
    for a, b in zip(*results):
        assert torch.equal(a, b)



@pytest.mark.parametrize("tile", ["tma", "pointers", "small", "one_pass"])
def test_wide_head_dim_tl_dkdv_tiles(tile, device):
    """Each tl dK/dV tile the tables give at head dims 129-256 (by the GPU's shared memory, and the one pass's),
    at head dim 136 (padded to 256), against the float64 reference: output and all three gradients, pair types,
    GQA, a segment longer than a key block; then fewer queries than keys with a segment that sees nothing (rows
    fully masked) and one of zero length."""
    from dataclasses import replace

    from mmsparse.attention.config import WIDE_DKDV_TILES, WIDE_ONE_PASS_TMA, cuda_kernel_config, use_tuning

    tiles = {"tma": WIDE_DKDV_TILES[0][1], "pointers": WIDE_DKDV_TILES[1][1], "small": WIDE_DKDV_TILES[2][1],
             "one_pass": WIDE_ONE_PASS_TMA}
    cfg = cuda_kernel_config(136, torch.float16, gluon=False)
    cfg = replace(cfg, bwd_dkdv=tiles[tile], bwd_one_pass=tiles[tile], use_tma=tile != "pointers")
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(1, 2, 1, 97, 97, 136, torch.float16, device, gen)
    with use_tuning(cfg):
        check_against_reference(q, k, v, [[2, 0, 1], [1, 1, 0], [2, 2, 2]], (20, 70, 7),
                                deterministic=tile != "one_pass")
        q, k, v = make_qkv(1, 2, 1, 61, 97, 136, torch.float16, device, gen)
        check_against_reference(q, k, v, [[1, 0, 0, 0], [0, 0, 0, 0], [1, 2, 1, 0], [1, 1, 2, 2]], (20, 30, 0, 47),
                                deterministic=tile != "one_pass")


def test_wide_head_dim_dropout_on_the_hopper_table(device):
    """With dropout, Hopper's table at head dims 129-256 runs every pass's tl kernel: the forward at the Gluon
    forward's tile, dQ and dK/dV at the tl table's (``bwd_dq_dropout``, ``bwd_dkdv_dropout``). Through the
    interpreter at head dim 136, against float64 with the same keep mask: output and all three gradients."""
    from mmsparse.attention.config import cuda_kernel_config, use_tuning
    from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed

    cfg = cuda_kernel_config(136, torch.float16)
    assert cfg.bwd_dq.gluon and not cfg.bwd_dq_dropout.gluon and not cfg.bwd_dkdv_dropout.gluon
    gen = torch.Generator().manual_seed(4)
    q, k, v = make_qkv(1, 2, 1, 97, 97, 136, torch.float16, device, gen)
    lens, p = (20, 70, 7), 0.25
    torch.manual_seed(8)
    with use_tuning(cfg):
        out = mbs_attention(q, k, v, CYCLIC, lens, dropout_p=p)
    grad_out = torch.randn(out.shape, generator=gen).to(device, out.dtype)
    out.backward(grad_out)
    torch.manual_seed(8)
    keep = dropout_keep_mask(new_dropout_seed(q.device), 1, 2, 97, 97, p)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, 97), dropout_keep=keep, dropout_p=p)
