"""The one-pass backward (``deterministic=False``): the dK/dV kernel adds dQ by atomics. Output and all three
gradients against the float64 reference over the cases the two-pass backward covers; the default stays the two-pass
backward; the two backwards agree within float32 accumulation; bad values are TypeErrors."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mmsparse import (
    CAUSAL,
    FULL,
    NONE,
    TritonMBSAttnKernel,
    clear_caches,
    mbs_attention,
    mbs_attention_varlen,
    reference_mask,
    reference_packed_mask,
    use_config,
)
from mmsparse.attention import backward
from mmsparse.attention.config import (
    KernelConfig,
    Tile,
    cuda_kernel_config,
    default_deterministic,
    kernel_config,
)
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from mmsparse.attention.kernel_args import list_tiles
from mmsparse.attention.plan import BackwardPass, call_plan_from_text, plan_attention, plan_call
from mmsparse.kernels.constants import MASK_BITS
from mmsparse.nn import MultiheadMBSAttention, MultimodalSelfAttention, replace_attention
from mmsparse.tuning import use_tuning
from tests.helpers import CYCLIC, FOUR, HUB, RING, check_outputs, forward_backward, make_qkv

PAIR_TYPES = [[CAUSAL, FULL, NONE], [FULL, CAUSAL, NONE], [CAUSAL, NONE, FULL]]

# name: (topology, seg_lens (or per-sample rows), causal, batch, heads, kv_heads, seq_q, head_dim, dtype, extra)
CASES = {
    "gqa-causal-D24": (HUB, (9, 21, 20), True, 1, 4, 2, None, 24, torch.float32, {}),
    "full-tiles": (HUB, (48, 30, 26), False, 1, 2, 1, None, 16, torch.float32, {}),  # the unmasked tile helper
    "mqa-D40-fp16": (CYCLIC, (13, 30, 22), False, 2, 3, 1, None, 40, torch.float16, {}),
    "window-bf16": (RING, (17, 25, 19), True, 1, 2, 1, None, 16, torch.bfloat16, {"window": 9}),
    "pair-types": (PAIR_TYPES, (12, 0, 31), False, 1, 2, 2, None, 32, torch.float32, {}),
    "pair-types-window": (PAIR_TYPES, (20, 15, 26), True, 1, 4, 2, None, 24, torch.float16, {"window": 12}),
    "silent-segment": (FOUR, (11, 14, 23, 9), False, 1, 2, 2, None, 16, torch.float32, {}),
    "per-sample-lens": (HUB, [(10, 20, 5), (30, 0, 12)], True, 2, 2, 1, None, 16, torch.float32, {}),
    "decode-shaped": (CYCLIC, (20, 25, 26), False, 1, 4, 2, 7, 40, torch.float32, {}),
    "fewer-queries": (HUB, (20, 25, 26), True, 2, 2, 2, 37, 16, torch.bfloat16, {}),
    "q-start": ([[CAUSAL, FULL], [NONE, CAUSAL]], [(10, 20), (33, 0)], False, 2, 2, 1, 7, 16, torch.float32,
                {"q_start": [5, 20]}),
}


def _case_id(name: str) -> str:
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, extra = CASES[name]
    seq = sum(lens) if isinstance(lens[0], int) else max(map(sum, lens))
    extras = "".join(f"-{k}{v}" for k, v in extra.items() if k == "window")
    return (f"{name}-B{batch}-H{heads}x{kv_heads}-Sq{seq_q or seq}-S{seq}-D{head_dim}-{str(dtype)[6:]}"
            f"{'-causal' if causal else ''}{extras}")


@pytest.mark.parametrize("name", list(CASES), ids=_case_id)
def test_one_pass_matches_reference(name, device):
    """Fresh inputs, the mask built inside the call; out, dq, dk, dv against float64."""
    topo, lens, causal, batch, heads, kv_heads, seq_q, head_dim, dtype, extra = CASES[name]
    seq = sum(lens) if isinstance(lens[0], int) else max(map(sum, lens))
    seq_q = seq if seq_q is None else seq_q
    gen = torch.Generator().manual_seed(len(name))
    q, k, v = make_qkv(batch, heads, kv_heads, seq_q, seq, head_dim, dtype, device, gen)
    out = mbs_attention(q, k, v, topo, lens, causal=causal, **extra, deterministic=False)
    grad_out = torch.randn(out.shape, generator=gen).to(device, dtype)
    out.backward(grad_out)
    mask = reference_mask(topo, lens, seq, seq_q, causal, extra.get("q_start"), window=extra.get("window"))
    check_outputs(q, k, v, out, grad_out, mask)


@pytest.mark.parametrize("kind", ["bits", "dense"])
def test_one_pass_dense_and_bit_masks_match_reference(kind, device):
    """The same random per-sample mask as a user's bool mask ([B, S, S]) and, for the bit kind, a 0/1 topology."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(2, 2, 1, 45, 45, 24, torch.float32, device, gen)
    if kind == "dense":
        mask = torch.rand(2, 45, 45, generator=gen) < 0.4
        out = mbs_attention(q, k, v, attn_mask=mask.to(device), deterministic=False)
    else:
        mask = reference_mask(CYCLIC, (8, 20, 17), 45)
        out = mbs_attention(q, k, v, CYCLIC, (8, 20, 17), deterministic=False)
    grad_out = torch.randn(out.shape, generator=gen).to(device)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, mask)


def test_one_pass_pack_matches_reference(device):
    """A pack of samples (mbs_attention_varlen: packed varlen lists, per-sample key blocks): samples never see each
    other, zero-length segments."""
    rng = random.Random(7)
    topo = [[CAUSAL, NONE, NONE], [FULL, FULL, NONE], [FULL, FULL, CAUSAL]]
    lens = [[rng.randint(1, 9), rng.choice((0, 4, 9)), rng.choice((0, 3))] for _ in range(8)]
    total = sum(map(sum, lens))
    q, k, v = make_qkv(1, 4, 2, total, total, 16, torch.float16, device, torch.Generator().manual_seed(8))
    out = mbs_attention_varlen(q, k, v, topo, lens, causal=True, deterministic=False)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_packed_mask(topo, lens, causal=True))


def test_one_pass_dropout_uses_the_forwards_mask(device):
    """Dropout with the same seed: both backwards see the forward's keep mask (float64 reference with that mask),
    and their outputs are the same tensor."""
    p, lens = 0.3, (9, 30, 21)
    q, k, v = make_qkv(2, 4, 2, 60, 60, 32, torch.float32, device, torch.Generator().manual_seed(5))
    grad_out = torch.randn(2, 4, 60, 32, generator=torch.Generator().manual_seed(6)).to(device)
    keep = None
    results = {}
    for deterministic in (True, False):
        torch.manual_seed(1234)
        results[deterministic] = forward_backward(q, k, v, grad_out, topology=CYCLIC, seg_lens=lens, causal=True,
                                                   dropout_p=p, deterministic=deterministic)
        torch.manual_seed(1234)
        keep = dropout_keep_mask(new_dropout_seed(q.device), 2, 4, 60, 60, p)
    assert torch.equal(results[True][0], results[False][0])
    mask = reference_mask(CYCLIC, lens, 60, causal=True)
    out, dq, dk, dv = results[False]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    for leaf, grad in zip(leaves, (dq, dk, dv)):
        leaf.grad = grad
    check_outputs(*leaves, out, grad_out, mask, dropout_keep=keep, dropout_p=p)


class _Launches:
    """A launcher that records whether each launch ran the one-pass variant, then launches."""

    def __init__(self, name: str, kernel, log: list) -> None:
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, kwargs.get("ONE_PASS", False)))
            return launch(*args, **kwargs)

        return run

    def bind(self, grid, args, kwargs, boxes=()):
        """As FastKernel.bind, each launch and relaunch recorded."""
        one_pass = kwargs.get("ONE_PASS", False)
        self.log.append((self.name, one_pass))
        relaunch = self.kernel.bind(grid, args, kwargs, boxes)
        if relaunch is None:
            return None

        def recorded(*new_args):
            self.log.append((self.name, one_pass))
            relaunch(*new_args)

        return recorded


@pytest.fixture
def launches(monkeypatch):
    """The dK/dV and dQ launches of the test, in order. The launch plans kept from earlier tests go first: on a GPU a
    kept backward relaunches its kernels without going through ``_DKDV`` and ``_DQ``, so a call shaped like one
    before the spy would go unrecorded."""
    clear_caches()
    log: list = []
    monkeypatch.setattr(backward, "_DKDV", _Launches("dkdv", backward._DKDV, log))
    monkeypatch.setattr(backward, "_DQ", _Launches("dq", backward._DQ, log))
    return log


def _backward_once(device, **kw):
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, device, torch.Generator().manual_seed(2))
    out = mbs_attention(q, k, v, HUB, (10, 18, 12), **kw)
    out.backward(torch.ones_like(out))


def test_default_is_the_two_pass_backward_and_argument_wins(launches, device):
    assert default_deterministic() is True
    _backward_once(device)
    assert launches == [("dq", False), ("dkdv", False)]
    launches.clear()
    _backward_once(device, deterministic=False)
    assert launches == [("dkdv", True)]
    launches.clear()
    with use_config(deterministic=False):
        assert default_deterministic() is False
        _backward_once(device)
        assert launches == [("dkdv", True)]
        launches.clear()
        _backward_once(device, deterministic=True)  # the argument wins over the setting
        assert launches == [("dq", False), ("dkdv", False)]
        launches.clear()
        with use_config(deterministic=None):  # None keeps the enclosing setting
            assert default_deterministic() is False
    assert default_deterministic() is True


def test_from_one_pass_max_keys_keys_the_call_keeps_two_passes(launches, device):
    """deterministic=False allows the one pass; at one_pass_max_keys keys or more (40 here) the plan keeps the two
    passes, measured faster there."""
    with use_tuning(one_pass_max_keys=40):
        _backward_once(device, deterministic=False)
        assert launches == [("dq", False), ("dkdv", False)]
        launches.clear()
    with use_tuning(one_pass_max_keys=41):
        _backward_once(device, deterministic=False)
        assert launches == [("dkdv", True)]


def test_setting_is_read_when_the_forward_runs(launches, device):
    """A forward inside use_config(deterministic=False) keeps the one-pass backward after the block ends."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, device)
    with use_config(deterministic=False):
        out = mbs_attention(q, k, v, HUB, (10, 18, 12))
    out.backward(torch.ones_like(out))
    assert launches == [("dkdv", True)]


def test_module_argument_reaches_the_backward(launches, device):
    attn = TritonMBSAttnKernel(HUB, (10, 18, 12), deterministic=False)
    assert "deterministic=False" in repr(attn)
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, device)
    attn(q, k, v).sum().backward()
    assert launches == [("dkdv", True)]
    launches.clear()
    layer = MultimodalSelfAttention(32, 2, HUB, (10, 18, 12), num_kv_heads=1, deterministic=False).to(device)
    layer(torch.randn(1, 40, 32, device=device)).sum().backward()
    assert launches == [("dkdv", True)]


def test_default_backward_is_bitwise_repeatable(device):
    q, k, v = make_qkv(2, 4, 2, 50, 50, 24, torch.bfloat16, device, torch.Generator().manual_seed(9))
    grad_out = torch.randn(2, 4, 50, 24, generator=torch.Generator().manual_seed(10)).to(device, torch.bfloat16)
    runs = [forward_backward(q, k, v, grad_out, topology=PAIR_TYPES, seg_lens=(14, 20, 16), causal=True)
            for _ in range(2)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_one_pass_agrees_with_two_passes(dtype, device):
    """The same numbers up to the order of float32 adds: dS is rounded to the input dtype the same way in both,
    so dQ differs by float32 accumulation only, and dK, dV by nothing but the kernel's schedule."""
    q, k, v = make_qkv(2, 4, 2, 70, 70, 40, dtype, device, torch.Generator().manual_seed(11))
    grad_out = torch.randn(2, 4, 70, 40, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    kw = dict(topology=HUB, seg_lens=(15, 33, 22), causal=True)
    two = forward_backward(q, k, v, grad_out, deterministic=True, **kw)
    one = forward_backward(q, k, v, grad_out, deterministic=False, **kw)
    assert torch.equal(two[0], one[0])  # the forward is the same
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[dtype]  # one unit in the stored dtype's last place
    for name, a, b in zip(("dq", "dk", "dv"), two[1:], one[1:]):
        a, b = a.double(), b.double()
        scale = a.abs().max().item()
        # float32 sums of at most 70 terms: 1e-5 relative to the largest gradient; and two float32 sums that close
        # may still round to neighbouring values of the stored dtype
        tol = 1e-5 * scale + ulp * torch.maximum(a.abs(), b.abs())
        assert ((a - b).abs() <= tol).all(), f"{name}: max diff {(a - b).abs().max().item():.3e} (scale {scale:.3e})"


# (topology, seg_lens, causal, window): a hub with the causal flag; a segment that sees nothing (its rows' lse is
# -inf, their P must still be 0) with a window
P_FORM_MASKS = {"hub-causal": (HUB, (15, 33, 22), True, None), "silent-window": (FOUR, (15, 20, 22, 13), False, 9)}


@pytest.mark.parametrize("mask", P_FORM_MASKS)
@pytest.mark.parametrize("lse_first", [False, True], ids=["fma", "lse-in-scores"])
def test_tl_dq_pass_computes_p_either_way(lse_first, mask, monkeypatch, device):
    """The tl dQ pass computes P as the dK/dV pass beside it does (``backward.dq_pass_lse_first``): with -lse / scale
    as S's initial value beside the Gluon dK/dV kernel (forced here, where the CPU has none), else exp2(S scale -
    lse). Out and all three gradients against float64 in bf16, with partial blocks, rows past a block's end, rows
    that see nothing and GQA."""
    monkeypatch.setattr(backward, "dq_pass_lse_first", lambda *args: lse_first)
    launched = []
    made = backward.BackwardLaunch.__init__

    def spy(self, *args, **kwargs):
        made(self, *args, **kwargs)
        launched.append(self.dq_constexprs["LSE_FIRST"] if hasattr(self, "dq_constexprs") else "gluon dq")

    monkeypatch.setattr(backward.BackwardLaunch, "__init__", spy)
    clear_caches()  # launches made before were made without the patch
    topology, lens, causal, window = P_FORM_MASKS[mask]
    seq = sum(lens)
    q, k, v = make_qkv(2, 4, 2, seq, seq, 40, torch.bfloat16, device, torch.Generator().manual_seed(21))
    grad_out = torch.randn(2, 4, seq, 40, generator=torch.Generator().manual_seed(22)).to(device, torch.bfloat16)
    out = mbs_attention(q, k, v, topology, lens, causal=causal, window=window)
    out.backward(grad_out)
    assert launched == [lse_first]
    check_outputs(q, k, v, out.detach(), grad_out, reference_mask(topology, lens, seq, causal=causal, window=window))


def test_plan_of_the_one_pass_backward(device):
    cfg = kernel_config(32, torch.float32, device)
    plan = plan_attention(cfg, 2, 4, 2, 60, 60, device, None, False, deterministic=False)
    assert plan.dq is None and plan.dkdv.one_pass and not plan.dkdv.gluon and not plan.side_stream
    assert plan.kernels() == {"forward": "tl", "dq": "one-pass", "dkdv": "tl"}
    tile = cfg.one_pass_tile()
    assert plan.list_tiles(forward=False) == [(tile.block_m, tile.block_n, True)]
    assert list_tiles(cfg, 60, 60, deterministic=False)[1:] == plan.list_tiles(forward=False)
    two = plan_attention(cfg, 2, 4, 2, 60, 60, device, None, False)
    assert not two.dkdv.one_pass and two.dq is not None


def test_one_pass_without_the_dq_writer_is_the_tl_kernel():
    """Where the dK/dV pass is the Gluon kernel (D=64, D=128) but the dQ writer is off, the one-pass backward is the
    tl kernel at the tl dK/dV tile (dQ by atomics), planned below one_pass_max_keys keys (use_tuning moves it); from
    there deterministic=False keeps the two Gluon passes. With dropout it is the tl kernel too. The Gluon dK/dV
    kernel has no one-pass variant: the dQ writer is the one pass's only Gluon kernel."""
    for head_dim in (64, 128):
        cfg = cuda_kernel_config(head_dim, torch.bfloat16, gluon_dq_writer=False)
        assert cfg.bwd_dkdv.gluon and not cfg.one_pass_runs_dq_writer()
        tl_tile = cfg.one_pass_tile()
        assert not tl_tile.gluon and tl_tile == cuda_kernel_config(head_dim, torch.bfloat16, gluon=False).bwd_dkdv
        assert cfg.one_pass_kernel_tile() == tl_tile == cfg.one_pass_kernel_tile(dropout=True)
        limit = cfg.one_pass_max_keys

        def plan(config, seq, dropout=False):
            return plan_attention(config, 4, 16, 4, seq, seq, torch.device("cpu"), None, dropout, sms=132,
                                  deterministic=False)

        for dropout in (False, True):
            short = plan(cfg, limit - 1, dropout)
            assert short.dq is None and short.dkdv.one_pass and not short.dkdv.gluon and short.dkdv.tile == tl_tile
            assert short.kernels() == {"forward": "tl", "dq": "one-pass", "dkdv": "tl"}
            assert short.list_tiles(forward=False) == [(tl_tile.block_m, tl_tile.block_n, True)]
        long = plan(cfg, limit)
        assert long.dq is not None and long.kernels() == {"forward": "gluon", "dq": "gluon", "dkdv": "gluon"}
        # The lists prepare() builds ahead (e.g. before CUDA-graph capture) are those the planned passes read.
        assert list_tiles(cfg, limit - 1, limit - 1, deterministic=False)[1:] == plan(cfg, limit - 1).list_tiles(
            forward=False)
        assert list_tiles(cfg, limit, limit, deterministic=False)[1:] == long.list_tiles(forward=False)
        forced = plan(dataclasses.replace(cfg, one_pass_max_keys=limit + 1), limit)
        assert forced.dq is None and not forced.dkdv.gluon and forced.dkdv.tile == tl_tile
        with use_tuning(cfg, one_pass_max_keys=1 << 62):  # as tools/one_pass.py forces it at every length
            forced = plan(kernel_config(head_dim, torch.bfloat16, torch.device("cpu")), 1 << 16)
        assert forced.dq is None and not forced.dkdv.gluon
    own = KernelConfig(fwd=Tile(32, 16), bwd_dkdv=Tile(16, 32), bwd_dq=Tile(32, 16), decode=Tile(16, 16),
                       bwd_one_pass=Tile(32, 16))
    assert own.one_pass_tile() == Tile(32, 16)


def test_a_gluon_one_pass_is_the_dq_writer():
    """The Gluon dK/dV kernel's one-pass variant (dQ by TMA bulk reduce-adds) is gone: its config field is an
    unknown keyword, and a plan (or a plan's text from another release, as a traced graph holds it) with a Gluon one
    pass that is not the dQ writer is refused rather than run by a kernel that would add no dQ."""
    cfg = cuda_kernel_config(128, torch.bfloat16)
    with pytest.raises(TypeError, match="gluon_one_pass"):
        dataclasses.replace(cfg, gluon_one_pass=cfg.bwd_dkdv)
    with pytest.raises(ValueError, match="Gluon dQ-writer kernel or the tl kernel"):
        BackwardPass(cfg.bwd_dkdv, True, True, one_pass=True)
    with pytest.raises(ValueError, match="Gluon dQ-writer kernel or the tl kernel"):
        BackwardPass(cfg.one_pass_tile(), False, True, one_pass=True, dq_writer=True)
    with pytest.raises(ValueError, match="dq_writer needs one_pass"):
        BackwardPass(cfg.gluon_dq_writer, True, True, dq_writer=True)
    plan = plan_call(cfg, 1000, 1000, torch.device("cpu"), None, False, False, MASK_BITS, False, None, 3)
    assert plan.dkdv.dq_writer and call_plan_from_text(plan.text) == plan
    stale = plan.text.replace('"dq_writer":true', '"dq_writer":false')
    assert stale != plan.text
    with pytest.raises(ValueError, match="not the text of an mmsparse call plan.*dQ-writer kernel or the tl kernel"):
        call_plan_from_text(stale)


def test_one_pass_at_its_own_tile_matches_reference(device):
    """A one-pass tile other than the dK/dV pass's (its own block lists)."""
    cfg = KernelConfig(fwd=Tile(32, 16), bwd_dkdv=Tile(16, 32), bwd_dq=Tile(32, 16), decode=Tile(16, 16),
                       bwd_one_pass=Tile(32, 16))
    q, k, v = make_qkv(1, 2, 2, 50, 50, 16, torch.float32, device)
    with use_tuning(cfg):
        out = mbs_attention(q, k, v, PAIR_TYPES, (11, 22, 17), deterministic=False)
    grad_out = torch.randn_like(out)
    with use_tuning(cfg):
        out.backward(grad_out)
    check_outputs(q, k, v, out, grad_out, reference_mask(PAIR_TYPES, (11, 22, 17), 50))


@pytest.mark.parametrize("value", ["yes", 2, 0.5, [False]], ids=repr)
def test_bad_deterministic_values_are_type_errors(value, device):
    q, k, v = make_qkv(1, 1, 1, 20, 20, 16, torch.float32, device)
    with pytest.raises(TypeError, match="deterministic must be True"):
        mbs_attention(q, k, v, HUB, (5, 10, 5), deterministic=value)
    with pytest.raises(TypeError, match="deterministic must be True"):
        mbs_attention_varlen(q, k, v, HUB, [(5, 10, 5)], deterministic=value)
    with pytest.raises(TypeError, match="deterministic must be True"):
        TritonMBSAttnKernel(HUB, (5, 10, 5), deterministic=value)
    with pytest.raises(TypeError, match="deterministic must be True"):
        MultimodalSelfAttention(32, 2, HUB, (5, 10, 5), deterministic=value)
    mha = torch.nn.MultiheadAttention(32, 2, batch_first=True)
    with pytest.raises(TypeError, match="deterministic must be True"):
        MultiheadMBSAttention(mha, HUB, (5, 10, 5), deterministic=value)
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(32, 2))
    with pytest.raises(TypeError, match="deterministic must be True"):
        replace_attention(model, HUB, (5, 10, 5), deterministic=value)
    assert isinstance(model[0], torch.nn.MultiheadAttention)  # nothing replaced
    with pytest.raises(TypeError, match=r"use_config\(deterministic=...\) must be True, False or None"):
        with use_config(deterministic=value):
            pass
    assert default_deterministic() is True


def test_torch_deterministic_mode_refuses_the_one_pass_backward(device):
    """As torch's ops without a deterministic kernel: an error under use_deterministic_algorithms(True), a warning
    with warn_only; the default backward runs under either."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, device)
    mbs_attention(q, k, v, HUB, (10, 18, 12))  # the mask is built and cached outside the mode: only kernels run in it
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        mbs_attention(q, k, v, HUB, (10, 18, 12)).sum().backward()
        out = mbs_attention(q, k, v, HUB, (10, 18, 12), deterministic=False)
        with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
            out.sum().backward()
        torch.use_deterministic_algorithms(True, warn_only=True)
        out = mbs_attention(q, k, v, HUB, (10, 18, 12), deterministic=False)
        with pytest.warns(UserWarning, match="not deterministic"):
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
