"""Shared test helpers: the topologies and cases several test modules use, inputs, the float64 comparison,
verbose closeness checks. (Fixtures live in tests/conftest.py.)"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmsparse import mbs_attention, reference_attention, reference_mask
from mmsparse.nn import MultimodalSelfAttention

REPO = Path(__file__).resolve().parents[1]  # the checkout: README.md, examples/, mmsparse/

# Topologies (row r lists the segments whose keys segment r's queries see).
CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]  # each segment sees only the next one, not itself
HUB = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]  # segment 0 sees all; the others see themselves and segment 0
RING = [[1, 1, 0], [0, 1, 1], [1, 0, 1]]  # each segment sees itself and the next one
FOUR = [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0], [0, 1, 0, 1]]  # segment 1 sees nothing

# The Gluon Hopper kernels' cases (forward and backward): ragged segments, causal, GQA, per-sample lengths, fewer
# queries than keys, a segment that sees nothing, a zero-length segment, padded head dims, one short sequence.
HOPPER_CASES = [
    # (topology, seg_lens (or per-sample), causal, batch, heads, kv_heads, seq_q or None, head_dim, dtype)
    (CYCLIC, (300, 1000, 777), False, 1, 4, 2, None, 128, torch.bfloat16),
    (HUB, (513, 2049, 1031), True, 1, 2, 2, None, 64, torch.float16),
    (HUB, [(100, 900, 300), (700, 200, 77)], False, 2, 2, 1, None, 128, torch.bfloat16),
    (CYCLIC, (500, 1200, 900), True, 1, 2, 1, 300, 128, torch.bfloat16),
    (FOUR, (999, 130, 700, 1100), False, 1, 2, 1, None, 96, torch.bfloat16),
    (HUB, (10, 40, 27), False, 1, 1, 1, None, 128, torch.bfloat16),
    (CYCLIC, (0, 2000, 600), True, 1, 2, 1, None, 128, torch.bfloat16),  # a zero-length segment
]


def hopper_case_id(case) -> str:
    topo, lens, causal, b, h, hk, sq, d, dtype = case
    return f"k{len(topo)}-B{b}-H{h}x{hk}-Sq{sq}-D{d}-{str(dtype)[6:]}{'-causal' if causal else ''}-{lens}"

# Slack on top of the calibrated bound, per input dtype (absolute, for unit-scale random inputs).
ATOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}
SLACK = 3.0  # the kernel may be this many times further from float64 than plain torch in the input dtype
# Plus one unit in the last place of the stored dtype, relative to each reference element: the kernels round
# fp32 results once into the output dtype, plain torch rounds at other points, so on tiny tensors the two
# can land on neighbouring representable values.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_calibrated(
    name: str, actual: torch.Tensor, exact: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype
) -> None:
    """FlashAttention-style calibrated check: the kernel's distance from the float64 result (``exact``) must be
    within SLACK times the distance of plain torch attention computed in the input dtype (``plain``), plus a
    small absolute slack, both for the max and for the RMS error. The message names the tensor, the errors and
    any NaN positions."""
    a, e, p = (t.detach().double().cpu() for t in (actual, exact, plain))
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    nan = torch.isnan(a)
    assert not nan.any(), f"{name}: {int(nan.sum())} NaN of {a.numel()}, first at {nan.nonzero()[:5].tolist()}"
    err, err_plain = (a - e).abs(), (p - e).abs()
    max_bound = SLACK * err_plain.max().item() + ATOL[dtype]
    err = (err - ULP[dtype] * e.abs()).clamp(min=0)  # what exceeds one ulp of rounding
    rms, rms_plain = err.pow(2).mean().sqrt().item(), err_plain.pow(2).mean().sqrt().item()
    rms_bound = SLACK * rms_plain + ATOL[dtype] / 4
    where = tuple(int(i) for i in torch.unravel_index(err.flatten().argmax(), err.shape))
    rel = (a - e).norm().item() / max(e.norm().item(), 1e-30)
    assert err.max().item() <= max_bound and rms <= rms_bound, (
        f"{name} ({dtype}): max err {err.max().item():.3e} at {where} (bound {max_bound:.3e}; plain torch "
        f"{err_plain.max().item():.3e}), rms err {rms:.3e} (bound {rms_bound:.3e}), rel L2 {rel:.3e}"
    )


# Fixed tolerances for comparisons without a plain-torch calibration: (max relative L2, max abs relative to the
# reference's max magnitude, floored at 1 since inputs are unit-scale randn).
TOLERANCE = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (3e-3, 1.5e-2),
    torch.bfloat16: (2e-2, 8e-2),
}


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative L2 and scaled max-abs check; the message names the tensor, the errors and any NaN positions."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    nan = torch.isnan(a)
    assert not nan.any(), f"{name}: {int(nan.sum())} NaN of {a.numel()}, first at {nan.nonzero()[:5].tolist()}"
    rel_tol, abs_tol = TOLERANCE[dtype]
    scale = max(e.abs().max().item(), 1.0)
    rel = ((a - e).norm() / max(e.norm().item(), 1e-2 * e.numel() ** 0.5)).item()
    max_abs = (a - e).abs().max().item()
    assert rel <= rel_tol and max_abs <= abs_tol * scale, (
        f"{name} ({dtype}): rel L2 {rel:.3e} (tol {rel_tol:.0e}), max abs {max_abs:.3e} (tol {abs_tol * scale:.3e}), "
        f"ref max {scale:.3e}"
    )


def make_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, device, generator=None):
    def rnd(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    q = rnd(batch, heads, seq_q, head_dim).requires_grad_()
    k = rnd(batch, kv_heads, seq_k, head_dim).requires_grad_()
    v = rnd(batch, kv_heads, seq_k, head_dim).requires_grad_()
    return q, k, v


def record_backward_passes(monkeypatch, events: list[str]) -> None:
    """Append "dq" or "dkdv" to ``events`` as each backward pass of an eager call is queued."""
    from mmsparse.attention import backward

    for name in ("dq", "dkdv"):
        original = getattr(backward._Passes, name)

        def recorded(self, *args, _original=original, _name=name):
            events.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(backward._Passes, name, recorded)


def spy_on_gluon_launchers(monkeypatch, names: tuple[str, ...]) -> list[str]:
    """The names of the Gluon launchers ``gluon_launch.run_<name>`` that run from now on, in order: only a spy on
    them tells which kernels ran (the tl ones agree within tolerance)."""
    from mmsparse.attention import gluon_launch

    calls: list[str] = []
    for name in names:
        real = getattr(gluon_launch, f"run_{name}")

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(gluon_launch, f"run_{name}", spy)
    return calls


def reference_grads(q, k, v, mask, grad_out, softmax_scale=None, dtype=torch.float64, **kw):
    """Reference output and (dq, dk, dv) from plain torch attention computed in ``dtype``."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = reference_attention(qd, kd, vd, mask, softmax_scale=softmax_scale, dtype=dtype, **kw)
    out.backward(grad_out.to(dtype))
    return out, qd.grad, kd.grad, vd.grad


def forward_backward(q, k, v, grad_out, **kw):
    """(out, dq, dk, dv) of one ``mbs_attention(q, k, v, **kw)`` call over fresh leaves of q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = mbs_attention(q, k, v, **kw)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def check_outputs(q, k, v, out, grad_out, mask, softmax_scale=None, *, grads=None, **kw):
    """Compare out and q/k/v .grad (after out.backward(grad_out)) with float64 and plain-torch references.
    ``grads``: (dq, dk, dv) to check instead of the leaves' .grad (e.g. ``torch.autograd.grad``'s, as returned)."""
    exact = reference_grads(q, k, v, mask, grad_out, softmax_scale, torch.float64, **kw)
    plain = reference_grads(q, k, v, mask, grad_out, softmax_scale, q.dtype, **kw)
    dq, dk, dv = grads if grads is not None else (q.grad, k.grad, v.grad)
    for i, (name, actual) in enumerate((("out", out), ("dq", dq), ("dk", dk), ("dv", dv))):
        assert_calibrated(name, actual, exact[i], plain[i], q.dtype)


def assert_replay_matches_eager(graph, captured: torch.Tensor, leaves: tuple, step) -> None:
    """``graph`` captured ``captured = step()`` (a forward + backward that sets the ``leaves``' ``.grad``): with the
    leaves changed in place, its replay gives, bit for bit, the output and gradients of an eager ``step()``."""
    captured_grads = [t.grad for t in leaves]
    with torch.no_grad():
        for t in leaves:
            t.add_(0.25)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [captured.clone(), *(g.clone() for g in captured_grads)]
    fresh = step()
    for name, got, want in zip(("out", "dq", "dk", "dv"), replayed, [fresh, *(t.grad for t in leaves)]):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"replayed {name} differs from an eager call")


class TorchOps(TorchDispatchMode):
    """Counts the torch ops dispatched while it is on (``ops``: the overload's name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def check_against_reference(q, k, v, topology, seg_lens, causal=False, softmax_scale=None, window=None, **kw):
    """Run mbs_attention forward and backward; compare output and all three gradients with the references."""
    out = mbs_attention(q, k, v, topology, seg_lens, causal=causal, softmax_scale=softmax_scale, window=window, **kw)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    mask = reference_mask(topology, seg_lens, k.shape[2], q.shape[2], causal=causal, q_start=kw.get("q_start"),
                          window=window)
    check_outputs(q, k, v, out, grad_out, mask, softmax_scale)
    return out, mask


def layer_reference(layer: MultimodalSelfAttention, x: torch.Tensor, mask: torch.Tensor,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The layer's math in ``dtype`` (float64 by default) with plain torch ops and the dense reference attention:
    (out, x and the parameters as leaves of that dtype, for their gradients after ``out.backward``)."""
    p = {n: t.detach().to(dtype).requires_grad_() for n, t in layer.named_parameters()}
    xd = x.detach().to(dtype).requires_grad_()
    b, s, _ = x.shape
    d = layer.head_dim

    def heads(t, n):
        return t.view(b, s, n, d).transpose(1, 2)

    q = heads(F.linear(xd, p["q_proj.weight"], p["q_proj.bias"]), layer.num_heads)
    k = heads(F.linear(xd, p["k_proj.weight"], p["k_proj.bias"]), layer.num_kv_heads)
    v = heads(F.linear(xd, p["v_proj.weight"], p["v_proj.bias"]), layer.num_kv_heads)
    o = reference_attention(q, k, v, mask, dtype=dtype).transpose(1, 2).reshape(b, s, -1)
    return F.linear(o, p["out_proj.weight"], p["out_proj.bias"]), xd, p


def run_example(name: str, argv: list[str]) -> Any:
    """Import ``examples/<name>.py`` and return ``main(argv)``."""
    path = REPO / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        return module.main(argv)
    finally:
        del sys.modules[spec.name]


def checkout_pythonpath() -> str:
    """A child's ``PYTHONPATH`` that imports this checkout first, keeping the test process's entries after it
    (tests/conftest.py's ``child_site``)."""
    return os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))


def torchrun_on_cpu(module: str, ranks: int, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python -m module args`` in ``ranks`` processes under torchrun (gloo on the CPU), from the checkout, with
    ``env`` added to the environment; fails the test with the output's tail unless it exits with 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
               module, *args]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": checkout_pythonpath(), **env},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def writer_config(head_dim: int, dtype: torch.dtype = torch.bfloat16):
    """The H100/H200 config of ``head_dim`` with the dQ-writer kernel on (``KernelConfig.gluon_dq_writer``)."""
    from mmsparse.attention.config import HOPPER, cuda_kernel_config

    return cuda_kernel_config(head_dim, dtype, HOPPER, gluon=True, gluon_dq_writer=True)


def ordered_config(head_dim: int, dtype: torch.dtype = torch.bfloat16):
    """:func:`writer_config` with the dQ writer's adds in order for deterministic calls
    (``KernelConfig.ordered_dq_writer``)."""
    import dataclasses

    return dataclasses.replace(writer_config(head_dim, dtype), ordered_dq_writer=True)
