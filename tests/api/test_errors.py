"""Bad input gets a ValueError/TypeError that names the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmsparse import Topology, TritonMBSAttnKernel, generate_interlaced_mask, mbs_attention, mbs_attention_varlen
from mmsparse.nn import MultiheadMBSAttention, MultimodalSelfAttention
from tests.helpers import CYCLIC


def qkv(device, b=1, hq=2, hk=2, sq=20, sk=20, d=16, dtype=torch.float32):
    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    return rnd(b, hq, sq, d), rnd(b, hk, sk, d), rnd(b, hk, sk, d)


@pytest.mark.parametrize(
    "topology, match",
    [
        ([[1, 0], [1]], "square|matrix"),
        ([[1, 0, 1], [0, 1, 1]], "square"),
        ([[3, 0], [0, 1]], "0 \\(none\\), 1 \\(full\\) or 2 \\(causal\\)"),
        ([[0.5]], "0 \\(none\\), 1 \\(full\\) or 2 \\(causal\\)"),
        ([], "square"),
        (np.ones((4096, 4096)), "at most 4095"),
        ("abc", "matrix"),
    ],
    ids=["ragged", "not-square", "entry-3", "entry-half", "empty", "too-many-segments", "string"],
)
def test_bad_topology(topology, match):
    with pytest.raises(ValueError, match=match):
        Topology(topology)


def test_topology_accepts_all_containers():
    ref = Topology(CYCLIC)
    for form in (tuple(map(tuple, CYCLIC)), np.array(CYCLIC), torch.tensor(CYCLIC), torch.tensor(CYCLIC).bool()):
        assert Topology(form) == ref
    with pytest.raises(ValueError, match="names"):
        Topology(CYCLIC, names=("text", "vision"))


@pytest.mark.parametrize(
    "seg_lens, exc, match",
    [
        ((5, 5), ValueError, "3 segments"),
        ((5, -1, 16), ValueError, "negative"),
        ((5, 5, 5), ValueError, "sum"),
        ((5.0, 5, 10), TypeError, "int"),
        ([(5, 5, 10), (5, 5)], ValueError, "3 segments"),
        ([(5, 5, 10), (5, 5, 11)], ValueError, "more than"),
        (torch.tensor([[5, 5, 10], [1, 1, 1]]), ValueError, "rows"),
        (torch.tensor([[5, -1, 16]]), ValueError, r"seg_lens\[0\].*negative"),
        (torch.tensor([[5, 5, 11]]), ValueError, "more than"),
        (None, ValueError, "required"),
        ([], ValueError, "3 segments"),
    ],
    ids=["count", "negative", "sum", "float", "ragged-per-sample", "per-sample-too-long", "batch-mismatch",
         "tensor-negative", "tensor-too-long", "none", "empty"],
)
def test_bad_seg_lens(seg_lens, exc, match, device):
    q, k, v = qkv(device)
    with pytest.raises(exc, match=match):
        mbs_attention(q, k, v, CYCLIC, seg_lens)


def test_bad_tensors(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="4-D"):
        mbs_attention(q[0], k, v, CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match="share one dtype"):
        mbs_attention(q.half(), k, v, CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match="dtype"):
        mbs_attention(q.double(), k.double(), v.double(), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        mbs_attention(*qkv(device, hq=3, hk=2), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="head dim"):
        mbs_attention(*qkv(device, d=12), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="head dim"):
        mbs_attention(*qkv(device, d=264), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="same shape"):
        mbs_attention(q, k, v[:, :, :10], CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="last q_len"):
        mbs_attention(*qkv(device, sq=30), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="batch"):
        mbs_attention(q, *qkv(device, b=2)[1:], CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mbs_attention(q.tolist(), k, v, CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="dropout_p"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10), dropout_p=1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10), softmax_scale=-1.0)


def test_bad_attn_mask(device):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match="bool"):
        mbs_attention(q, k, v, None, None, attn_mask=torch.ones(20, 20, device=device))
    with pytest.raises(ValueError, match="shape"):
        mbs_attention(q, k, v, None, None, attn_mask=torch.ones(19, 20, dtype=torch.bool, device=device))


def test_mixed_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device next to the CPU")
    q, k, v = qkv(torch.device("cpu"))
    with pytest.raises(ValueError, match="one device"):
        mbs_attention(q.cuda(), k, v, CYCLIC, (5, 5, 10))


def test_cpu_tensors_without_interpreter(monkeypatch):
    from mmsparse import checks

    # The interpreter is fixed when triton is imported (on for the session): faking it off is the only way here.
    monkeypatch.setattr(checks, "interpreter_active", lambda: False)
    q, k, v = qkv(torch.device("cpu"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10))


def test_module_checks(device):
    with pytest.raises(ValueError, match="dropout"):
        TritonMBSAttnKernel(CYCLIC, (5, 5, 10), dropout=1.5)
    attn = TritonMBSAttnKernel(CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="sum to 20"):
        attn(*qkv(device, sq=21, sk=21))
    assert "seg_lens=(5, 5, 10)" in repr(attn)


def test_interlaced_mask_matches_segment_loop():
    """generate_interlaced_mask against a direct loop over the topology's blocks."""
    topo, lens = [[1, 0, 1], [0, 0, 1], [1, 1, 0]], (3, 0, 5)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    starts = [0, 3, 3]
    for r in range(3):
        for c in range(3):
            if topo[r][c]:
                expected[starts[r]:starts[r] + lens[r], starts[c]:starts[c] + lens[c]] = True
    assert torch.equal(generate_interlaced_mask(topo, lens), expected)


def test_softmax_scale_is_named(device):
    """A scale that is no number names the argument, at the module's construction and at a call."""
    with pytest.raises(TypeError, match="softmax_scale must be a positive float or None.*str 'x'"):
        TritonMBSAttnKernel(CYCLIC, (5, 5, 10), softmax_scale="x")
    with pytest.raises(ValueError, match="softmax_scale must be a finite positive number"):
        TritonMBSAttnKernel(CYCLIC, (5, 5, 10), softmax_scale=0.0)
    # the Hopper backward adds -lse / scale to the scores: below 1e-30 it could overflow (1e-30 itself is taken)
    with pytest.raises(ValueError, match="softmax_scale must be at least 1e-30; got 1e-31"):
        mbs_attention(*qkv(device), CYCLIC, (5, 5, 10), softmax_scale=1e-31)
    TritonMBSAttnKernel(CYCLIC, (5, 5, 10), softmax_scale=1e-30)
    with pytest.raises(TypeError, match="softmax_scale must be a positive float or None"):
        mbs_attention(*qkv(device), CYCLIC, (5, 5, 10), softmax_scale="x")


@pytest.mark.parametrize("heads", [(0, 0), (0, 2), (2, 0)], ids=["none", "no-query-heads", "no-kv-heads"])
def test_zero_heads(heads, device):
    with pytest.raises(ValueError, match="heads must be positive"):
        mbs_attention(*qkv(device, hq=heads[0], hk=heads[1]), CYCLIC, (5, 5, 10))


def test_counts_in_messages_agree_in_number(device):
    rows = [(5, 5, 10), (5, 5, 10)]
    with pytest.raises(ValueError, match="has 2 rows but the batch has 1 sample$"):
        mbs_attention(*qkv(device), CYCLIC, rows)
    with pytest.raises(ValueError, match="has 2 rows but the batch has 1 sample$"):
        TritonMBSAttnKernel(CYCLIC, (5, 5, 10))(*qkv(device), seg_lens=rows)
    with pytest.raises(ValueError, match="q_start has 1 entry but seg_lens has 2 rows"):
        mbs_attention(*qkv(device, b=2), CYCLIC, rows, q_start=[0])
    q, k, v = qkv(device, sq=4)
    with pytest.raises(ValueError, match="^q_start has 2 entries but the batch has 1 sample$"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10), q_start=[1, 2])
    with pytest.raises(ValueError, match="^q_start has 3 entries but the batch has 1 sample$"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10), q_start=torch.tensor([1, 2, 3], device=device))


def test_negative_length_names_its_row(device):
    q, k, v = qkv(device, sq=30, sk=30)
    with pytest.raises(ValueError, match=r"seg_lens\[1\]\[1\] = -2 is negative"):
        mbs_attention_varlen(q, k, v, CYCLIC, [(5, 5, 2), (10, -2, 10)])
    with pytest.raises(ValueError, match=r"seg_lens\[1\]\[2\] = -1 is negative"):
        mbs_attention(*qkv(device, b=2), CYCLIC, [(5, 5, 10), (5, 5, -1)])


def test_float64_points_at_the_reference(device):
    q, k, v = qkv(device, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64.*mmsparse.reference_attention"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_layer_input_dtype_against_its_weights(dtype, device):
    """The layer names both dtypes and the casts that fix it, before torch's matmul error deep inside."""
    layer = MultimodalSelfAttention(32, 2, CYCLIC, (5, 5, 10), device=device)
    x = torch.randn(1, 20, 32, device=device, dtype=dtype)
    with pytest.raises(TypeError, match=f"input has dtype {dtype} but the module's weights are torch.float32"):
        layer(x)
    mha = torch.nn.MultiheadAttention(32, 2, batch_first=True, device=device)
    block = MultiheadMBSAttention(mha, CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match=f"input has dtype {dtype} but the module's weights are torch.float32"):
        block(x, x, x)
    with pytest.raises(TypeError, match="float64.*reference_attention"):
        layer.double()(x.double())


FORMS = r"seg_lens must be k segment lengths \(a list or tuple of k ints, one per segment\), per-sample \[B, k\] rows"
NOT_LENGTHS = {
    "int": (20, TypeError, FORMS + r".*; got int 20 \(one segment of 20 tokens is \[20\]\)"),
    "numpy-int": (np.int64(20), TypeError, FORMS + r".*; got int64 .*\(one segment of 20 tokens is \[20\]\)"),
    "numpy-0d": (np.array(20), TypeError, FORMS + r".*; got ndarray"),
    "float": (20.0, TypeError, FORMS + r".*; got float 20\.0"),
    "string": ("5 5 10", TypeError, FORMS + r".*; got str '5 5 10'"),
    "bytes": (bytes([5, 5, 10]), TypeError, FORMS + r".*; got bytes"),
    "set": ({5, 10}, TypeError, r"got set .*unordered collection: list the lengths in segment order"),
    "dict": ({0: 5, 1: 5, 2: 10}, TypeError, r"got dict .*unordered collection"),
    "meta": (torch.tensor([5, 5, 10], device="meta"), ValueError,
             r"seg_lens is a tensor on the meta device; lengths must be on the CPU or on q's device"),
    "meta-per-sample": (torch.tensor([[5, 5, 10]], device="meta"), ValueError, r"on the meta device"),
    "tensor-3d": (torch.tensor([[[5, 5, 10]]]), ValueError, r"a seg_lens tensor must be 3 lengths or per-sample "
                                                            r"\[batch, 3\]; got shape \(1, 1, 3\)"),
}


@pytest.mark.parametrize("seg_lens, exc, match", NOT_LENGTHS.values(), ids=NOT_LENGTHS)
def test_seg_lens_that_are_not_lengths_say_what_they_must_be(seg_lens, exc, match, device):
    """At the API boundary, not inside the length checks (``object of type 'int' has no len()``, or torch's
    error on reading a meta tensor)."""
    with pytest.raises(exc, match=match):
        mbs_attention(*qkv(device), CYCLIC, seg_lens)


def test_one_int_for_one_segment_says_to_give_a_list(device):
    q = torch.randn(1, 1, 48, 16, device=device)
    with pytest.raises(TypeError, match=r"got int 48 \(one segment of 48 tokens is \[48\]\)"):
        mbs_attention(q, q, q, [[1]], 48)


def test_every_entry_refuses_what_is_not_lengths(device):
    """The functional API, varlen, the modules (at construction and per call), the pictures and the Hugging Face
    route share the check."""
    from types import SimpleNamespace

    from mmsparse import tile_map
    from mmsparse.integrations.hf.topology_route import _segments

    q, k, v = qkv(device)
    with pytest.raises(TypeError, match=FORMS + r".*got int 20"):
        mbs_attention_varlen(q, k, v, CYCLIC, 20)
    with pytest.raises(TypeError, match=FORMS + r".*got int 20"):
        TritonMBSAttnKernel(CYCLIC, 20)
    with pytest.raises(TypeError, match=FORMS + r".*got str"):
        TritonMBSAttnKernel(CYCLIC, (5, 5, 10))(q, k, v, seg_lens="5, 5, 10")
    with pytest.raises(TypeError, match=FORMS + r".*got int 20"):
        MultimodalSelfAttention(32, 2, CYCLIC, 20)
    layer = MultimodalSelfAttention(32, 2, CYCLIC, (5, 5, 10), device=device)
    with pytest.raises(ValueError, match="on the meta device"):
        layer(torch.randn(1, 20, 32, device=device), seg_lens=torch.tensor([5, 5, 10], device="meta"))
    with pytest.raises(TypeError, match=FORMS + r".*got int 20"):
        MultiheadMBSAttention(torch.nn.MultiheadAttention(32, 2, batch_first=True), CYCLIC, 20)
    with pytest.raises(TypeError, match=FORMS + r".*got int 20"):
        tile_map(CYCLIC, 20, 16)
    with pytest.raises(TypeError, match=r"mm_seg_lens must be k segment lengths.*got int 20"):
        _segments(SimpleNamespace(), {"mm_topology": CYCLIC, "mm_seg_lens": 20}, 20)


def test_lengths_from_an_iterator_or_array_are_read_once(device):
    """A generator or other iterator is read once, into a tuple; numpy arrays and rows of tensors or arrays are
    read as lists: each gives what the tuple gives."""
    q, k, v = qkv(device, b=2)
    rows = [(5, 5, 10), (4, 6, 8)]
    with torch.no_grad():
        expected = mbs_attention(q, k, v, CYCLIC, rows)
        for given in ((r for r in rows), iter(rows), np.array(rows), [torch.tensor(r) for r in rows],
                      [np.array(r) for r in rows]):
            torch.testing.assert_close(mbs_attention(q, k, v, CYCLIC, given), expected, rtol=0, atol=0)
        shared = mbs_attention(q, k, v, CYCLIC, (5, 5, 10))
        for given in ((n for n in (5, 5, 10)), map(int, "5 5 10".split()), np.array([5, 5, 10])):
            torch.testing.assert_close(mbs_attention(q, k, v, CYCLIC, given), shared, rtol=0, atol=0)
        packed = mbs_attention_varlen(*qkv(device, sq=38, sk=38), CYCLIC, iter(rows))
    assert packed.shape == (1, 2, 38, 16)


@pytest.mark.parametrize("lengths, error, match", [
    ((5, -1, 16), ValueError, ">= 0"),
    ((5.0, 5, 10), TypeError, "integers"),
    ((5, 15), ValueError, "3 lengths or \\[B, 3\\] rows"),
    ([[[5, 5, 10]]], ValueError, "3 lengths or \\[B, 3\\] rows"),
    ((5, 5, 11), ValueError, "more than the 20 key positions"),
    ([(5, 5, 10), (5, 5, 11)], ValueError, "more than the 20 key positions"),
])
def test_the_reference_mask_refuses_bad_lengths(lengths, error, match):
    """The float64 reference checks its lengths itself (it takes nothing from the kernels' path): a bad one is an
    error, not a mask of something else."""
    from mmsparse import reference_mask

    with pytest.raises(error, match=match):
        reference_mask(CYCLIC, lengths, 20)


def test_the_packed_reference_mask_takes_rows_of_lengths():
    from mmsparse import reference_packed_mask

    with pytest.raises(ValueError, match="a row of lengths per sample"):
        reference_packed_mask(CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match=">= 0"):
        reference_packed_mask(CYCLIC, [(5, 5, 10), (5, -5, 10)])
    with pytest.raises(TypeError, match="seg_lens must hold integers"):  # not truncated, nor a size error
        reference_packed_mask(CYCLIC, [(5, 5, 10), (5, 5.5, 10)])
    with pytest.raises(ValueError, match="3 lengths or \\[B, 3\\] rows"):
        reference_packed_mask(CYCLIC, [(5, 5), (5, 5)])
