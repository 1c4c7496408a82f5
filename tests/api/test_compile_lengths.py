"""torch.compile(fullgraph=True) with lengths that change on every call, in every form a user passes them: tuples
of ints to mbs_attention, to TritonMBSAttnKernel and to MultimodalSelfAttention, per-sample lists of tuples, packed
rows to mbs_attention_varlen, a 1-D length tensor. Each call's output and gradients match the float64 reference,
and four calls compile at most two graphs: the first with the lengths as constants, then, once Dynamo has seen
them change, one in which they are symbols (and the sequence length too, where it changes).

Dynamo marks an int argument dynamic only when it differs from the earlier call's, so the second call of every
sequence below changes every length (and the shape, where the total changes); a length that stayed the same would
be a constant of the second graph and cost a third when it changes later."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from mmsparse import CAUSAL, FULL, NONE, TritonMBSAttnKernel, mbs_attention, mbs_attention_varlen, reference_mask
from mmsparse.nn import MultimodalSelfAttention
from tests.helpers import RING, assert_calibrated, check_outputs, layer_reference, make_qkv

TYPES = [[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]]  # pair types: segment codes
MAX_GRAPHS = 2  # constants, then symbols

# Every entry changes between the first two calls; zero-length segments come after the lengths are symbols.
SAME_TOTAL = [(10, 20, 18), (12, 16, 20), (5, 30, 13), (0, 40, 8)]  # S = 48 every call
NEW_TOTAL = [(10, 20, 18), (13, 17, 21), (4, 30, 0), (25, 20, 15)]  # S = 48, 51, 34, 60
PER_SAMPLE = [  # (rows, S): rows summing to at most S, the rest padding
    ([(10, 20, 18), (5, 9, 30)], 48),
    ([(12, 16, 20), (6, 0, 22)], 50),
    ([(1, 30, 3), (0, 0, 0)], 40),
    ([(7, 11, 13), (20, 14, 7)], 41),
]
PACKED = [[(5, 10, 3), (8, 2, 6)], [(6, 11, 4), (9, 3, 7)], [(0, 12, 9), (3, 0, 1)], [(14, 4, 2), (7, 7, 7)]]


def _counter(backend: str = "eager") -> CompileCounterWithBackend:
    """A backend that counts the graphs Dynamo compiles, after forgetting other tests' graphs and arguments."""
    torch._dynamo.reset()
    return CompileCounterWithBackend(backend)


def _qkv(batch: int, seq: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return make_qkv(batch, 2, 1, seq, seq, 16, torch.float32, device, gen)


def _check_call(compiled, q, k, v, mask: torch.Tensor, gen: torch.Generator, *lens_args) -> None:
    """One compiled call, forward and backward, against the float64 reference with ``mask``."""
    out = compiled(q, k, v, *lens_args)
    grad_out = torch.randn(out.shape, generator=gen).to(out.device)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)


CASES = [  # (topology, causal, lengths, backend)
    ("bits", False, "same-total", "eager"),
    ("types", True, "new-total", "eager"),
    ("bits", True, "new-total", "aot_eager"),  # through the custom ops, gradients by AOTAutograd
]


@pytest.mark.parametrize("kind, causal, totals, backend", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_mbs_attention_with_new_tuple_lengths_every_call(kind, causal, totals, backend, device):
    counter = _counter(backend)
    topology = RING if kind == "bits" else TYPES
    compiled = torch.compile(lambda q, k, v, lens: mbs_attention(q, k, v, topology, lens, causal=causal),
                             fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for lens in SAME_TOTAL if totals == "same-total" else NEW_TOTAL:
        q, k, v = _qkv(1, sum(lens), device, gen)
        _check_call(compiled, q, k, v, reference_mask(topology, lens, sum(lens), causal=causal), gen, lens)
    assert counter.frame_count <= MAX_GRAPHS


def test_dynamic_compile_takes_every_length_in_one_graph(device):
    """``dynamic=True`` makes the lengths symbols from the first call: one graph for all of them."""
    counter = _counter()
    compiled = torch.compile(lambda q, k, v, lens: mbs_attention(q, k, v, TYPES, lens), fullgraph=True,
                             backend=counter, dynamic=True)
    gen = torch.Generator().manual_seed(1)
    for lens in NEW_TOTAL[:3]:
        q, k, v = _qkv(1, sum(lens), device, gen)
        _check_call(compiled, q, k, v, reference_mask(TYPES, lens, sum(lens)), gen, lens)
    assert counter.frame_count == 1


def test_per_sample_lists_of_tuples_every_call(device):
    counter = _counter()
    compiled = torch.compile(lambda q, k, v, rows: mbs_attention(q, k, v, TYPES, rows, causal=True),
                             fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(2)
    for rows, seq in PER_SAMPLE:
        q, k, v = _qkv(2, seq, device, gen)
        _check_call(compiled, q, k, v, reference_mask(TYPES, rows, seq, causal=True), gen, rows)
    assert counter.frame_count <= MAX_GRAPHS


def test_packed_rows_every_call(device):
    """mbs_attention_varlen: two samples end to end, new lengths (and a new total) every call."""
    counter = _counter()
    compiled = torch.compile(lambda q, k, v, rows: mbs_attention_varlen(q, k, v, RING, rows, causal=True),
                             fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(3)
    for rows in PACKED:
        total = sum(map(sum, rows))
        mask, start = torch.zeros(1, total, total, dtype=torch.bool), 0
        for row in rows:  # block-diagonal: each sample sees itself only
            n = sum(row)
            mask[0, start:start + n, start:start + n] = reference_mask(RING, row, n, causal=True)[0]
            start += n
        q, k, v = _qkv(1, total, device, gen)
        _check_call(compiled, q, k, v, mask, gen, rows)
    assert counter.frame_count <= MAX_GRAPHS


def test_one_dimensional_length_tensor_every_call(device):
    """A ``[k]`` tensor of lengths is a row shared by the batch, as a tuple is; its values are not read while
    traced (as a ``[B, k]`` tensor's are not)."""
    counter = _counter()
    compiled = torch.compile(lambda q, k, v, lens: mbs_attention(q, k, v, TYPES, lens), fullgraph=True,
                             backend=counter)
    gen = torch.Generator().manual_seed(4)
    for lens in NEW_TOTAL[:3]:
        q, k, v = _qkv(1, sum(lens), device, gen)
        _check_call(compiled, q, k, v, reference_mask(TYPES, lens, sum(lens)), gen, torch.tensor(lens, device=device))
    assert counter.frame_count <= MAX_GRAPHS


def test_kernel_module_with_new_lengths_every_call(device):
    """TritonMBSAttnKernel's ``forward(q, k, v, seg_lens=...)`` with a tuple that changes every call."""
    counter = _counter()
    module = TritonMBSAttnKernel(TYPES, NEW_TOTAL[0], causal_mask=True)
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(5)
    for lens in NEW_TOTAL:
        q, k, v = _qkv(1, sum(lens), device, gen)
        mask = reference_mask(TYPES, lens, sum(lens), causal=True)
        out = compiled(q, k, v, seg_lens=lens)
        grad_out = torch.randn(out.shape, generator=gen).to(device)
        out.backward(grad_out)
        check_outputs(q, k, v, out, grad_out, mask)
    assert counter.frame_count <= MAX_GRAPHS


@pytest.mark.parametrize("form", ["shared", "per-sample"])
def test_layer_with_new_lengths_every_call(form, device):
    """MultimodalSelfAttention's ``forward(x, seg_lens=...)``: a tuple, or per-sample rows, new every call; the
    output and the gradients of x and of every weight against the layer's float64 math, calibrated by the same
    math in plain float32 torch (the key bias's gradient is zero in exact arithmetic: its size is float32's
    rounding, which a bound relative to the reference alone cannot judge)."""
    counter = _counter()
    torch.manual_seed(0)
    layer = MultimodalSelfAttention(32, 2, RING, NEW_TOTAL[0], num_kv_heads=1, causal=True).to(device)
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    calls = [(lens, sum(lens)) for lens in NEW_TOTAL] if form == "shared" else PER_SAMPLE
    gen = torch.Generator().manual_seed(6)
    for lens, seq in calls:
        layer.zero_grad(set_to_none=True)
        x = torch.randn(2, seq, 32, generator=gen).to(device).requires_grad_()
        out = compiled(x, seg_lens=lens)
        grad = torch.randn(out.shape, generator=gen).to(device)
        out.backward(grad)
        mask = reference_mask(RING, lens, seq, causal=True)
        ref, xd, p = layer_reference(layer, x, mask)
        ref.backward(grad.double())
        plain, xf, pf = layer_reference(layer, x, mask, torch.float32)
        plain.backward(grad)
        assert_calibrated("out", out, ref, plain, torch.float32)
        assert_calibrated("dx", x.grad, xd.grad, xf.grad, torch.float32)
        for name, param in layer.named_parameters():
            assert_calibrated(f"d{name}", param.grad, p[name].grad, pf[name].grad, torch.float32)
    assert counter.frame_count <= MAX_GRAPHS


def test_bad_symbolic_lengths_fail_with_the_reason(device):
    """Once the lengths are symbols, a negative length, or lengths that do not cover k/v, still fail, naming the
    problem (under fullgraph Dynamo reports the ValueError it traced)."""
    counter = _counter()
    compiled = torch.compile(lambda q, k, v, lens: mbs_attention(q, k, v, TYPES, lens), fullgraph=True,
                             backend=counter)
    gen = torch.Generator().manual_seed(7)
    for lens in NEW_TOTAL[:2]:
        q, k, v = (t.detach() for t in _qkv(1, sum(lens), device, gen))
        compiled(q, k, v, lens)
    q, k, v = (t.detach() for t in _qkv(1, 48, device, gen))
    with pytest.raises((ValueError, RuntimeError), match=r"seg_lens\[1\] is negative"):
        compiled(q, k, v, (30, -2, 20))
    with pytest.raises((ValueError, RuntimeError), match=r"sum\(seg_lens\) differs from the positions of k/v"):
        compiled(q, k, v, (30, 2, 20))
