"""One plan per call under torch.compile, as in eager: a compiled step plans nothing (its plan was made when the graph
was traced and crosses the custom ops by value), prepares nothing, and builds each tile's block lists once, in one
``lists`` op that the forward and the backward ops both read. Counted rather than timed; every step's output and
gradients are checked against the float64 reference (outputs NaN-poisoned: tests/poison.py).

The eager twin is tests/kernels/test_launch_reuse.py::test_a_repeated_call_plans_and_builds_nothing."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from mmsparse import clear_caches, mbs_attention, reference_attention, reference_mask
from mmsparse.attention import call, custom_ops
from mmsparse.mask import info as info_module
from mmsparse.mask.info import MaskInfo
from mmsparse.mask.kept import clear_kept
from mmsparse.nn import MultimodalSelfAttention
from tests.helpers import HUB, check_outputs, make_qkv

LENS = (7, 20, 13)
# The interpreter's config (fwd 32x16, dQ 32x16, dK/dV 16x32 by key): the forward and dQ passes read one set of
# lists, dK/dV another (the one-pass backward reads dK/dV's only).
TILES = 2
BUILDERS = ("build_block_lists", "build_segment_lists", "lists_from_classes")


@pytest.fixture
def counts(monkeypatch):
    """Plans (eager, traced, and the ops' per-shape forward grids), mask list preparations, and list builds, as
    the steps run (the tracing of a graph is not counted: it happens once per graph)."""
    seen = {"plans": 0, "prepares": 0, "builds": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            if not torch.compiler.is_compiling():  # per step: what a traced counter adds would be replayed by it
                seen[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for module, attr in ((call, "plan_attention"), (custom_ops, "plan_call"), (call, "attention_plan_of")):
        original = getattr(module, attr, None)
        if original is not None:  # (the commit before this plan had no traced plan)
            monkeypatch.setattr(module, attr, counting("plans", original))
    monkeypatch.setattr(MaskInfo, "prepare", counting("prepares", MaskInfo.prepare))
    for name in BUILDERS:
        monkeypatch.setattr(info_module, name, counting("builds", getattr(info_module, name)))
    return seen


def _inputs(seq: int, device: torch.device, seed: int, batch: int = 1):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(batch, 2, 1, seq, seq, 16, torch.float32, device, gen)
    return q, k, v, torch.randn(q.shape, generator=gen).to(device)


def _step(compiled, q, k, v, grad_out, *args) -> torch.Tensor:
    for t in (q, k, v):
        t.grad = None
    out = compiled(q, k, v, *args)
    out.backward(grad_out)
    return out


@pytest.mark.parametrize("lengths", ["constant", "tensor"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "one-pass"])
def test_a_repeated_compiled_step_plans_nothing_and_builds_each_tile_once(device, counts, deterministic, lengths):
    """Lengths the graph holds as constants: the lists are built at the first step and kept, later steps build
    none. Lengths in a tensor: each step builds each tile's lists once, read by the forward and backward ops."""
    counter = CompileCounterWithBackend("aot_eager")  # through the custom ops, gradients by AOTAutograd
    torch._dynamo.reset()
    lens = LENS if lengths == "constant" else torch.tensor(LENS, device=device)
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, HUB, lens, deterministic=deterministic),
                             fullgraph=True, backend=counter)
    q, k, v, grad_out = _inputs(sum(LENS), device, 0)
    mask = reference_mask(HUB, LENS, sum(LENS))
    _step(compiled, q, k, v, grad_out)  # traced: planned once, the ops' launches made
    for _ in range(2):  # the first repeat and one after it: each later step takes the same path
        for key in counts:
            counts[key] = 0
        out = _step(compiled, q, k, v, grad_out)
        builds = 0 if lengths == "constant" else TILES
        assert counts == {"plans": 0, "prepares": 0, "builds": builds}, counts
        check_outputs(q, k, v, out, grad_out, mask)
    assert counter.frame_count == 1


def test_a_compiled_two_layer_step_shares_the_kept_lists(device, counts):
    """Two attention calls over the same constant lengths in one graph: the first step builds each tile's lists
    once for both, and later steps build none."""
    torch._dynamo.reset()
    clear_kept()  # built fresh: the first step builds them

    def two_layers(q, k, v):
        hidden = mbs_attention(q, k, v, HUB, LENS)
        return mbs_attention(hidden, k, v, HUB, LENS)

    compiled = torch.compile(two_layers, fullgraph=True, backend="aot_eager")
    q, k, v, grad_out = _inputs(sum(LENS), device, 1)
    _step(compiled, q, k, v, grad_out)
    assert counts["builds"] == TILES, counts
    for key in counts:
        counts[key] = 0
    out = _step(compiled, q, k, v, grad_out)
    assert counts == {"plans": 0, "prepares": 0, "builds": 0}, counts
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = reference_mask(HUB, LENS, sum(LENS))
    ref = reference_attention(reference_attention(qd, kd, vd, mask, dtype=torch.float64), kd, vd, mask,
                              dtype=torch.float64)
    ref.backward(grad_out.double())
    for name, got, want in (("out", out, ref), ("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad),
                            ("dv", v.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


CHANGING = {  # (lengths argument per step, sequence length per step, batch)
    "tuples": ([(10, 20, 18), (13, 17, 21), (4, 30, 0), (25, 20, 15)], None, 1),
    "tensor": ([torch.tensor(x) for x in [(10, 20, 18), (13, 17, 21), (4, 30, 0), (25, 20, 15)]], None, 1),
    "per-sample": ([[(10, 20, 18), (5, 9, 30)], [(12, 16, 20), (6, 0, 22)], [(1, 30, 3), (0, 0, 0)],
                    [(7, 11, 13), (20, 14, 7)]], [48, 50, 40, 41], 2),
}


@pytest.mark.parametrize("form", list(CHANGING))
def test_compiled_steps_with_new_lengths_plan_nothing(device, counts, form):
    """New lengths every step (after the first two, which compile the graphs: constants, then symbols): no step
    plans the call again or prepares a mask; each builds each tile's lists once."""
    lengths, seqs, batch = CHANGING[form]
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, lens: mbs_attention(q, k, v, HUB, lens, causal=True), fullgraph=True,
                             backend=counter)
    for step, lens in enumerate(lengths):
        seq = seqs[step] if seqs is not None else int(sum(lens))
        q, k, v, grad_out = _inputs(seq, device, 10 + step, batch)
        for key in counts:
            counts[key] = 0
        lens_arg = lens.to(device) if isinstance(lens, torch.Tensor) else lens
        out = _step(compiled, q, k, v, grad_out, lens_arg)
        rows = lens.tolist() if isinstance(lens, torch.Tensor) else lens
        check_outputs(q, k, v, out, grad_out, reference_mask(HUB, rows, seq, causal=True))
        if step >= 2:
            assert counts["prepares"] == 0 and counts["builds"] == TILES, counts
            # the only plan work left: the forward's grid at new shapes (kept per shapes by the op)
            assert counts["plans"] <= 1, counts
    assert counter.frame_count <= 2


def test_a_compiled_layer_step_builds_nothing_after_the_first(device, counts):
    """A layer keeps its topology as a Topology: its pair types key the kept lists as a list's do. Two layers of
    one graph share them; the step's output and input gradient match eager's, which reads the same kernels."""
    torch._dynamo.reset()
    clear_kept()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(MultimodalSelfAttention(32, 2, HUB, LENS, device=device) for _ in range(2)))
    x = torch.randn(1, sum(LENS), 32, device=device, requires_grad=True)
    compiled = torch.compile(layers, fullgraph=True, backend="aot_eager")
    grads = []
    for model in (layers, compiled, compiled):
        x.grad = None
        for key in counts:
            counts[key] = 0
        out = model(x)
        out.sum().backward()
        grads.append((out.detach(), x.grad.clone()))
    assert counts == {"plans": 0, "prepares": 0, "builds": 0}, counts
    for got in grads[1:]:
        torch.testing.assert_close(got, grads[0], rtol=1e-5, atol=1e-5)


RESOLVERS = ("kept_mask", "call_plan_from_text", "forward_launch_of", "backward_launch_of")


@pytest.fixture
def resolving(monkeypatch):
    """Calls, outside tracing, of what an op call resolves: the kept mask, the plan's text, and the launches'
    keys."""
    seen = dict.fromkeys(RESOLVERS, 0)

    def counting(name, original):
        def wrapper(*args, **kwargs):
            if not torch.compiler.is_compiling():
                seen[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in RESOLVERS:
        monkeypatch.setattr(custom_ops, name, counting(name, getattr(custom_ops, name)))
    return seen


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "one-pass"])
def test_a_repeated_compiled_step_resolves_each_op_call_by_one_lookup(device, resolving, deterministic):
    """From the second step, each op call finds its plan, kept mask and launch in one entry: nothing of them is
    looked up again. Each step is checked against the float64 reference."""
    torch._dynamo.reset()
    clear_caches()  # no entry from an earlier test of the same shapes: the first step resolves its calls
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, HUB, LENS, deterministic=deterministic),
                             fullgraph=True, backend="aot_eager")
    q, k, v, grad_out = _inputs(sum(LENS), device, 3)
    mask = reference_mask(HUB, LENS, sum(LENS))
    _step(compiled, q, k, v, grad_out)
    assert resolving["kept_mask"] > 0, resolving  # the first step resolved its calls
    for _ in range(2):
        for key in resolving:
            resolving[key] = 0
        out = _step(compiled, q, k, v, grad_out)
        assert resolving == dict.fromkeys(RESOLVERS, 0), resolving
        check_outputs(q, k, v, out, grad_out, mask)


def test_a_resolved_op_call_keeps_no_mask_alive(device, resolving):
    """An entry holds the kept mask weakly: once the kept masks let it go, the next step resolves its calls
    again (a new mask and lists, built once) and stays exact."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, HUB, LENS, causal=True), fullgraph=True,
                             backend="aot_eager")
    q, k, v, grad_out = _inputs(sum(LENS), device, 4)
    mask = reference_mask(HUB, LENS, sum(LENS), causal=True)
    _step(compiled, q, k, v, grad_out)
    clear_kept()
    gc.collect()
    for key in resolving:
        resolving[key] = 0
    out = _step(compiled, q, k, v, grad_out)
    assert resolving["kept_mask"] > 0, resolving
    check_outputs(q, k, v, out, grad_out, mask)


@pytest.mark.parametrize("topology", ["bits", "codes"])
def test_a_compiled_step_over_host_lengths_makes_no_mask(device, topology):
    """Layers over host lengths read the kept mask of those values in their ops, its tensors as well as its lists:
    the traced graphs hand the ops no mask tensor and make none (the graph made the mask's lengths, tables and
    token bits or codes every step, a few small launches, only for ops that read kept lists). The step's output
    and input gradient match eager's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    matrix = HUB if topology == "bits" else [[2, 1, 1], [1, 2, 0], [1, 0, 2]]  # CAUSAL pairs: segment codes
    torch._dynamo.reset()
    torch.manual_seed(0)
    # two layers: the first and one after it (a later layer reads what the second does)
    layers = torch.nn.Sequential(*(MultimodalSelfAttention(32, 2, matrix, LENS, device=device) for _ in range(2)))
    x = torch.randn(1, sum(LENS), 32, device=device, requires_grad=True)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(layers, fullgraph=True, backend=backend)
    results = []
    for model in (layers, compiled):
        x.grad = None
        out = model(x)
        out.sum().backward()
        results.append((out.detach(), x.grad.clone()))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    (forward,), (backward,) = backend.fw_graphs, backend.bw_graphs
    ops = {torch.ops.mmsparse.fwd_v9.default: forward, torch.ops.mmsparse.bwd_v9.default: backward}
    for op, graph in ops.items():
        calls = [node for node in graph.graph.nodes if node.target is op]
        assert len(calls) == len(layers)
        assert all(list(node.args[3 if op is torch.ops.mmsparse.fwd_v9.default else 6]) == [] for node in calls)
    mask_ops = {torch.ops.aten.cumsum.default, torch.ops.aten.searchsorted.Tensor, torch.ops.aten.full.default}
    made = [node.target for graph in ops.values() for node in graph.graph.nodes if node.target in mask_ops]
    assert not made, made
