"""``import mmsparse`` leaves Dynamo unimported: ``torch._dynamo`` takes about 2 s to import, half the time of a fresh
process's ``import mmsparse``, and a process that never compiles should not pay it."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from mmsparse.runtime.traced import assume_constant_result


def test_import_leaves_dynamo_unimported():
    code = "import sys, mmsparse, mmsparse.nn, mmsparse.functional; print(sorted(m for m in sys.modules if " \
           "m.startswith('torch._dynamo')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_constant_result_mark_is_torchs():
    """Dynamo reads the mark when it traces a call: set here without Dynamo, it must be the one torch sets."""
    def by_torch(x: int) -> int:
        return x

    def by_mmsparse(x: int) -> int:
        return x

    assert torch.compiler.assume_constant_result(by_torch) is by_torch
    assert assume_constant_result(by_mmsparse) is by_mmsparse
    assert vars(by_torch) == vars(by_mmsparse) != {}


def test_a_marked_function_is_a_constant_in_the_graph():
    """Traced, a marked function runs as Python once per graph and its result is a constant: the graph does not
    call it again (no graph break at its json, which Dynamo cannot trace)."""
    calls = []

    @assume_constant_result
    def text(n: int) -> str:
        import json

        calls.append(n)
        return json.dumps({"n": n})

    @torch.compile(fullgraph=True, backend="eager")
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * len(text(3))

    x = torch.ones(4)
    assert torch.equal(scaled(x), x * 8) and torch.equal(scaled(x), x * 8)
    assert calls == [3]
