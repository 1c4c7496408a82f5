"""Triton's CPU interpreter is asked once a process, at the first interpreted launch, whether it runs a loop bounded
by a kernel argument: Triton 3.6's does not under NumPy 2.4, and every CPU call then failed deep inside a list kernel
with "only 0-dimensional arrays can be converted to Python scalars". Now the call raises one error that names the
versions and the fix."""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention
from mmsparse.runtime import interpreter_probe
from tests.helpers import CYCLIC

# What Triton 3.6's interpreter raised at a kernel's ``range(0, n)`` under NumPy 2.4.6.
_TRITON_36_FAILURE = TypeError("only 0-dimensional arrays can be converted to Python scalars")


class _Launch:
    """Stands in for the probe's launch: raises ``failure``, or writes ``steps`` as the loop's count."""

    def __init__(self, failure: Exception | None = None, steps: int = 0) -> None:
        self.failure, self.steps = failure, steps

    def __getitem__(self, grid):
        def launch(out, n):
            if self.failure is not None:
                from triton.runtime.errors import InterpreterError

                raise InterpreterError(repr(self.failure))
            out.fill_(self.steps)

        return launch


@pytest.fixture
def fresh_probe():
    interpreter_probe.forget_answer()
    yield
    interpreter_probe.forget_answer()


def _cpu_call():
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    return mbs_attention(q, k, v, CYCLIC, (5, 5, 10))


@pytest.mark.interpreter
def test_this_interpreter_runs_the_probe_and_a_call(fresh_probe):
    assert interpreter_probe.interpreter_problem() is None
    assert torch.isfinite(_cpu_call()).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("launch, said", [(_Launch(failure=_TRITON_36_FAILURE), "only 0-dimensional arrays"),
                                          (_Launch(steps=1), "ran 1 steps of 3")], ids=["raises", "miscounts"])
def test_an_interpreter_that_fails_the_probe_is_named_at_the_call(fresh_probe, monkeypatch, launch, said):
    import numpy
    import triton

    monkeypatch.setattr(interpreter_probe, "loop_probe_kernel", launch)
    with pytest.raises(RuntimeError) as caught:
        _cpu_call()
    message = str(caught.value)
    assert said in message
    assert f"Triton {triton.__version__}" in message and f"NumPy {numpy.__version__}" in message
    assert "pip install -U 'triton>=3.7'" in message and "pip install 'numpy<2.4'" in message
