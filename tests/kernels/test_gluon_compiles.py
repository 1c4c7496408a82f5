"""The Gluon Hopper kernels compile for sm_90 on any machine. Gluon has no CPU interpreter, but Triton's compiler
and ptxas ship with the wheel: an API that a Triton release renamed, or a type error in a kernel, shows here on CPU
instead of first on a Hopper GPU.

The compile runs in a child process without TRITON_INTERPRET (the interpreter replaces the ``triton.jit`` helpers
that the Gluon kernels call). Run as a script, this file compiles the three passes over a segment-code mask (the
mask mode with the most code: the shared rule, the pair table) and a causal bit mask, and prints one line a kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXPECTED = ["fwd-codes", "dq-codes", "dkdv-codes", "fwd-bits", "dq-bits", "dkdv-bits"]


def test_gluon_kernels_compile_for_sm90():
    pytest.importorskip("triton.experimental.gluon")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    compiled = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith(" compiled")]
    assert compiled == EXPECTED, proc.stdout


def _compile_launch(name, kernel, args, kwargs):
    """What ``kernel[grid](*args, **kwargs)`` would compile, built for sm_90 instead of launched."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    assert "wgmma" in compiled.asm["ptx"], name  # the Hopper matmuls, not a fallback
    print(name, "compiled", flush=True)


def _main() -> None:
    import torch

    from mmsparse.functional import build_mask_info
    from mmsparse.ops import gluon_launch
    from mmsparse.ops.config import _GLUON_DKDV, _GLUON_DQ, _GLUON_FWD

    current = {}

    class Compile:
        def __init__(self, launcher):
            self.kernel = launcher.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: _compile_launch(current["name"], self.kernel, args, kwargs)

    gluon_launch._FWD, gluon_launch._DQ, gluon_launch._DKDV = (
        Compile(gluon_launch._FWD), Compile(gluon_launch._DQ), Compile(gluon_launch._DKDV))
    batch, heads, kv_heads, seq, head_dim = 1, 4, 2, 384, 128
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rows = torch.zeros(batch, heads, seq)
    for tag, topology, causal in (("codes", [[2, 1, 0], [0, 2, 1], [1, 0, 2]], False),
                                  ("bits", [[1, 1, 0], [0, 1, 1], [1, 0, 1]], True)):
        info = build_mask_info(topology, [[150, 150, 84]], seq, seq, causal, torch.device("cpu"))
        current["name"] = f"fwd-{tag}"
        gluon_launch.run_forward(q, k, v, info, 1.0, _GLUON_FWD[head_dim])
        current["name"] = f"dq-{tag}"
        gluon_launch.run_dq(q, k, v, q.clone(), rows, rows, torch.empty_like(q), info, 1.0, 1.0, _GLUON_DQ[head_dim])
        current["name"] = f"dkdv-{tag}"
        gluon_launch.run_dkdv(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)), info, 1.0,
                              1.0, _GLUON_DKDV[head_dim])


if __name__ == "__main__":
    _main()
