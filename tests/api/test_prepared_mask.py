"""A mask prepared once (``mmsparse.prepare_mask``) and passed as ``seg_lens`` to many calls: every layer of a step
over the same device lengths. Each call matches the float64 reference, output and all three gradients; the mask's
lists are built at the first call only; layers take it as they take lengths; a call it was not prepared for is
refused with a ValueError that says what differs; a compiled call refuses it with the way out."""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import mmsparse
from mmsparse import (
    PreparedMask,
    TritonMBSAttnKernel,
    mbs_attention,
    mbs_attention_varlen,
    prepare_mask,
    reference_mask,
    reference_packed_mask,
)
from mmsparse.nn import MultimodalSelfAttention
from mmsparse.runtime.launch import interpreter_active
from tests.helpers import CYCLIC, HUB, assert_replay_matches_eager, check_outputs, make_qkv

LENS = [(10, 30, 20), (4, 40, 6)]  # per sample; the second row ends in 10 positions of padding
S = 60


def test_one_mask_serves_every_layer_and_each_call_matches_the_reference(device):
    lens = torch.tensor(LENS, device=device)
    mask = prepare_mask(HUB, lens, S, causal=True, check_lengths=False)
    assert isinstance(mask, PreparedMask) and (mask.seq_len, mask.q_len, mask.device.type) == (S, S, device.type)
    reference = reference_mask(HUB, LENS, S, causal=True)
    gen = torch.Generator().manual_seed(3)
    for layer in range(3):  # three layers of one step, each with its own q, k, v
        q, k, v = make_qkv(2, 4, 2, S, S, 32, torch.bfloat16, device, torch.Generator().manual_seed(layer))
        out = mbs_attention(q, k, v, HUB, mask, causal=True)
        grad_out = torch.randn(out.shape, generator=gen).to(device, out.dtype)
        out.backward(grad_out)
        check_outputs(q, k, v, out, grad_out, reference)


def test_decoding_queries_and_a_window(device):
    """The last q_len queries, with a sliding window: as the same call given the lengths."""
    q, k, v = make_qkv(2, 2, 1, 16, S, 16, torch.float32, device)
    mask = prepare_mask(CYCLIC, torch.tensor(LENS, device=device), S, q_len=16, window=24)
    out = mbs_attention(q, k, v, CYCLIC, mask, window=24)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, LENS, S, 16, window=24))


def test_queries_placed_by_q_start(device):
    """Decoding over caches of different lengths: the queries' positions are the mask's, the call passes none."""
    q_start = [40, 20]
    q, k, v = make_qkv(2, 2, 1, 4, S, 16, torch.float32, device)
    mask = prepare_mask(HUB, LENS, S, q_len=4, q_start=q_start, causal=True, device=device)
    out = mbs_attention(q, k, v, HUB, mask, causal=True)
    assert torch.equal(out, mbs_attention(q, k, v, HUB, LENS, causal=True, q_start=q_start))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, LENS, S, 4, causal=True, q_start=q_start))


def test_packed_samples_for_varlen(device):
    lens = [(3, 20, 9), (0, 17, 4), (6, 1, 0)]
    total = sum(map(sum, lens))
    mask = prepare_mask(HUB, torch.tensor(lens, device=device), total, causal=True, packed=True)
    q, k, v = make_qkv(1, 2, 1, total, total, 32, torch.float16, device)
    out = mbs_attention_varlen(q, k, v, HUB, mask, causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(HUB, lens, causal=True))


def test_layers_take_it_as_they_take_lengths(device):
    """A layer given the prepared mask computes what it computes given the lengths, bit for bit."""
    torch.manual_seed(0)
    layer = MultimodalSelfAttention(64, 4, HUB, (10, 30, 20), causal=True).to(device)
    kernel = TritonMBSAttnKernel(HUB, (10, 30, 20), causal_mask=True)
    lens = torch.tensor(LENS, device=device)
    mask = prepare_mask(HUB, lens, S, causal=True)
    x = torch.randn(2, S, 64, device=device)
    q, k, v = make_qkv(2, 4, 4, S, S, 16, torch.float32, device)
    for run in (lambda s: layer(x, seg_lens=s), lambda s: kernel(q, k, v, seg_lens=s)):
        got, want = run(mask), run(lens)
        assert torch.equal(got, want)


@pytest.mark.skipif(not interpreter_active(), reason="counts the interpreter's launches (CPU)")
def test_its_lists_are_built_at_the_first_call_only(launches):
    q, k, v = make_qkv(2, 2, 2, S, S, 16, torch.float32, torch.device("cpu"))
    mask = prepare_mask(CYCLIC, torch.tensor(LENS), S)
    built = []
    for _ in range(3):
        launches.clear()
        out = mbs_attention(q, k, v, CYCLIC, mask)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        built.append({name: n for name, n in launches.items() if "attention" not in name})
    assert built[0], "the first call builds the block lists"
    assert built[1:] == [{}, {}]
    launches.clear()
    mbs_attention(q, k, v, CYCLIC, torch.tensor(LENS))  # the lengths themselves: built again
    assert any("attention" not in name for name in launches)


def test_a_call_it_was_not_prepared_for_is_refused(device):
    q, k, v = make_qkv(2, 2, 2, S, S, 16, torch.float32, device)
    lens = torch.tensor(LENS, device=device)
    mask = prepare_mask(HUB, lens, S, causal=True)
    cases = [
        (lambda: mbs_attention(q, k, v, CYCLIC, mask, causal=True), "prepared for Topology"),
        (lambda: mbs_attention(q, k, v, HUB, mask), "causal=True; this call asks causal=False"),
        (lambda: mbs_attention(q, k, v, HUB, mask, causal=True, window=8), "window=None; this call asks window=8"),
        (lambda: mbs_attention(q[:, :, :40], k[:, :, :50], v[:, :, :50], HUB, mask, causal=True),
         "60 queries over 60 keys; this call has 40 over 50"),
        (lambda: mbs_attention(q, k, v, HUB, mask, causal=True, q_start=[0, 0]), "pass q_start to"),
        (lambda: mbs_attention_varlen(q[:1], k[:1], v[:1], HUB, mask, causal=True), "goes to mbs_attention or"),
        (lambda: mbs_attention(q[:1].expand(3, -1, -1, -1), k[:1].expand(3, -1, -1, -1),
                               v[:1].expand(3, -1, -1, -1), HUB, mask, causal=True), "2 rows"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    packed = prepare_mask(HUB, [(10, 30, 20)], S, packed=True)
    with pytest.raises(ValueError, match="goes to mbs_attention_varlen"):
        mbs_attention(q, k, v, HUB, packed)
    with pytest.raises(TypeError, match="prepared mask already"):
        prepare_mask(HUB, mask, S)
    for bad, error in ((60.0, TypeError), (True, TypeError), (0, ValueError)):
        with pytest.raises(error, match="seq_len"):
            prepare_mask(HUB, LENS, bad)
    with pytest.raises(ValueError, match="q_len"):
        prepare_mask(HUB, LENS, S, q_len=61)
    for bad, message in (("tpu", "a name such as 'cuda'"), (3.5, "a name such as 'cuda'"),
                         ("meta", "unsupported device meta")):
        with pytest.raises(ValueError, match=message):
            prepare_mask(HUB, LENS, S, device=bad)
    for copy_of in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="prepare one where it is used"):
            copy_of(mask)


def test_a_compiled_call_refuses_it_and_says_to_pass_the_lengths(device):
    q, k, v = make_qkv(2, 2, 2, S, S, 16, torch.float32, device)
    mask = prepare_mask(CYCLIC, torch.tensor(LENS, device=device), S)
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, CYCLIC, mask), fullgraph=True)
    with pytest.raises(Exception, match="a prepared mask is for eager calls: under torch.compile pass the lengths"):
        compiled(q, k, v)
    torch._dynamo.reset()


def test_it_is_public():
    assert mmsparse.prepare_mask is prepare_mask and "PreparedMask" in mmsparse.__all__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_another_stream_reads_its_own_copy():
    """Prepared on the default stream (its builders still queued there), read on another: that stream waits for
    them, as for a cached mask."""
    device = torch.device("cuda")
    lens = torch.tensor(LENS, device=device)
    mask = prepare_mask(HUB, lens, S, causal=True, check_lengths=False)
    q, k, v = make_qkv(2, 4, 2, S, S, 64, torch.bfloat16, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = mbs_attention(q, k, v, HUB, mask, causal=True)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, LENS, S, causal=True))


def test_threads_share_one_mask(device):
    """Four threads, each a layer with its own q, k, v, give one freshly prepared mask at once (its lists built by
    whichever comes first): each gets, bit for bit, what it gets alone with the lengths."""
    lens = torch.tensor(LENS, device=device)
    inputs = [make_qkv(2, 2, 1, S, S, 16, torch.float32, device, torch.Generator().manual_seed(i)) for i in range(4)]

    def run(qkv, seg_lens):
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        out = mbs_attention(q, k, v, HUB, seg_lens, causal=True)
        out.backward(torch.ones_like(out))
        return [out.detach(), q.grad, k.grad, v.grad]

    expected = [run(qkv, lens) for qkv in inputs]
    mask = prepare_mask(HUB, lens, S, causal=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda qkv: run(qkv, mask), inputs))
    for mine, alone in zip(got, expected):
        for name, a, b in zip(("out", "dq", "dk", "dv"), mine, alone):
            assert torch.equal(a, b), f"{name} differs from the lengths' call"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_captured_step_replays_over_a_prepared_mask():
    """A capture of forward + backward over a prepared mask (prepared and used once before, on the default stream)
    replays bit-equal to an eager step over the same mask at the new inputs."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    mask = prepare_mask(HUB, torch.tensor(LENS, device=device), S, causal=True, check_lengths=False)
    q, k, v = make_qkv(2, 4, 2, S, S, 64, torch.bfloat16, device, gen)
    grad_out = torch.randn(q.shape, generator=gen).to(device, torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = mbs_attention(q, k, v, HUB, mask, causal=True)
        out.backward(grad_out)
        return out

    step()  # compiles the kernels and builds the lists
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert_replay_matches_eager(graph, captured, (q, k, v), step)
