"""Activation checkpointing recomputes under the forward's settings with ``mmsparse.checkpoint`` (either kind of
checkpoint) or ``mmsparse.settings_context_fn`` (torch's non-reentrant one): the backward, run outside the
forward's ``use_tuning`` / ``use_config`` blocks, runs the forward's tiles and backward, and the recompute plans
nothing again, so its saved out and lse are the forward's bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint

import mmsparse
from mmsparse import mbs_attention, reference_mask, use_config
from mmsparse.attention import backward as backward_module
from mmsparse.attention import call as call_module
from mmsparse.tuning import KernelConfig, Tile, use_tuning
from tests.helpers import check_outputs, make_qkv

TOPOLOGY, LENS = [[1, 1, 0], [0, 1, 1], [1, 0, 1]], (9, 20, 11)
ODD = KernelConfig(fwd=Tile(16, 16), bwd_dkdv=Tile(16, 16), bwd_dq=Tile(16, 16), decode=Tile(16, 16))


@pytest.fixture
def recorded(monkeypatch):
    """The configs of the calls planned, and (thread, plan) of every backward run, while the test runs."""
    seen = {"planned": [], "backwards": []}
    plan, run = call_module.plan_attention, backward_module.BackwardLaunch.__call__

    def planning(config, *args, **kwargs):
        seen["planned"].append(config)
        return plan(config, *args, **kwargs)

    def running(self, *args, **kwargs):
        seen["backwards"].append((threading.current_thread().name, self.plan))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(call_module, "plan_attention", planning)
    monkeypatch.setattr(backward_module.BackwardLaunch, "__call__", running)
    return seen


def _region(q, k, v):
    return mbs_attention(q, k, v, TOPOLOGY, LENS) * 2


def _check(q, k, v, out, generator):
    grad_out = torch.randn(out.shape, generator=generator).to(out)
    out.backward(grad_out)  # outside the blocks
    check_outputs(q, k, v, out / 2, grad_out * 2, reference_mask(TOPOLOGY, LENS, sum(LENS)))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_recomputes_with_the_forwards_settings(device, recorded, use_reentrant):
    generator = torch.Generator().manual_seed(21)
    q, k, v = make_qkv(1, 2, 1, sum(LENS), sum(LENS), 16, torch.float32, device, generator)
    mmsparse.clear_caches()
    with use_tuning(ODD), use_config(deterministic=False):
        out = mmsparse.checkpoint(_region, q, k, v, use_reentrant=use_reentrant)
    _check(q, k, v, out, generator)
    (_, plan), = recorded["backwards"]
    assert plan.dkdv.tile == ODD.bwd_dkdv and plan.dq is None, "the backward ran other settings than its forward's"
    # the forward's plan only (reentrant: the forward ran without grad, and the recompute found its launch)
    assert recorded["planned"] == [ODD]


def test_settings_context_fn_recomputes_with_the_forwards_settings(device, recorded):
    generator = torch.Generator().manual_seed(22)
    q, k, v = make_qkv(1, 2, 1, sum(LENS), sum(LENS), 16, torch.float32, device, generator)
    mmsparse.clear_caches()
    with use_tuning(ODD):
        out = torch.utils.checkpoint.checkpoint(_region, q, k, v, use_reentrant=False,
                                                context_fn=mmsparse.settings_context_fn)
    _check(q, k, v, out, generator)
    (_, plan), = recorded["backwards"]
    assert plan.dkdv.tile == ODD.bwd_dkdv
    assert recorded["planned"] == [ODD]


def test_plain_torch_checkpoint_recomputes_with_the_threads_settings_now(device, recorded):
    """What the helpers are for: torch's own checkpoint recomputes with the settings of the backward's time."""
    generator = torch.Generator().manual_seed(23)
    q, k, v = make_qkv(1, 2, 1, sum(LENS), sum(LENS), 16, torch.float32, device, generator)
    mmsparse.clear_caches()
    with use_tuning(ODD):
        out = torch.utils.checkpoint.checkpoint(_region, q, k, v, use_reentrant=False)
    _check(q, k, v, out, generator)
    assert recorded["planned"][0] == ODD and recorded["planned"][1] != ODD
