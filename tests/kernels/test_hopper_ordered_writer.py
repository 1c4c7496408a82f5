"""The dQ-writer kernel with its adds in order (``KernelConfig.ordered_dq_writer``): deterministic=True's backward in
one pass, the adds into each query block in a fixed order (``mmsparse.mask.add_order``). Its plan on any machine; on
an sm_90 GPU the output and all three gradients against float64 over packed lists and packs of samples (the dQ
writer's cases: tests/kernels/test_hopper_dq_writer.py), and dQ, dK and dV bitwise equal from run to run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from mmsparse import mbs_attention, mbs_attention_varlen, reference_mask
from mmsparse.attention.config import EVERY_LENGTH, kernel_config
from mmsparse.attention.plan import call_plan_from_text, plan_attention, plan_call
from mmsparse.kernels.constants import MASK_BITS
from mmsparse.tuning import use_tuning
from tests.helpers import CYCLIC, HUB, REPO, check_outputs, make_qkv, ordered_config, writer_config

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# The switch and the plan (any machine)


def test_deterministic_plans_the_ordered_writer():
    """With the switch, deterministic=True plans the dQ writer with ordered adds (one pass, no side stream) and
    deterministic=False the unordered one; with dropout, without the writer's tile or past dq_writer_max_keys the
    two passes stay."""
    config = ordered_config(128)
    plan = plan_attention(config, 1, 4, 2, 4096, 4096, CPU, deterministic=True)
    assert plan.dq is None and plan.dkdv.dq_writer and plan.dkdv.ordered and not plan.side_stream
    assert plan.kernels()["dkdv"] == "gluon-dq-writer-ordered"
    unordered = plan_attention(config, 1, 4, 2, 4096, 4096, CPU, deterministic=False)
    assert unordered.dkdv.dq_writer and not unordered.dkdv.ordered
    assert plan_attention(config, 1, 4, 2, 4096, 4096, CPU, dropout=True, deterministic=True).dq is not None
    no_writer = dataclasses.replace(config, gluon_dq_writer=None, gluon_dq_writer_long=None)
    assert plan_attention(no_writer, 1, 4, 2, 4096, 4096, CPU, deterministic=True).dq is not None
    capped = dataclasses.replace(config, dq_writer_max_keys=4096)
    assert plan_attention(capped, 1, 4, 2, 4095, 4095, CPU, deterministic=True).dkdv.ordered
    assert plan_attention(capped, 1, 4, 2, 4096, 4096, CPU, deterministic=True).dq is not None
    assert not writer_config(128).ordered_dq_writer  # off unless asked for


def test_deterministic_packs_of_short_samples_plan_the_ordered_writer():
    """Without the switch, deterministic=True plans the ordered dQ writer over packs of samples of at most
    ordered_samples tokens on average (1,024), and the two passes over longer samples, outside packs, with dropout
    and with ordered_samples=0."""
    config = writer_config(128)
    assert not config.ordered_dq_writer and config.ordered_samples == 1024

    def plan(cfg=config, sample_len=None, dropout=False):
        return plan_attention(cfg, 1, 16, 4, 65536, 65536, CPU, sample_len, dropout, deterministic=True)

    for sample_len in (128, 1024):
        assert plan(sample_len=sample_len).dq is None and plan(sample_len=sample_len).dkdv.ordered
        assert plan(sample_len=sample_len).kernels()["dkdv"] == "gluon-dq-writer-ordered"
    assert plan(sample_len=1025).dq is not None and plan().dq is not None
    assert plan(sample_len=128, dropout=True).dq is not None
    assert plan(dataclasses.replace(config, ordered_samples=0), sample_len=128).dq is not None
    assert plan_attention(writer_config(64), 1, 4, 4, 8192, 8192, CPU, 512, deterministic=True).dkdv.ordered


def test_the_plan_text_carries_the_order():
    """The ops' plan text holds ``ordered``: a traced backward runs the ordered kernel too."""
    plan = plan_call(ordered_config(64), 3000, 3000, CPU, None, False, True, MASK_BITS, True, None, 3)
    assert plan.dkdv.ordered and call_plan_from_text(plan.text) == plan
    unordered = plan_call(ordered_config(64), 3000, 3000, CPU, None, False, False, MASK_BITS, True, None, 3)
    assert not unordered.dkdv.ordered and call_plan_from_text(unordered.text) == unordered


def test_the_switch_is_a_bool():
    with pytest.raises(TypeError, match="ordered_dq_writer must be True or False"):
        dataclasses.replace(writer_config(128), ordered_dq_writer=1)


def test_the_head_section_goes_to_the_ordered_plan_and_its_text():
    """``ordered_head_section`` reaches the ordered writer's plan and the ops' plan text (a plan text without it,
    from an older release, reads 1); the unordered writer and the two passes keep 1, and a pass that is not the
    ordered writer refuses another."""
    config = dataclasses.replace(ordered_config(128), ordered_head_section=4)
    plan = plan_attention(config, 1, 4, 2, 4096, 4096, CPU, deterministic=True)
    assert plan.dkdv.ordered and plan.dkdv.head_section == 4
    assert plan_attention(config, 1, 4, 2, 4096, 4096, CPU, deterministic=False).dkdv.head_section == 1
    two_passes = dataclasses.replace(writer_config(128), ordered_head_section=4)
    assert plan_attention(two_passes, 1, 4, 2, 4096, 4096, CPU, deterministic=True).dkdv.head_section == 1
    call = plan_call(config, 3000, 3000, CPU, None, False, True, MASK_BITS, False, None, 3)
    assert call.dkdv.head_section == 4 and call_plan_from_text(call.text) == call
    older = json.loads(call.text)
    del older["dkdv"]["head_section"]
    assert call_plan_from_text(json.dumps(older)).dkdv.head_section == 1
    with pytest.raises(ValueError, match="head_section is the ordered dQ writer's"):
        dataclasses.replace(plan.dkdv, ordered=False)


def test_the_backward_ranks_a_section_in_groups_of_its_share_of_the_gpu(monkeypatch):
    """A section holds ``ordered_head_section`` query heads: that over the GQA group (at least one) (batch, KV
    head)s, whose programs take each key block in turn; the ranks' groups hold the programs a GPU runs at once
    divided by those (the section's heads' groups of the same rows are then as many programs as the GPU holds:
    ``mask.add_order``); one head a section, the GPU's whole count, as before. The count is what the call's stream
    may use (``runtime.multiprocessors``): under a limit, a section's groups shrink with it."""
    from mmsparse.attention import backward

    usable = {0: 132, 7: 64}  # stream handle -> its multiprocessors (7: a green context's stream, say)
    monkeypatch.setattr(backward, "usable_multiprocessors", lambda device, stream: usable[stream])
    # (query heads, KV heads, query heads a section, KV heads a section, programs a group of ranks)
    cases = ((4, 2, 1, 1, 132), (4, 2, 4, 2, 66), (4, 2, 16, 8, 16), (4, 4, 4, 4, 33), (16, 16, 16, 16, 8),
             (16, 4, 4, 1, 132), (16, 2, 4, 1, 132), (16, 2, 16, 2, 66))
    for heads, kv_heads, section, kv_section, resident in cases:
        q, k = torch.zeros(1, heads, 4096, 128), torch.zeros(1, kv_heads, 4096, 128)
        config = dataclasses.replace(ordered_config(128), ordered_head_section=section)
        call = plan_call(config, 4096, 4096, CPU, None, False, True, MASK_BITS, False, None, 3)
        launch = backward.BackwardLaunch(q, k, call, call, 0.125, 0.0)
        assert launch.ordered and (launch.head_section, launch.resident_rows(0)) == (kv_section, resident), (
            heads, section)
        assert launch.resident_rows(7) == max(1, 64 // kv_section)
        # launched shortest first (the causal flag): one head after the other, whatever the config says
        causal = plan_call(config, 4096, 4096, CPU, None, False, True, MASK_BITS, True, None, 3)
        launch = backward.BackwardLaunch(q, k, causal, causal, 0.125, 0.0)
        assert launch.shortest_first and launch.head_section == 1 and launch.resident_rows(0) == 132
        assert launch.resident_rows(7) == 64


def _bits_mask(lengths, causal=False):
    from mmsparse.mask.build import build_mask_info

    return build_mask_info(CYCLIC, lengths, sum(lengths), sum(lengths), causal, CPU)


def test_deterministic_plans_the_ordered_writer_where_it_launches_longest_first():
    """By default deterministic=True plans the ordered dQ writer, in sections of 4 query heads, over a mask whose
    programs it launches longest list first (a bit mask without the causal flag) from ``short_keys`` keys below
    ``ordered_max_keys`` (every length), in eager (the call's launch) and traced (``plan_call``) alike, and builds
    its lists ahead (``prepare``); the two passes stay below ``short_keys`` keys, with the causal flag or segment
    codes (launched shortest first), over a pack of longer samples, with dropout, and from ``ordered_max_keys`` (0:
    never)."""
    from mmsparse.attention.call import CallLaunch
    from mmsparse.attention.kernel_args import prepare
    from mmsparse.kernels.constants import MASK_SEGMENTS

    config = writer_config(128)
    assert config.ordered_max_keys == EVERY_LENGTH and not config.ordered_dq_writer and config.ordered_head_section == 4

    def plan(cfg=config, seq=4096, longest_first=True, **kwargs):
        return plan_attention(cfg, 1, 4, 2, seq, seq, CPU, deterministic=True, longest_first=longest_first,
                              **kwargs)

    assert plan().dq is None and plan().dkdv.ordered and plan().dkdv.head_section == 4
    assert plan().kernels()["dkdv"] == "gluon-dq-writer-ordered"
    assert plan(seq=config.short_keys).dkdv.ordered and plan(seq=config.short_keys - 1).dq is not None
    assert plan(longest_first=False).dq is not None and plan(dropout=True).dq is not None
    assert plan(sample_len=2048).dq is not None  # a pack: its own threshold (ordered_samples)
    capped = dataclasses.replace(config, ordered_max_keys=8192)
    assert plan(capped, seq=8191).dkdv.ordered and plan(capped, seq=8192).dq is not None
    assert plan(dataclasses.replace(config, ordered_max_keys=0)).dq is not None
    with use_tuning(ordered_max_keys=0):  # a threshold of use_tuning's
        assert kernel_config(128, torch.bfloat16, CPU).ordered_max_keys == 0
    assert not plan_attention(config, 1, 4, 2, 4096, 4096, CPU, deterministic=False).dkdv.ordered
    traced = plan_call(config, 4096, 4096, CPU, None, False, True, MASK_BITS, False, None, 3)
    assert traced.dkdv.ordered and traced.dkdv.head_section == 4
    for mode, causal in ((MASK_BITS, True), (MASK_SEGMENTS, False)):
        assert plan_call(config, 4096, 4096, CPU, None, False, True, mode, causal, None, 3).dq is not None
    info = _bits_mask((1000, 2000, 1096))
    q = k = v = torch.zeros(1, 4, 4096, 128, dtype=torch.bfloat16)
    launch = CallLaunch(q, k[:, :2], v[:, :2], info, config, 0.125, 0.0, None, True)
    assert launch.plan.kernels()["dkdv"] == "gluon-dq-writer-ordered" and launch.call_plan.dkdv.ordered
    causal = CallLaunch(q, k[:, :2], v[:, :2], _bits_mask((1000, 2000, 1096), causal=True), config, 0.125, 0.0,
                        None, True)
    assert causal.plan.dq is not None
    # at D=64 the ordered writer's lists are a tile of their own (128 x 128 by key)
    d64 = writer_config(64)
    one_pass = plan_attention(d64, 1, 4, 2, 4096, 4096, CPU, deterministic=True, longest_first=True).dkdv.lists
    assert one_pass not in plan_attention(d64, 1, 4, 2, 4096, 4096, CPU, deterministic=True).list_tiles()
    assert prepare(_bits_mask((1001, 1999, 1096)), d64).lists_built(*one_pass) is not None
    assert prepare(_bits_mask((1002, 1998, 1096), causal=True), d64).lists_built(*one_pass) is None


@pytest.mark.parametrize("value, error", [(0, ValueError), (17, ValueError), (True, TypeError), (2.0, TypeError)])
def test_the_head_section_is_checked(value, error):
    with pytest.raises(error, match="ordered_head_section"):
        dataclasses.replace(ordered_config(128), ordered_head_section=value)


# ---------------------------------------------------------------------------------------------------------------
# On an sm_90 GPU


def _run(q, k, v, config, deterministic=True, **kwargs):
    with use_tuning(config):
        out = mbs_attention(q, k, v, deterministic=deterministic, **kwargs)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    return out, grad_out


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ordered_writer_over_packed_lists(head_dim, writer_calls):
    """Lists packed end to end (compact_bytes 1: every list), per-sample lengths, GQA 4: each sample's ranks."""
    lens = [(700, 1500, 1001), (2000, 900, 301)]
    q, k, v = make_qkv(2, 8, 2, 3202, 3202, head_dim, torch.bfloat16, CUDA)
    config = dataclasses.replace(ordered_config(head_dim), compact_bytes=1)
    out, grad_out = _run(q, k, v, config, topology=CYCLIC, seg_lens=lens, causal=True)
    assert writer_calls.ordered == [True] and len(writer_calls) == 1  # no other backward kernel
    check_outputs(q, k, v, out, grad_out, reference_mask(CYCLIC, lens, 3202, causal=True))


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("switch", [True, False], ids=["switch", "default"])
def test_ordered_writer_over_a_pack_of_samples(switch, writer_calls):
    """A pack of samples of 749 tokens on average, with the switch and by default (ordered_samples)."""
    rows = [[300, 200, 100], [50, 700, 0], [129, 257, 513]]
    seq = sum(map(sum, rows))
    q, k, v = make_qkv(1, 4, 2, seq, seq, 128, torch.bfloat16, CUDA)
    with use_tuning(ordered_config(128) if switch else None):
        out = mbs_attention_varlen(q, k, v, HUB, rows, causal=True, deterministic=True)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    assert writer_calls.ordered == [True] and len(writer_calls) == 1  # no other backward kernel
    mask = torch.block_diag(*(reference_mask(HUB, r, sum(r), causal=True)[0] for r in rows))[None]
    check_outputs(q, k, v, out, grad_out, mask)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal-shortest-first", "full-longest-first"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ordered_writer_is_bitwise_repeatable(head_dim, causal, writer_calls):
    """Many key blocks add into each query block (6k keys, 8 heads over 2 KV heads, 2 samples: 200+ CTAs, more than
    the GPU holds at once): dQ, dK and dV are bitwise equal over four backward passes, under
    torch.use_deterministic_algorithms(True), which the unordered kernel refuses; in both launch directions (the
    causal mask's programs shortest list first, the bit mask's without the flag longest first)."""
    lens = (1500, 3000, 1700)
    seq = sum(lens)
    q, k, v = make_qkv(2, 8, 2, seq, seq, head_dim, torch.bfloat16, CUDA)
    grad_out = torch.randn(2, 8, seq, head_dim, device=CUDA, dtype=torch.bfloat16)
    config = ordered_config(head_dim)
    runs, outs = [], []
    with use_tuning(config):
        torch.use_deterministic_algorithms(True)
        try:
            for _ in range(4):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                outs.append(mbs_attention(*leaves, HUB, lens, causal=causal))
                outs[-1].backward(grad_out)
                runs.append([t.grad for t in leaves])
            with pytest.raises(RuntimeError, match="not deterministic"):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                mbs_attention(*leaves, HUB, lens, causal=causal, deterministic=False).backward(grad_out)
        finally:
            torch.use_deterministic_algorithms(False)
    assert writer_calls.ordered[:4] == [True] * 4 and len(writer_calls) >= 4
    assert writer_calls.shortest_first == [causal] * 4
    for run in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(first, again), f"{name} changed from run to run"
    check_outputs(q, k, v, outs[0], grad_out, reference_mask(HUB, lens, seq, causal=causal), grads=runs[0])


@pytest.mark.hopper
@pytest.mark.gpu
def test_a_pack_of_longer_samples_keeps_the_two_passes(writer_calls):
    """By default a pack of samples of over ordered_samples tokens on average runs the two passes, deterministic."""
    rows = [[300, 900, 100], [500, 700, 129]]
    seq = sum(map(sum, rows))
    q, k, v = make_qkv(1, 4, 2, seq, seq, 128, torch.bfloat16, CUDA)
    out = mbs_attention_varlen(q, k, v, HUB, rows, causal=True, deterministic=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert not writer_calls.ordered and set(writer_calls) == {"run_dkdv", "run_dq"}
    mask = torch.block_diag(*(reference_mask(HUB, r, sum(r), causal=True)[0] for r in rows))[None]
    check_outputs(q, k, v, out, grad_out, mask)


# Run in a child with a time limit: a wait in the kernel that never ends would hang the test run, not fail it.
_BESIDE_OTHER_STREAMS = """
import torch
from mmsparse import mbs_attention
from mmsparse.tuning import use_tuning
from tests.helpers import HUB, make_qkv, ordered_config

dev = torch.device("cuda")
lens = (1500, 3000, 1700)
seq = sum(lens)
q, k, v = make_qkv(2, 8, 2, seq, seq, 128, torch.bfloat16, dev)
grad_out = torch.randn(2, 8, seq, 128, device=dev, dtype=torch.bfloat16)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def other_work(stream):
    with torch.cuda.stream(stream):  # a few ms of matmuls whose programs take every multiprocessor
        for _ in range(4):
            a @ a


def grads(stream=None, when=None):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if when == "before":
        other_work(stream)
    with use_tuning(ordered_config(128)):
        out = mbs_attention(*leaves, HUB, lens, causal=True)
    if when == "between":
        other_work(stream)
    out.backward(grad_out)
    if when == "after":  # enqueued while the ordered kernel runs: a high priority stream takes freed SMs first
        other_work(stream)
    torch.cuda.synchronize()
    return [t.grad for t in leaves]


alone = grads()
for priority in (0, -1):  # the default, and the highest priority
    stream = torch.cuda.Stream(priority=priority)
    for when in ("before", "between", "after"):
        for name, first, again in zip(("dq", "dk", "dv"), alone, grads(stream, when)):
            assert torch.equal(first, again), (name, priority, when)
print("ok")
"""


@pytest.mark.hopper
@pytest.mark.gpu
def test_ordered_writer_beside_kernels_on_other_streams():
    """The ordered writer's programs wait for each other (mask.add_order ranks them for the programs a GPU holds at
    once). Matmuls on another stream, at the default and at the highest priority, enqueued before its forward,
    between its forward and backward, and while its backward runs, take multiprocessors it would hold: it still ends,
    with the bits of a run alone."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", _BESIDE_OTHER_STREAMS], capture_output=True, text=True, env=env,
                            timeout=240, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# In a child with a time limit, as above: the sections change which programs run side by side, which the waits'
# ranks must follow.
_HEAD_SECTIONS = """
import dataclasses

import torch
from mmsparse import mbs_attention, reference_mask
from mmsparse.attention import gluon_launch
from mmsparse.tuning import use_tuning
from tests.helpers import HUB, check_outputs, make_qkv, ordered_config

launched = []
real = gluon_launch.run_bwd_dq_writer


def spy(*args, **kwargs):
    launched.append((kwargs.get("order") is not None, kwargs.get("head_section", 1)))
    return real(*args, **kwargs)


gluon_launch.run_bwd_dq_writer = spy
dev = torch.device("cuda")
lens = (1500, 3000, 1700)
seq = sum(lens)
for head_dim, section, causal in ((128, 8, False), (128, 8, True), (64, 4, False), (128, 10, False)):
    # 2 samples x 3 KV heads in GQA groups of 2: sections of 8 query heads are 4 (batch, KV head)s and leave a last
    # one of 2, sections of 10 are 5 and leave one of 1; 49 key blocks a head: 294 programs, more than an H200
    # holds at once
    q, k, v = make_qkv(2, 6, 3, seq, seq, head_dim, torch.bfloat16, dev)
    grad_out = torch.randn(2, 6, seq, head_dim, device=dev, dtype=torch.bfloat16)
    config = dataclasses.replace(ordered_config(head_dim), ordered_head_section=section)
    runs = []
    launched.clear()
    with use_tuning(config):
        for _ in range(3):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = mbs_attention(*leaves, HUB, lens, causal=causal, deterministic=True)
            out.backward(grad_out)
            runs.append([t.grad for t in leaves])
    # launched shortest first (the causal flag) the programs go one head after the other
    assert launched == [(True, 1 if causal else section // 2)] * 3, launched
    for run in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(first, again), (name, head_dim, section, causal)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, seq, causal=causal), grads=runs[0])
    print(head_dim, section, causal, "ok", flush=True)
print("ok")
"""


@pytest.mark.hopper
@pytest.mark.gpu
def test_ordered_writer_in_head_sections():
    """``ordered_head_section``: the ordered writer's programs take each key block for 2, 4 or 5 (batch, KV head)s
    in turn (sections of 4, 8 or 10 query heads in GQA groups of 2; the last section shorter) where launched
    longest list first, and one head after the other where the causal flag launches them shortest first: it ends,
    repeats its bits over three backward passes and matches float64."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", _HEAD_SECTIONS], capture_output=True, text=True, env=env,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout + result.stderr)[-3000:]
