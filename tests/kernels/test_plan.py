"""Plan, then launch: the plan decides each pass's kernel and tiles without building anything; the mask builds the
lists the plan names before any launch; the launchers only read them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import CAUSAL
from mmsparse.attention.call import mbs_attn_bwd, mbs_attn_fwd
from mmsparse.attention.config import KernelConfig, Tile, cuda_kernel_config, kernel_config, use_config, use_tuning
from mmsparse.attention.kernel_args import kernel_args, list_tiles, prepare
from mmsparse.attention.plan import plan_attention
from mmsparse.mask import info as mask_info
from mmsparse.mask.build import build_mask_info
from tests.helpers import HUB, make_qkv

PAIR_TYPES = [[CAUSAL, 1, 0], [0, CAUSAL, 1], [1, 0, 1]]


@pytest.fixture
def list_builds(monkeypatch):
    """Counts the block-list builds of every kind of mask."""
    builds = []
    for name in ("build_block_lists", "build_segment_lists", "lists_from_classes"):
        real = getattr(mask_info, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            builds.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mask_info, name, counted)
    return builds


def _mask(kind: str, device: torch.device, seq: int):
    if kind == "dense":
        dense = torch.rand(1, seq, seq, generator=torch.Generator().manual_seed(0)) < 0.5
        return mask_info.MaskInfo.from_dense(dense.to(device), False)
    topology = HUB if kind == "bits" else PAIR_TYPES
    return build_mask_info(topology, torch.tensor([9, 30, seq - 39], device=device), seq, seq, False, device)


def test_planning_builds_nothing(list_builds, device):
    cfg = kernel_config(32, torch.float32, device)
    plan = plan_attention(cfg, 2, 4, 2, 60, 60, device, None, False)
    assert not list_builds
    assert plan.forward.lists == (cfg.fwd.block_m, cfg.fwd.block_n, False)
    assert plan.dkdv.lists == (cfg.bwd_dkdv.block_m, cfg.bwd_dkdv.block_n, True)
    assert plan.list_tiles(forward=False) == [plan.dkdv.lists, plan.dq.lists]
    assert plan.kernels() == {"forward": "tl", "dq": "tl", "dkdv": "tl"}
    assert plan_attention(cfg, 2, 4, 2, 60, 60, device, None, False) is plan  # kept: calls are host-bound


def test_plan_names_the_gluon_passes_and_dropout_turns_them_off(device):
    gluon = Tile(128, 128, gluon_stages=2)
    cfg = KernelConfig(fwd=gluon, bwd_dkdv=Tile(64, 128, gluon_stages=4), bwd_dq=Tile(128, 64, gluon_stages=3),
                       decode=Tile(16, 64))
    many_rows = 4096  # enough programs that the key lists are not split
    plan = plan_attention(cfg, 8, 16, 4, many_rows, many_rows, device, None, False)
    assert plan.kernels() == {"forward": "gluon", "dq": "gluon", "dkdv": "gluon"}
    dropped = plan_attention(cfg, 8, 16, 4, many_rows, many_rows, device, None, True)
    assert dropped.kernels() == {"forward": "tl", "dq": "tl", "dkdv": "tl"}
    assert dropped.list_tiles() == plan.list_tiles()  # the tl kernels run the same tiles


def test_decode_packs_gqa_rows_and_splits_keys(device):
    cfg = kernel_config(32, torch.float32, device)
    plan = plan_attention(cfg, 1, 8, 2, 1, 4000, device, None, False)
    assert plan.forward.pack_rows > 0 and plan.forward.bh_programs == 2
    assert plan.forward.n_splits > 1 and plan.kernels()["forward"] == "tl-split"


@pytest.mark.parametrize("kind", ["bits", "codes", "dense"])
def test_launches_of_prepared_lists_build_nothing(kind, list_builds, device):
    seq = 70
    info = _mask(kind, device, seq)
    q, k, v = make_qkv(1, 2, 1, seq, seq, 16, torch.float32, device)
    cfg = kernel_config(16, torch.float32, device)
    plan = plan_attention(cfg, 1, 2, 1, seq, seq, device, info.sample_len, False)
    info.prepare(plan.list_tiles())
    built = len(list_builds)
    assert built > 0
    with torch.no_grad():
        out, lse = mbs_attn_fwd(q, k, v, info, 0.25)
        mbs_attn_bwd(torch.ones_like(out), q, k, v, out, lse, info, 0.25)
    assert len(list_builds) == built, list_builds[built:]


def test_unprepared_lists_are_an_error_not_a_lazy_build(device):
    info = _mask("bits", device, 50)
    with pytest.raises(RuntimeError, match="were not built before the launch"):
        kernel_args(info).tile(16, 16)


def test_a_call_prepares_then_launches(list_builds, device):
    """Through the public path the forward prepares its own lists, the backward the two passes' lists, all before
    their launches (a new config: no cached plan or mask)."""
    seq = 64
    with use_tuning(KernelConfig(fwd=Tile(32, 16), bwd_dkdv=Tile(16, 32), bwd_dq=Tile(32, 16), decode=Tile(16, 16))):
        info = _mask("codes", device, seq)
        q, k, v = make_qkv(1, 2, 1, seq, seq, 16, torch.float32, device)
        out, lse = mbs_attn_fwd(q, k, v, info, 0.25)
        assert len(list_builds) == 1
        mbs_attn_bwd(torch.ones_like(out), q, k, v, out, lse, info, 0.25)
        assert len(list_builds) == 2  # dK/dV's lists by key; dQ reads the forward's tile, built already


def test_thresholds_live_in_the_config(device):
    """The thresholds that switch a path are fields of the config; ``use_config`` sets them on every call's config,
    nested with fixed tiles, and a name it does not know is a TypeError."""
    base = kernel_config(32, torch.float32, device)
    assert (base.decode_max_q, base.short_keys, base.short_samples) == (16, 2048, 4096)
    with use_tuning(short_keys=0, decode_max_q=4):
        cfg = kernel_config(32, torch.float32, device)
        assert (cfg.short_keys, cfg.decode_max_q) == (0, 4) and cfg is kernel_config(32, torch.float32, device)
        assert not cfg.few_keys(1)
        assert plan_attention(cfg, 1, 8, 2, 5, 100, device).forward.tile == cfg.fwd  # 5 queries: not decoding now
        tiles = KernelConfig(fwd=Tile(32, 16), bwd_dkdv=Tile(16, 32), bwd_dq=Tile(32, 16), decode=Tile(16, 16))
        with use_tuning(tiles):
            assert kernel_config(32, torch.float32, device).short_keys == 0
    assert kernel_config(32, torch.float32, device) == base
    with pytest.raises(TypeError, match="short_keys"):
        with use_tuning(short_key=0):
            pass


@pytest.mark.parametrize("value", ["ordered_one_pass", "two_pass"])
def test_the_removed_deterministic_backward_setting_says_what_to_use(value, device):
    """``use_config(deterministic_backward=...)`` chose the ordered one-pass backward, now gone: a TypeError that
    says so and names ``deterministic=True`` (a bitwise repeatable backward), whatever the value; nothing
    of the block runs and the thread's settings stay as they were. The config has no such field either."""
    before = kernel_config(32, torch.float32, device)
    ran = False
    with pytest.raises(TypeError, match=r"deterministic_backward=.*removed.*deterministic=True.*bitwise-repeatable"):
        with use_config(deterministic_backward=value, short_keys=0):
            ran = True
    assert not ran and kernel_config(32, torch.float32, device) is before
    with pytest.raises(TypeError, match="deterministic_backward"):
        replace(before, deterministic_backward=value)
    assert not hasattr(KernelConfig, "deterministic_backward")


@pytest.mark.parametrize("field", ["bwd_dkdv", "bwd_dq", "bwd_dq_short", "bwd_one_pass", "gluon_dq_writer"])
def test_a_backward_tile_with_pingpong_is_refused_when_the_config_is_made(field):
    """Only the Gluon forward takes ping-pong turns: a backward tile asking for them is a ValueError naming the
    field, not a setting silently ignored; forward tiles keep it (the D=128 forward's table tile has it)."""
    base = cuda_kernel_config(128, torch.bfloat16)
    assert base.fwd.pingpong and base.fwd_short_samples.pingpong
    tile = getattr(base, field) or base.bwd_dq
    with pytest.raises(ValueError, match=rf"KernelConfig.{field} has pingpong=True.*only the Gluon forward"):
        replace(base, **{field: replace(tile, pingpong=True)})
    replace(base, decode=replace(base.decode, pingpong=True), fwd_short=replace(base.fwd, pingpong=False))


def test_an_unknown_turn_scheme_is_refused_when_the_tile_is_made():
    """A tile names how the Gluon forward's warpgroups take turns; a name the kernel does not know is a ValueError at
    ``Tile(...)`` (or ``replace``), listing the known ones, not at a launch. The one pass's dQ adds have no setting
    left (TMA bulk reduce-adds in the Gluon kernel, atomics in the tl one)."""
    assert Tile(128, 128, turns="named_release").turns == "named_release"
    with pytest.raises(ValueError, match=r"Tile.turns must be one of \['mbarrier', 'named_release'\]; got 'named'"):
        Tile(128, 128, turns="named")
    with pytest.raises(ValueError, match="got 'handoff'"):
        replace(Tile(128, 128), turns="handoff")
    with pytest.raises(TypeError, match="dq_adds"):
        Tile(64, 128, dq_adds="bulk")


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_prepared_lists_are_the_plans(dropout, deterministic):
    """kernel_args.list_tiles / prepare (ahead of timing or CUDA-graph capture) name exactly the lists the call's
    plan reads, dropout's tiles too: on Hopper the one-pass backward with dropout runs the tl kernel at
    bwd_one_pass, not the dQ writer at gluon_dq_writer."""
    cfg = cuda_kernel_config(128, torch.bfloat16)
    cpu = torch.device("cpu")
    plan = plan_attention(cfg, 2, 4, 2, 300, 300, cpu, None, dropout, deterministic=deterministic)
    assert list_tiles(cfg, 300, 300, None, deterministic, dropout) == plan.list_tiles()
    info = build_mask_info(HUB, (100, 120, 80), 300, 300, False, cpu)
    prepare(info, cfg, deterministic, dropout)
    for block_m, block_n, by_key in plan.list_tiles():
        info.built_lists(block_m, block_n, by_key)  # raises where a planned list was not built


@pytest.mark.parametrize("seq", [64, 925, 2047, 40000])
def test_deterministic_false_at_head_dim_256_runs_the_gluon_two_passes(seq):
    """On Hopper at head dims 129-256 the dK/dV pass is Gluon and has no one pass; the tl one pass ran 0.215x the
    two passes' speed on the seed (H200), so deterministic=False plans the two passes at every length there. A
    one_pass_max_keys threshold (what use_tuning(one_pass_max_keys=N) sets on the call's config) still brings the
    tl one pass back below it."""
    cfg = cuda_kernel_config(256, torch.bfloat16)
    cpu = torch.device("cpu")
    plan = plan_attention(cfg, 2, 8, 4, seq, seq, cpu, None, False, deterministic=False)
    assert plan.dq is not None and not plan.dkdv.one_pass
    assert (plan.dq.gluon, plan.dkdv.gluon) == (True, True)
    forced = plan_attention(replace(cfg, one_pass_max_keys=4096), 2, 8, 4, seq, seq, cpu, None, False,
                            deterministic=False)
    assert (forced.dq is None and forced.dkdv.one_pass and not forced.dkdv.gluon) == (seq < 4096)
