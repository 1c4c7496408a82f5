"""Fixtures of the kernel tests that several modules share."""

from __future__ import annotations

import inspect

import pytest


@pytest.fixture
def writer_calls(monkeypatch):
    """The tile of each dQ-writer launch, and the name of any other Gluon backward launcher that ran; in
    ``calls.ordered``, whether each dQ-writer launch had its adds in order, and in ``calls.shortest_first`` the
    launch direction of each ordered one."""
    from mmsparse.attention import gluon_launch

    class Calls(list):
        ordered: list
        shortest_first: list

    calls = Calls()
    calls.ordered, calls.shortest_first = [], []
    real = {name: getattr(gluon_launch, name) for name in ("run_bwd_dq_writer", "run_dkdv", "run_dq")}

    signature = inspect.signature(real["run_bwd_dq_writer"])

    def spy(name):
        def launch(*args, **kwargs):
            if name == "run_bwd_dq_writer":
                arguments = signature.bind(*args, **kwargs).arguments
                calls.append(arguments["tile"])
                calls.ordered.append(arguments.get("order") is not None)
                if calls.ordered[-1]:
                    calls.shortest_first.append(arguments.get("shortest_first", True))
            else:
                calls.append(name)
            return real[name](*args, **kwargs)
        return launch

    for name in real:
        monkeypatch.setattr(gluon_launch, name, spy(name))
    return calls
