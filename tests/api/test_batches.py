"""Real multimodal batches: per-sample lengths, packed samples, decode steps, torch.compile and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from mmsparse import TritonMBSAttnKernel, mbs_attention, mbs_attention_varlen, reference_mask
from mmsparse.attention.config import kernel_config
from mmsparse.attention.plan import num_splits
from mmsparse.mask.cache import CACHE
from tests.helpers import CYCLIC, HUB, check_outputs, make_qkv, run_example


def test_per_sample_lengths_forms_agree_and_match_reference(device):
    """Lengths as a list of tuples, a CPU tensor or a device tensor give identical results; each matches the
    reference, including an all-padding sample and a sample without audio."""
    lens = [(5, 30, 12), (0, 0, 0), (7, 40, 0)]
    gen = torch.Generator().manual_seed(5)
    outs = []
    for form in (lens, torch.tensor(lens), torch.tensor(lens, device=device)):
        q, k, v = make_qkv(3, 2, 1, 47, 47, 32, torch.bfloat16, device, torch.Generator().manual_seed(5))
        out = mbs_attention(q, k, v, HUB, form, causal=True)
        grad_out = torch.randn(out.shape, generator=gen).to(device, out.dtype)
        out.backward(grad_out)
        outs.append(out)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 47, causal=True))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.all(out[1] == 0) and torch.all(q.grad[1] == 0) and torch.all(k.grad[1] == 0)


def test_module_per_call_lengths(device):
    attn = TritonMBSAttnKernel(CYCLIC, (10, 30, 20))
    q, k, v = make_qkv(2, 2, 2, 60, 60, 16, torch.float32, device)
    lens = [(10, 30, 20), (4, 50, 6)]
    out = attn(q, k, v, seg_lens=lens)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, 60))
    with pytest.raises(ValueError, match="rows"):
        attn(q, k, v, seg_lens=[(10, 30, 20)] * 3)


def test_packed_varlen_samples_never_mix(device):
    lens = [(3, 20, 9), (0, 17, 4), (6, 1, 0), (2, 2, 2)]
    total = sum(map(sum, lens))
    mask = torch.zeros(1, total, total, dtype=torch.bool)
    start = 0
    for row in lens:
        n = sum(row)
        mask[0, start:start + n, start:start + n] = reference_mask(HUB, row, n, causal=True)[0]
        start += n
    q, k, v = make_qkv(1, 4, 1, total, total, 40, torch.float16, device)
    out = mbs_attention_varlen(q, k, v, HUB, lens, causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)


def test_decode_steps_with_a_growing_cache(device):
    """One new text token per step over a cache that grows; each step matches the reference."""
    q_all, k_all, v_all = make_qkv(2, 2, 1, 72, 72, 64, torch.bfloat16, device)
    for text_len in (10, 11, 12):
        lens = (40, 20, text_len)  # vision, audio, then the text written so far
        s = sum(lens)
        topo = [[1, 0, 0], [0, 1, 0], [1, 1, 1]]  # text sees everything, media see themselves
        for q_len in (1, 4):
            q = q_all[:, :, s - q_len:s].detach().requires_grad_()
            k, v = (t[:, :, :s].detach().requires_grad_() for t in (k_all, v_all))
            out = mbs_attention(q, k, v, topo, lens, causal=True)
            grad_out = torch.randn_like(out)
            out.backward(grad_out)
            check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, s, q_len, causal=True))


class _Block(torch.nn.Module):
    """A pre-norm attention block whose attention is mmsparse."""

    def __init__(self, dim: int, heads: int, lens: tuple[int, ...]) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.attn = TritonMBSAttnKernel(HUB, lens, causal_mask=True)

    def forward(self, x: torch.Tensor, seg_lens: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attn(q, k, v, seg_lens=seg_lens, check_lengths=False)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, d))


def test_torch_compile_fullgraph_matches_eager_without_recompiles(device):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Block(32, 2, (8, 24, 16)).to(device)
    compiled = torch.compile(block, fullgraph=True)
    counters.clear()
    with CACHE.limits(max_entries=2):
        _compiled_steps(block, compiled, counters, device)


def _compiled_steps(block, compiled, counters, device):
    for step, lens in enumerate([[(8, 24, 16), (4, 30, 10)], [(2, 40, 6), (8, 0, 16)], [(0, 48, 0), (8, 24, 16)]]):
        x = torch.randn(2, 48, 32, device=device, requires_grad=True)
        lens_t = torch.tensor(lens, device=device)
        # eager calls with host lengths fill the one cache and evict from it: the graph must not guard on it
        mbs_attention(x.detach().view(2, 1, 48, 32), x.detach().view(2, 1, 48, 32), x.detach().view(2, 1, 48, 32),
                      [[1, 1, 0], [0, 1, 1], [1, 0, 1]], lens[0])
        y_eager = block(x, lens_t)
        g_eager = torch.autograd.grad(y_eager.square().sum(), [x, *block.parameters()])
        y = compiled(x, lens_t)
        g = torch.autograd.grad(y.square().sum(), [x, *block.parameters()])
        torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
        for a, b in zip(g, g_eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "new lengths recompiled the model"


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    dev = torch.device("cuda")
    lens = (100, 700, 300)
    q, k, v = make_qkv(2, 8, 2, 1100, 1100, 64, torch.bfloat16, dev)
    grad_out = torch.randn(2, 8, 1100, 64, device=dev, dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = mbs_attention(q, k, v, HUB, lens, causal=True)
        out.backward(grad_out)
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compiles kernels and builds the cached block lists outside the capture
            eager = step().clone()
    torch.cuda.current_stream().wait_stream(stream)
    eager_grads = [t.grad.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.add_(0.5)  # new values in the captured buffers
    graph.replay()
    fresh = step()
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)
    assert not torch.equal(out, eager)
    for t, before in zip((q, k, v), eager_grads):
        assert t.grad is not None and not torch.equal(t.grad, before)


@pytest.mark.parametrize("q_len", [1, 5])
def test_decode_over_caches_of_different_lengths(q_len, device):
    """Per-sample caches: sample b's queries sit at its own last positions (q_start = length - q_len)."""
    lens = [(20, 33, 9), (20, 10, 2), (0, 40, 30)]
    totals = [sum(r) for r in lens]
    q_start = [t - q_len for t in totals]
    topo = [[1, 0, 0], [0, 1, 1], [1, 1, 1]]
    q, k, v = make_qkv(3, 4, 2, q_len, 72, 32, torch.float16, device)
    out = mbs_attention(q, k, v, topo, lens, causal=True, q_start=q_start)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, 72, q_len, causal=True, q_start=q_start))
    with pytest.raises(ValueError, match="q_start"):
        mbs_attention(q, k, v, topo, lens, causal=True, q_start=[72, 0, 0])


@pytest.mark.parametrize("q_len", [1, 3, 16, 40])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_key_lists_match_reference(q_len, causal, device):
    """A grid too small to fill the device splits each key list over several programs and merges the partials
    (flash-decoding); some splits get no live block at all. Output and gradients match the reference."""
    lens = (70, 9, 71)  # vision, audio, text; the text tail is the queries
    topo = [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    q, k, v = make_qkv(1, 2, 1, q_len, 150, 32, torch.bfloat16, device)
    tile = kernel_config(32, q.dtype, q.device).forward_tile(q_len, 150)
    assert num_splits(2 * -(-q_len // tile.block_m), -(-150 // tile.block_n), q.device) > 1 or device.type == "cuda"
    out = mbs_attention(q, k, v, topo, lens, causal=causal)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, 150, q_len, causal=causal))


def test_varying_lengths_training_example_runs(tmp_path):
    """examples/train_varying_lengths.py: new lengths every step under torch.compile(fullgraph=True), no
    recompiles after warm-up, output and weight gradients equal to the float64 reference."""
    import json

    code = run_example("train_varying_lengths", ["--tiny", "--steps", "4", "--out", str(tmp_path)])
    result = json.loads(next(tmp_path.glob("train_varying_lengths_*.json")).read_text())
    assert code == 0 and result["ok"], result
    assert result["recompiles_after_warmup"] == 0 and result["max_abs_err_vs_reference"] < result["tolerance"]


@pytest.mark.parametrize("q_len", [1, 5, 61])
def test_split_key_lists_edge_cases(q_len, device):
    """Split key lists with rows that see nothing (every split empty), a zero-length segment, GQA and a head dim
    that is not a power of two, against the reference."""
    lens = (0, 30, 22, 9)
    topo = [[1, 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]]  # the last segment's rows attend nothing
    q, k, v = make_qkv(1, 2, 1, q_len, 61, 40, torch.float16, device)
    tile = kernel_config(40, q.dtype, q.device).forward_tile(q_len, 61)
    assert num_splits(2 * -(-q_len // tile.block_m), -(-61 // tile.block_n), q.device) > 1 or device.type == "cuda"
    out = mbs_attention(q, k, v, topo, lens)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(topo, lens, 61, q_len))
