"""Marks that tell ``torch.compile`` how to trace a function, set without importing Dynamo.

``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (about 2 s, half the time of ``import mmsparse``
in a fresh process) only to set one attribute on the function, which Dynamo reads when it traces a call to it. The
mark is set here directly; ``tests/api/test_import_time.py`` holds it equal to torch's own.
"""

from __future__ import annotations

from typing import Callable, TypeVar

Function = TypeVar("Function", bound=Callable)


def assume_constant_result(fn: Function) -> Function:
    """``torch.compiler.assume_constant_result``: traced, ``fn`` runs as Python on its constant arguments and its
    result enters the graph as a constant."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
