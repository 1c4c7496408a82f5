"""Outputs and gradients in their inputs' layout, and dO read as autograd hands it over.

A layer's q, k and v are ``[B, H, S, D]`` views of ``[B, S, H, D]`` buffers (its projections), and it turns the
output back into ``[B, S, H * D]``. With out, dq, dk and dv laid out as their inputs (``layouts.output_like``) and dO
read at its strides, those transposes are views, as they are around SDPA; else each layer's step copies out, dO,
dq, dk and dv once more (five kernels a layer, eager and compiled alike)."""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.nn import MultimodalSelfAttention
from tests.helpers import CYCLIC, TorchOps, check_outputs, layer_reference

LENS = (5, 12, 20)


def _views(layout: str, batch: int, heads: int, kv_heads: int, seq_q: int, seq_k: int, dim: int,
           dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as leaves of one ``layout``: ``bshd`` (each a view of its own [B, S, H, D] buffer), ``fused`` (one
    [B, S, Hq + 2 Hkv, D] buffer: not dense), ``misaligned`` (bshd on a base 2 bytes off 16-byte alignment, which the
    kernels cannot read in place) or ``contiguous``."""
    def make(heads_: int, seq: int) -> torch.Tensor:
        if layout == "contiguous":
            return torch.randn(batch, heads_, seq, dim, device=device).to(dtype)
        if layout == "misaligned":
            flat = torch.randn(batch * seq * heads_ * dim + 1, device=device).to(dtype)[1:]
            return flat.view(batch, seq, heads_, dim).transpose(1, 2)
        return torch.randn(batch, seq, heads_, dim, device=device).to(dtype).transpose(1, 2)

    if layout == "fused":
        assert seq_q == seq_k
        buf = torch.randn(batch, seq_q, heads + 2 * kv_heads, dim, device=device).to(dtype).transpose(1, 2)
        q, k, v = buf[:, :heads], buf[:, heads:heads + kv_heads], buf[:, heads + kv_heads:]
    else:
        q, k, v = make(heads, seq_q), make(kv_heads, seq_k), make(kv_heads, seq_k)
    return tuple(t.detach().requires_grad_() for t in (q, k, v))


def _order(t: torch.Tensor) -> list[int]:
    """The dims of ``t`` from the largest stride to the smallest."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _dense(t: torch.Tensor) -> bool:
    """``t`` fills its memory with no gap: each stride is the product of the sizes of the dims inside it."""
    inner = 1
    for d in reversed(_order(t)):
        if t.stride(d) != inner:
            return False
        inner *= t.shape[d]
    return True


def _check(q, k, v, topology, lens, grad_out, seq_k, causal=False, **kw) -> None:
    """Output and gradients laid out as their inputs (dense, in the same memory order) and equal to the float64
    reference; the gradients as the op returns them (``autograd.grad``: a leaf's ``.grad`` would be copied into
    the leaf's own layout)."""
    out = mbs_attention(q, k, v, topology, lens, causal=causal, **kw)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for name, got, like in (("out", out, q), ("dq", grads[0], q), ("dk", grads[1], k), ("dv", grads[2], v)):
        assert got.stride(-1) == 1 and _order(got) == _order(like), (name, got.stride(), like.stride())
        assert _dense(got), (name, got.stride())
    check_outputs(q, k, v, out, grad_out, reference_mask(topology, lens, seq_k, q.shape[2], causal=causal),
                  grads=grads)


@pytest.mark.parametrize("deterministic", [True, False], ids=["two_passes", "one_pass"])
@pytest.mark.parametrize("layout", ["bshd", "fused", "misaligned", "contiguous"])
def test_outputs_and_gradients_follow_the_inputs_layout(layout, deterministic, device):
    """GQA 4 / 2 over the cyclic topology; dO handed over as a layer's output projection does ([B, S, H, D])."""
    seq = sum(LENS)
    q, k, v = _views(layout, 2, 4, 2, seq, seq, 16, torch.bfloat16, device)
    grad_out = torch.randn(2, seq, 4, 16, device=device).to(torch.bfloat16).transpose(1, 2)
    _check(q, k, v, CYCLIC, LENS, grad_out, seq, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [True, False], ids=["two_passes", "one_pass"])
@pytest.mark.parametrize("seq_q", [61, 40], ids=["self", "fewer_queries"])
def test_layer_layout_edges(seq_q, deterministic, device):
    """A layer's layout at a head dim that is no power of two (40, columns past it padded in the tiles: a store
    past it would land in the next head of a [B, S, H, D] row), a zero-length segment, a segment whose rows attend
    nothing, ragged ends, GQA 4 / 2, and fewer queries than keys (the last ones)."""
    lens = (0, 30, 22, 9)
    topo = [[1, 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    q = _views("bshd", 2, 4, 2, seq_q, seq_q, 40, torch.bfloat16, device)[0]
    _, k, v = _views("bshd", 2, 4, 2, 61, 61, 40, torch.bfloat16, device)
    grad_out = torch.randn(2, seq_q, 4, 40, device=device).to(torch.bfloat16).transpose(1, 2)
    _check(q, k, v, topo, lens, grad_out, 61, deterministic=deterministic)


def test_float32_one_pass_gradient_in_a_layer_layout(device):
    """float32's one pass may hand back its float32 dQ sum itself, which is contiguous: only where q is."""
    seq = sum(LENS)
    q, k, v = _views("bshd", 1, 2, 2, seq, seq, 16, torch.float32, device)
    grad_out = torch.randn(1, 2, seq, 16, device=device)
    _check(q, k, v, CYCLIC, LENS, grad_out, seq, deterministic=False)


@pytest.mark.parametrize("q_len", [3, 40], ids=["packed_gqa", "rows"])
def test_split_key_lists_write_the_output_in_q_layout(q_len, device):
    """Few queries over many keys: the forward splits each key list and merges the partials into out (the
    combine kernel); with 3 queries a GQA group's heads also share one tile (its rows are (head, query) pairs)."""
    from mmsparse.attention.config import kernel_config
    from mmsparse.attention.plan import num_splits

    lens, topo = (70, 9, 71), [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    q, k, v = _views("bshd", 1, 4, 2, q_len, 150, 32, torch.bfloat16, device)
    tile = kernel_config(32, q.dtype, q.device).forward_tile(q_len, 150)
    assert num_splits(2 * -(-q_len // tile.block_m), -(-150 // tile.block_n), q.device) > 1 or device.type == "cuda"
    grad_out = torch.randn(1, q_len, 4, 32, device=device).to(torch.bfloat16).transpose(1, 2)
    _check(q, k, v, topo, lens, grad_out, 150, causal=True)


def _layer(device: torch.device) -> MultimodalSelfAttention:
    torch.manual_seed(0)
    return MultimodalSelfAttention(32, 2, CYCLIC, LENS, device=device)


def test_a_layer_step_copies_no_attention_input_or_output(device):
    """An eager training step of the layer: no clone of out, dO, dq, dk or dv (there were five), and the output and
    input gradient still equal the float64 layer."""
    layer = _layer(device)
    x = torch.randn(2, sum(LENS), 32, device=device, requires_grad=True)
    layer(x).sum().backward()  # plans and builds once
    x.grad = None
    with TorchOps() as mode:
        out = layer(x)
        out.sum().backward()
    assert not [name for name in mode.ops if name.startswith("aten.clone")], mode.ops
    mask = reference_mask(CYCLIC, LENS, sum(LENS), sum(LENS))
    ref, xd, _ = layer_reference(layer, x, mask)
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)


def test_a_compiled_layer_graph_copies_nothing_around_the_ops(device):
    """Compiled, the ops' fake outputs are laid out as the real ones (Inductor checks each extern output's strides),
    so AOTAutograd's forward and backward graphs hold no clone around them; the step equals eager's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    layer = _layer(device)
    x = torch.randn(2, sum(LENS), 32, device=device, requires_grad=True)
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(layer, backend=backend)
    out = compiled(x)
    out.sum().backward()
    grad = x.grad
    assert backend.fw_graphs and backend.bw_graphs
    for gm in (*backend.fw_graphs, *backend.bw_graphs):
        clones = [n for n in gm.graph.nodes if n.op == "call_function" and "clone" in str(n.target)]
        assert not clones, clones
    x.grad = None
    eager = layer(x)
    eager.sum().backward()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)


@pytest.mark.hopper
@pytest.mark.parametrize("deterministic", [True, False], ids=["two_passes", "one_pass"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_kernels_follow_the_inputs_layout(head_dim, deterministic):
    """On sm_90, past ``short_keys``: the Gluon forward, the Gluon dQ and dK/dV passes (dQ on the side stream), the
    dQ-writer one pass at D 64 and 128 and the D=256 kernels write through descriptors of the layer's layout."""
    from mmsparse.attention.config import kernel_config
    from mmsparse.attention.plan import plan_attention

    cuda = torch.device("cuda")
    lens, seq = (300, 1000, 1000), 2300
    # 18 row blocks of 2 x 8 heads: enough programs that the forward does not split its key lists
    q, k, v = _views("bshd", 2, 8, 4, seq, seq, head_dim, torch.bfloat16, cuda)
    plan = plan_attention(kernel_config(head_dim, q.dtype, cuda), 2, 8, 4, seq, seq, cuda,
                          deterministic=deterministic)
    kernels = plan.kernels()
    assert kernels["forward"] == "gluon" and kernels["dkdv"].startswith("gluon"), kernels
    grad_out = torch.randn(2, seq, 8, head_dim, device=cuda).to(torch.bfloat16).transpose(1, 2)
    _check(q, k, v, CYCLIC, lens, grad_out, seq, deterministic=deterministic)


def test_flash_attn_packed_layout_comes_back_contiguous(device):
    """``mbs_attention_varlen`` over flash-attn's ``[total, H, D]`` returns ``[total, H, D]`` contiguous, as
    ``flash_attn_varlen_func`` does, and gradients of that layout; the values as for ``[1, H, total, D]``."""
    from mmsparse import mbs_attention_varlen

    lens = [[5, 12, 20], [3, 9, 11]]
    total = sum(map(sum, lens))
    q, k, v = (torch.randn(total, heads, 16, device=device).to(torch.bfloat16).requires_grad_()
               for heads in (4, 2, 2))
    grad_out = torch.randn(total, 4, 16, device=device).to(torch.bfloat16)
    out = mbs_attention_varlen(q, k, v, CYCLIC, lens)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert out.shape == (total, 4, 16) and out.is_contiguous()
    assert all(g.is_contiguous() for g in grads)
    views = [t.detach().permute(1, 0, 2).unsqueeze(0).requires_grad_() for t in (q, k, v)]
    out_bhsd = mbs_attention_varlen(*views, CYCLIC, lens)
    grads_bhsd = torch.autograd.grad(out_bhsd, views, grad_out.permute(1, 0, 2).unsqueeze(0))
    torch.testing.assert_close(out, out_bhsd[0].permute(1, 0, 2), rtol=0, atol=0)
    for got, want in zip(grads, grads_bhsd):
        torch.testing.assert_close(got, want[0].permute(1, 0, 2), rtol=0, atol=0)
