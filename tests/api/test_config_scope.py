"""``use_config`` settings belong to the thread that set them and are read once, when a call's forward runs: the
backward runs with the forward's settings wherever and whenever it runs (outside the block, on another thread).
The backward's plan is recorded where it launches."""

from __future__ import annotations

import threading

import pytest
import torch

from mmsparse import mbs_attention, reference_mask, use_config
from mmsparse.attention import backward as backward_module
from mmsparse.attention.config import default_deterministic, kernel_config
from mmsparse.tuning import KernelConfig, Tile, use_tuning
from tests.helpers import check_outputs, make_qkv

TOPOLOGY, LENS = [[1, 1, 0], [0, 1, 1], [1, 0, 1]], (9, 20, 11)
# Tiles no default config has, so that a backward planned with them is told apart from the default's.
ODD_TILES = KernelConfig(fwd=Tile(16, 16), bwd_dkdv=Tile(16, 16), bwd_dq=Tile(16, 16), decode=Tile(16, 16))


@pytest.fixture
def backward_plans(monkeypatch):
    """(thread name, dK/dV tile, plan) of every backward run while the test runs (on a GPU autograd runs the
    backward on a thread of its own)."""
    plans = []
    original = backward_module.BackwardLaunch.__call__

    def recording(self, *args, **kwargs):
        plans.append((threading.current_thread().name, self.plan.dkdv.tile, self.plan))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(backward_module.BackwardLaunch, "__call__", recording)
    return plans


def _call(device, generator, deterministic=None):
    seq = sum(LENS)
    q, k, v = make_qkv(1, 2, 1, seq, seq, 16, torch.float32, device, generator)
    out = mbs_attention(q, k, v, TOPOLOGY, LENS, deterministic=deterministic)
    return q, k, v, out


def _finish(q, k, v, out, generator):
    grad_out = torch.randn(out.shape, generator=generator).to(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(TOPOLOGY, LENS, k.shape[2], q.shape[2]))


def test_backward_runs_with_the_forwards_tiles(device, backward_plans):
    generator = torch.Generator().manual_seed(1)
    with use_tuning(ODD_TILES):
        q, k, v, out = _call(device, generator)
    _finish(q, k, v, out, generator)  # outside the block
    (_, tile, plan), = backward_plans
    assert tile == ODD_TILES.bwd_dkdv and plan.dq.tile == ODD_TILES.bwd_dq


def test_backward_runs_with_the_forwards_threshold(device, backward_plans):
    """The block asks for the two passes over more than 16 keys; outside it the default threshold (2048) would
    give this call the one-pass backward."""
    generator = torch.Generator().manual_seed(2)
    with use_tuning(one_pass_max_keys=16):
        q, k, v, out = _call(device, generator, deterministic=False)
    _finish(q, k, v, out, generator)
    (_, _, plan), = backward_plans
    assert plan.dq is not None, "the backward ran in one pass although the forward's settings ask for two"


def test_backward_runs_with_the_forwards_default_backward(device, backward_plans):
    generator = torch.Generator().manual_seed(3)
    with use_config(deterministic=False):
        q, k, v, out = _call(device, generator)
    _finish(q, k, v, out, generator)
    (_, _, plan), = backward_plans
    assert plan.dq is None, "use_config(deterministic=False) around the forward did not reach its backward"


def test_blocks_of_two_threads_exiting_out_of_order_leave_no_setting_behind():
    """Thread A enters, thread B enters, A exits, B exits: a process-wide snapshot restored by B would leave A's
    setting in force for everyone."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def thread_a():
        try:
            with use_config(deterministic=False):
                a_in.set()
                b_in.wait(10)
                seen["a"] = default_deterministic()
            a_out.set()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def thread_b():
        try:
            a_in.wait(10)
            with use_tuning(one_pass_max_keys=16):
                seen["b inside"] = (default_deterministic(), _one_pass_max_keys())
                b_in.set()
                a_out.wait(10)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen["a"] is False
    assert seen["b inside"] == (True, 16), "thread B saw thread A's setting"
    assert (default_deterministic(), _one_pass_max_keys()) == (True, KernelConfig.one_pass_max_keys)
    fresh = {}
    t = threading.Thread(target=lambda: fresh.update(settings=(default_deterministic(), _one_pass_max_keys())))
    t.start()
    t.join()
    assert fresh["settings"] == (True, KernelConfig.one_pass_max_keys)


def _one_pass_max_keys() -> int:
    return kernel_config(16, torch.float32, torch.device("cpu")).one_pass_max_keys


def test_threads_each_run_their_own_settings(device, backward_plans):
    """Four threads call at once, two inside a block of odd tiles, two outside it; each backward runs its own
    thread's forward's tiles, and every result matches the float64 reference."""
    barrier, errors = threading.Barrier(4), []

    def worker(index: int) -> None:
        try:
            generator = torch.Generator().manual_seed(10 + index)
            barrier.wait(10)
            if index % 2:
                with use_tuning(ODD_TILES):
                    q, k, v, out = _call(device, generator)
            else:
                q, k, v, out = _call(device, generator)
            _finish(q, k, v, out, generator)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # by count, not by thread: on a GPU the backward runs on autograd's own thread
    odd = sorted(tile == ODD_TILES.bwd_dkdv for _, tile, _ in backward_plans)
    assert odd == [False, False, True, True], [tile for _, tile, _ in backward_plans]


def test_use_tuning_refuses_a_config_of_another_type():
    with pytest.raises(TypeError, match="KernelConfig"):
        with use_tuning(Tile(16, 16)):
            pass


def test_compiled_calls_run_their_forwards_settings(device, backward_plans):
    """Under torch.compile (through the custom ops) the settings are read while tracing and carried to both ops
    as an id; the graph is guarded on them, so a call inside another block does not reuse the default's graph."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: mbs_attention(q, k, v, TOPOLOGY, LENS), backend="aot_eager",
                             fullgraph=True)
    generator = torch.Generator().manual_seed(20)
    seq = sum(LENS)
    for odd in (False, True, False):
        q, k, v = make_qkv(1, 2, 1, seq, seq, 16, torch.float32, device, generator)
        if odd:
            with use_tuning(ODD_TILES):
                out = compiled(q, k, v)
        else:
            out = compiled(q, k, v)
        _finish(q, k, v, out, generator)  # the backward outside the block
    assert [tile == ODD_TILES.bwd_dkdv for _, tile, _ in backward_plans] == [False, True, False]
