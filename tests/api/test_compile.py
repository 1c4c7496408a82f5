"""torch.compile(fullgraph=True) over mbs_attention with the topology in every form a user passes: nested lists,
tuples, nested tuples, a Topology and a tensor; no graph breaks, the eager result.

Dynamo raises on a graph break under fullgraph whatever the backend, so most cases use the "eager" backend (no
Inductor compile: fast on the CPU); one case runs the default backend end to end."""

from __future__ import annotations

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE, Topology, mbs_attention, mbs_attention_varlen

SEG = (10, 20, 18)
RING = [[1, 1, 0], [0, 1, 1], [1, 0, 1]]  # 0/1: token bits
TYPES = [[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]]  # pair types: segment codes


def _forms(matrix: list[list[int]]) -> dict[str, object]:
    return {
        "list": [list(r) for r in matrix],
        "tuple": tuple(list(r) for r in matrix),
        "nested-tuple": tuple(tuple(r) for r in matrix),
        "topology": Topology(matrix),
        "tensor": torch.tensor(matrix),
    }


# Nested lists and tensors with either kind of topology; tuples, nested tuples and a Topology with one kind each. A
# list, a tuple and a nested tuple share one cache key and one conversion to a Topology, after which the kind picks
# the mask (token bits or segment codes) whatever the form; a tensor's values are unknown while tracing, so it takes
# both. (test_fullgraph_packed_rows_from_lists traces a nested tuple of pair types too.)
CASES = [("list", "01"), ("list", "types"), ("tuple", "types"), ("nested-tuple", "01"), ("topology", "types"),
         ("tensor", "01"), ("tensor", "types")]


def _qkv(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, sum(SEG), 16, generator=gen).to(device).requires_grad_() for h in (2, 1, 1)]


def _fresh(matrix: list[list[int]], salt: int) -> list[list[int]]:
    """The same mask with one extra segment of length 0 per salt: a topology no earlier call has cached, so the
    traced call validates it itself."""
    k = len(matrix) + salt
    return [[matrix[r][c] if r < len(matrix) and c < len(matrix) else FULL for c in range(k)] for r in range(k)]


@pytest.mark.parametrize("form, kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_fullgraph_with_every_topology_form(form, kind, device):
    torch._dynamo.reset()
    salt = 1 + [c[0] for c in CASES].index(form)
    matrix = _fresh(RING if kind == "01" else TYPES, salt)
    seg = SEG + (0,) * salt
    topology = _forms(matrix)[form]
    q, k, v = _qkv(device)
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, topology, seg), fullgraph=True, backend="eager")
    out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = mbs_attention(q, k, v, matrix, seg)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fullgraph_packed_rows_from_lists(device):
    torch._dynamo.reset()
    rows = [(3, 10, 2), (5, 0, 7)]
    topology = tuple(tuple(r) for r in _fresh(TYPES, 9))
    rows = [r + (0,) * 9 for r in rows]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(27, h, 16, generator=gen).to(device) for h in (2, 1, 1))
    compiled = torch.compile(lambda q, k, v: mbs_attention_varlen(q, k, v, topology, rows), fullgraph=True,
                             backend="eager")
    torch.testing.assert_close(compiled(q, k, v), mbs_attention_varlen(q, k, v, topology, rows), rtol=1e-6,
                               atol=1e-6)


def test_fullgraph_default_backend(device):
    """Inductor end to end, a nested list of pair types given inside the compiled function."""
    torch._dynamo.reset()
    q, k, v = (t.detach() for t in _qkv(device))
    matrix = _fresh(TYPES, 11)
    seg = SEG + (0,) * 11
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, [list(r) for r in matrix], seg), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), mbs_attention(q, k, v, matrix, seg), rtol=1e-5, atol=1e-5)


def test_traced_tensor_topology_checks_its_values_when_run(device):
    """A tensor topology's values are unknown while tracing: a bad entry fails when the graph runs."""
    torch._dynamo.reset()
    q, k, v = (t.detach() for t in _qkv(device))
    bad = torch.tensor([[1, 3, 0], [0, 1, 1], [1, 0, 1]])
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, bad, SEG), fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="0 \\(none\\), 1 \\(full\\) or 2 \\(causal\\)"):
        compiled(q, k, v)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_carries_deterministic_to_the_backward(backend, device, monkeypatch):
    """deterministic=False reaches the backward launcher through the traced graph (under aot_eager, through the
    custom op): its plan has no dQ pass (the one pass); the compiled gradients are the eager one-pass gradients up to
    float32 accumulation order."""
    from mmsparse.attention import backward

    seen = []  # per backward launch: deterministic, as the launcher's plan says (a dQ pass: the two passes)
    real = backward.BackwardLaunch.__call__

    def recording(self, *args, **kwargs):
        seen.append(self.plan.dq is not None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(backward.BackwardLaunch, "__call__", recording)
    torch._dynamo.reset()
    matrix, seg = _fresh(TYPES, 12), SEG + (0,) * 12
    q, k, v = _qkv(device)
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, matrix, seg, deterministic=False),
                             fullgraph=True, backend=backend)
    compiled(q, k, v).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    assert seen == [False]
    for t in (q, k, v):
        t.grad = None
    mbs_attention(q, k, v, matrix, seg).sum().backward()  # the default: two passes
    assert seen == [False, True]
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_ops_signatures_match_their_version():
    """Inductor's cache of compiled graphs does not key on a custom op's schema: a changed signature under an old
    name would be called with a cached graph's old arguments (and a changed layout of its outputs would be read at
    the old strides). Changing the arguments below, or the layout of the outputs, means bumping
    mmsparse.attention.custom_ops.OP_VERSION, and these lists with it."""
    from mmsparse.attention.custom_ops import OP_VERSION

    assert OP_VERSION == 9
    names = {op: [a.name for a in getattr(torch.ops.mmsparse, f"{op}_v{OP_VERSION}").default._schema.arguments]
             for op in ("lists", "fwd", "bwd")}
    assert names == {
        "lists": ["mask", "plan", "block_m", "block_n", "by_key"],
        "fwd": ["q", "k", "v", "mask", "lists", "seed", "softmax_scale", "dropout_p", "plan", "host_values"],
        "bwd": ["grad_out", "q", "k", "v", "out", "lse", "mask", "lists", "seed", "softmax_scale", "dropout_p",
                "plan", "host_values"],
    }
