"""The Gluon forward and dQ pass at head dims 129-256 (``config.GLUON_D256``), beside
the tl dK/dV pass (``cuda_kernel_config(..., gluon_d256_dkdv=False)``), and with the Gluon dK/dV pass of those head
dims (``kernels/gluon/dkdv_d256.py``, the default): output and all three gradients against the float64 reference, dK
and dV against the tl dK/dV pass's, and which kernel ran each pass.

The kernels need an sm_90 GPU (``hopper``); the config's choices and the refusal of tiles a head dim cannot run are
checked everywhere (no kernel runs in those)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmsparse import mbs_attention, reference_mask
from mmsparse.attention.config import (
    GLUON_D256,
    GLUON_D256_DKDV_ENABLED,
    GLUON_D256_ENABLED,
    HOPPER,
    WIDE_DKDV_TILES,
    WIDE_ONE_PASS_TMA,
    Tile,
    cuda_kernel_config,
    gluon_tile_problem,
    use_tuning,
    wide_dkdv_tile,
)
from mmsparse.attention.dropout import dropout_keep_mask, new_dropout_seed
from mmsparse.attention.plan import plan_attention
from mmsparse.kernels.constants import COUNT_WORDS
from tests.helpers import (
    CYCLIC,
    FOUR,
    HUB,
    assert_close,
    check_against_reference,
    check_outputs,
    forward_backward,
    make_qkv,
    spy_on_gluon_launchers,
)

TEXT_IMAGE_TEXT = [[2, 0, 0], [1, 1, 0], [1, 1, 2]]  # Gemma 3: text causal, the image whole, both see the past
TL_DKDV_D256 = WIDE_DKDV_TILES[0][1]  # the tl table's dK/dV tile at D=256 on a Hopper GPU

# (topology, seg_lens (or per-sample), causal, window, batch, heads, kv_heads, seq_q or None, head_dim, dtype):
# bits and segment codes (pair types), causal, GQA, per-sample lengths, fewer queries than keys, a segment that
# sees nothing, a zero-length segment, a window, head dims 256, 192 and 136 (padded to 256), fp16 and bf16.
CASES = [
    (CYCLIC, (300, 1000, 777), False, None, 1, 4, 2, None, 256, torch.bfloat16),
    (HUB, (513, 2049, 1031), True, None, 1, 2, 2, None, 256, torch.float16),
    (TEXT_IMAGE_TEXT, (700, 256, 1100), False, None, 1, 4, 1, None, 256, torch.bfloat16),
    (HUB, [(100, 900, 300), (700, 200, 77)], False, None, 2, 2, 1, None, 192, torch.bfloat16),
    (CYCLIC, (500, 1200, 900), True, None, 1, 2, 1, 300, 136, torch.bfloat16),
    (FOUR, (999, 130, 700, 1100), False, None, 1, 2, 1, None, 256, torch.float16),
    (CYCLIC, (0, 2000, 600), True, None, 1, 2, 1, None, 256, torch.bfloat16),
    (TEXT_IMAGE_TEXT, (900, 512, 1400), False, 700, 1, 2, 1, None, 192, torch.float16),
]


def _case_id(case) -> str:
    topo, lens, causal, window, b, h, hk, sq, d, dtype = case
    return (f"k{len(topo)}-B{b}-H{h}x{hk}-Sq{sq}-D{d}-{str(dtype)[6:]}{'-causal' if causal else ''}"
            f"{'' if window is None else f'-W{window}'}-{lens}")


def d256_config(dtype: torch.dtype):
    """The D=256 candidate tiles (``cuda_kernel_config(..., gluon_d256=True)``), independent of the default table:
    the tl dK/dV pass."""
    return cuda_kernel_config(256, dtype, HOPPER, gluon=True, gluon_d256=True, gluon_d256_dkdv=False)


def d256_dkdv_config(dtype: torch.dtype):
    """:func:`d256_config` with the Gluon dK/dV pass at ``GLUON_D256["dkdv"]`` (``gluon_d256_dkdv=True``)."""
    return cuda_kernel_config(256, dtype, HOPPER, gluon=True, gluon_d256=True, gluon_d256_dkdv=True)


@pytest.fixture
def gluon_calls(monkeypatch):
    """Records which Gluon passes ran: only a spy on their launchers tells (the tl ones agree within tolerance).
    ``dkdv_d256`` is the dK/dV kernel of head dims 129-256."""
    return spy_on_gluon_launchers(monkeypatch, ("forward", "dkdv", "dkdv_d256", "dq"))


@pytest.mark.hopper  # tests/conftest.py skips it off sm_90 or without Gluon
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_forward_and_dq_against_float64(case, gluon_calls):
    topo, lens, causal, window, batch, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = max(sum(r) for r in lens) if isinstance(lens, list) else sum(lens)
    # Enough heads for 2 programs per SM: a smaller grid splits the key lists (the tl forward's job).
    programs = -(-(seq_q or seq_k) // 128) * batch * heads
    more = -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // programs)
    q, k, v = make_qkv(batch, heads * more, kv_heads * more, seq_q or seq_k, seq_k, head_dim, dtype,
                       torch.device("cuda"))
    with use_tuning(d256_config(dtype), short_keys=0):  # these lengths are short: the Gluon forward at any length
        check_against_reference(q, k, v, topo, lens, causal=causal, window=window)
    assert sorted(gluon_calls) == ["dq", "forward"]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gluon_dkdv_against_float64_and_the_tl_pass(case, gluon_calls):
    """With the D=256 Gluon dK/dV pass on: output and the three gradients against float64, then dK and dV against
    the tl dK/dV pass's on the same inputs (both round float32 sums to the input dtype, in other orders)."""
    topo, lens, causal, window, batch, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = max(sum(r) for r in lens) if isinstance(lens, list) else sum(lens)
    programs = -(-(seq_q or seq_k) // 128) * batch * heads
    more = -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // programs)
    q, k, v = make_qkv(batch, heads * more, kv_heads * more, seq_q or seq_k, seq_k, head_dim, dtype,
                       torch.device("cuda"))
    with use_tuning(d256_dkdv_config(dtype), short_keys=0):
        out, _ = check_against_reference(q, k, v, topo, lens, causal=causal, window=window)
    assert sorted(gluon_calls) == ["dkdv_d256", "dq", "forward"]
    grad_out = torch.randn_like(out)
    kw = dict(topology=topo, seg_lens=lens, causal=causal, window=window)
    with use_tuning(d256_dkdv_config(dtype), short_keys=0):
        gluon = forward_backward(q, k, v, grad_out, **kw)
    with use_tuning(d256_config(dtype), short_keys=0):
        tl = forward_backward(q, k, v, grad_out, **kw)
    for name, i in (("dk", 2), ("dv", 3)):
        assert_close(f"{name} against the tl dK/dV pass", gluon[i], tl[i], dtype)
    assert torch.equal(gluon[1], tl[1])  # the same dQ pass on both sides


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dkdv", [False, True], ids=["tl-dkdv", "gluon-dkdv"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_with_an_empty_row_and_column(causal, dkdv, gluon_calls):
    dev = torch.device("cuda")
    q, k, v = make_qkv(1, 64, 16, 1500, 1500, 256, torch.bfloat16, dev)
    mask = torch.rand(1500, 1500, device=dev) < 0.3
    mask[5] = False
    mask[:, 7] = False
    cfg = (d256_dkdv_config if dkdv else d256_config)(torch.bfloat16)
    with use_tuning(cfg, short_keys=0):
        out = mbs_attention(q, k, v, None, None, causal=causal, attn_mask=mask)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    want = mask & torch.ones_like(mask).tril() if causal else mask
    check_outputs(q, k, v, out, grad_out, want.cpu())
    assert sorted(gluon_calls) == (["dkdv_d256"] if dkdv else []) + ["dq", "forward"]
    assert not out[:, :, 5].any() and not q.grad[:, :, 5].any() and not k.grad[:, :, 7].any()
    assert not v.grad[:, :, 7].any()


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dkdv", [False, True], ids=["tl-dkdv", "gluon-dkdv"])
def test_dropout_and_small_grids_run_the_tl_kernels(dkdv, gluon_calls):
    """Dropout runs the tl forward at the candidate's tile (8 warps) and the tl dQ and dK/dV kernels at the tl
    table's tiles (``bwd_dq_dropout``, ``bwd_dkdv_dropout``); a grid too small to fill the GPU splits the forward's
    key lists (tl) while the backward passes stay Gluon."""
    dev = torch.device("cuda")
    lens = (300, 1000, 777)
    with use_tuning((d256_dkdv_config if dkdv else d256_config)(torch.bfloat16), short_keys=0):
        q, k, v = make_qkv(1, 2, 1, 2077, 2077, 256, torch.bfloat16, dev)
        check_against_reference(q, k, v, CYCLIC, lens)  # 17 x 2 programs: split
        assert sorted(gluon_calls) == (["dkdv_d256"] if dkdv else []) + ["dq"]
        gluon_calls.clear()
        q, k, v = make_qkv(1, 16, 4, 2077, 2077, 256, torch.bfloat16, dev)
        torch.manual_seed(7)
        out = mbs_attention(q, k, v, HUB, lens, dropout_p=0.2)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    torch.manual_seed(7)
    keep = dropout_keep_mask(new_dropout_seed(dev), 1, 16, 2077, 2077, 0.2)
    check_outputs(q, k, v, out, grad_out, reference_mask(HUB, lens, 2077), dropout_keep=keep, dropout_p=0.2)
    assert gluon_calls == []


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dkdv", [False, True], ids=["tl-dkdv", "gluon-dkdv"])
def test_default_thresholds_over_4k_keys(dkdv, gluon_calls):
    """At the candidate's own thresholds (no short_keys override) 4,100 keys take the Gluon forward and dQ pass (and
    the Gluon dK/dV pass where it is on), the dQ pass on its side stream beside dK/dV."""
    q, k, v = make_qkv(1, 16, 4, 4100, 4100, 256, torch.bfloat16, torch.device("cuda"))
    with use_tuning((d256_dkdv_config if dkdv else d256_config)(torch.bfloat16)):
        check_against_reference(q, k, v, TEXT_IMAGE_TEXT, (1800, 256, 2044))
    assert sorted(gluon_calls) == (["dkdv_d256"] if dkdv else []) + ["dq", "forward"]


@pytest.mark.hopper
@pytest.mark.gpu
def test_gluon_dkdv_is_deterministic_and_one_pass_stays_tl(gluon_calls):
    """The Gluon dK/dV pass has no atomics: two backwards give the same bits. deterministic=False runs the same two
    passes (the Gluon dK/dV kernel has no one pass, and the tl one ran 0.215x their speed); a one_pass_max_keys
    threshold brings back the tl one-pass backward at its own tile."""
    q, k, v = make_qkv(1, 16, 4, 3000, 3000, 256, torch.bfloat16, torch.device("cuda"))
    grad_out = torch.randn_like(q)
    kw = dict(topology=TEXT_IMAGE_TEXT, seg_lens=(1200, 256, 1544))

    def short_leaves():  # fresh leaves for each check: their .grad is compared with the reference's
        return (t.detach()[:, :, :1500].clone().requires_grad_() for t in (q, k, v))

    with use_tuning(d256_dkdv_config(torch.bfloat16), short_keys=0):
        first = forward_backward(q, k, v, grad_out, **kw)
        second = forward_backward(q, k, v, grad_out, **kw)
        assert gluon_calls.count("dkdv_d256") == 2
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        check_against_reference(*short_leaves(), TEXT_IMAGE_TEXT, (600, 256, 644), deterministic=False)
        assert gluon_calls.count("dkdv_d256") == 3
    gluon_calls.clear()
    with use_tuning(d256_dkdv_config(torch.bfloat16), short_keys=0, one_pass_max_keys=2048):
        check_against_reference(*short_leaves(), TEXT_IMAGE_TEXT, (600, 256, 644), deterministic=False)
    assert "dkdv_d256" not in gluon_calls


@pytest.mark.hopper
@pytest.mark.gpu
def test_gluon_dkdv_hand_over_gives_the_same_bits_over_many_runs(gluon_calls):
    """The dK/dV kernel's warpgroups hand P^T over in shared memory, ordered by mbarriers (compute-sanitizer's
    racecheck flags the pair of accesses, as it flags every warp-specialised kernel's dispatch words). A hand-over
    out of order would read another step's P^T now and then: 40 backwards of one input, GQA with a dense grid, give
    the same dK and dV bits each time."""
    q, k, v = make_qkv(2, 16, 4, 2100, 2100, 256, torch.bfloat16, torch.device("cuda"))
    grad_out = torch.randn_like(q)
    with use_tuning(d256_dkdv_config(torch.bfloat16), short_keys=0):
        out = mbs_attention(q, k, v, TEXT_IMAGE_TEXT, (900, 256, 944))
        first = torch.autograd.grad(out, (k, v), grad_out, retain_graph=True)
        for _ in range(39):
            again = torch.autograd.grad(out, (k, v), grad_out, retain_graph=True)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert gluon_calls.count("dkdv_d256") == 40


def test_candidate_config_runs_gluon_forward_and_dq_only():
    """Where the candidate applies (half precision, head dims 129-256), which kernel and tile each pass gets: the
    Gluon forward over SHORT_KEYS keys or more (the tl tile below), the Gluon dQ pass at every length, with
    ``gluon_d256_dkdv=False`` the tl dK/dV pass, and tl one-pass backwards; float32 never runs Gluon."""
    cuda = torch.device("cuda")  # planned, not run: no device is asked for
    tl_only = cuda_kernel_config(256, torch.bfloat16, HOPPER, gluon=True, gluon_d256=False)
    assert not (tl_only.fwd.gluon or tl_only.bwd_dq.gluon or tl_only.bwd_dkdv.gluon)
    assert cuda_kernel_config(256, torch.bfloat16).fwd.gluon == GLUON_D256_ENABLED
    for head_dim in (136, 192, 256):
        for dtype in (torch.bfloat16, torch.float16):
            cfg = cuda_kernel_config(head_dim, dtype, HOPPER, gluon=True, gluon_d256=True, gluon_d256_dkdv=False)
            assert cfg.fwd == GLUON_D256["fwd"] and cfg.bwd_dq == GLUON_D256["dq"]
            assert cfg.bwd_dkdv == TL_DKDV_D256 and cfg.gluon_dq_writer is None
            assert cfg.one_pass_tile() == WIDE_ONE_PASS_TMA
            assert not cfg.fwd_short.gluon and cfg.bwd_dq_short is None and cfg.fwd_short_samples is None
            long = plan_attention(cfg, 1, 16, 4, 16384, 16384, cuda, sms=132)
            assert long.kernels() == {"forward": "gluon", "dq": "gluon", "dkdv": "tl"}
            long.check_head_dim(head_dim, 2)
            short = plan_attention(cfg, 1, 16, 4, 1500, 1500, cuda, sms=132)
            assert short.kernels() == {"forward": "tl", "dq": "gluon", "dkdv": "tl"}
            one_pass = plan_attention(cfg, 1, 16, 4, 1500, 1500, cuda, sms=132, deterministic=False)
            assert one_pass.kernels() == {"forward": "tl", "dq": "one-pass", "dkdv": "tl"}
            dropout = plan_attention(cfg, 1, 16, 4, 16384, 16384, cuda, sms=132, dropout=True)
            assert dropout.kernels() == {"forward": "tl", "dq": "tl", "dkdv": "tl"}
    fp32 = cuda_kernel_config(256, torch.float32, HOPPER, gluon=True, gluon_d256=True)
    assert not (fp32.fwd.gluon or fp32.bwd_dq.gluon or fp32.bwd_dkdv.gluon)
    for kind in ("fwd", "dq"):
        tile = GLUON_D256[kind]
        assert tile.block_m == 128 and tile.gluon and gluon_tile_problem(kind, tile, 256) is None


def test_gluon_dkdv_switch_plans_the_d256_dkdv_kernel():
    """``gluon_d256_dkdv=True`` (the default: GLUON_D256_DKDV_ENABLED) gives the dK/dV pass its Gluon kernel at
    GLUON_D256["dkdv"] where the D=256 candidates apply, the tl one-pass backward and the tl dK/dV kernel with dropout
    the tl tile (``bwd_dkdv_dropout``); nothing changes at D=128, without gluon_d256, or in float32; False gives the
    tl pass."""
    cuda = torch.device("cuda")  # planned, not run
    assert GLUON_D256_DKDV_ENABLED
    assert cuda_kernel_config(256, torch.bfloat16) == cuda_kernel_config(256, torch.bfloat16, gluon_d256_dkdv=True)
    assert cuda_kernel_config(256, torch.bfloat16, gluon_d256_dkdv=False).bwd_dkdv == TL_DKDV_D256
    assert cuda_kernel_config(256, torch.bfloat16, HOPPER, gluon=True, gluon_d256=False,
                              gluon_d256_dkdv=True).bwd_dkdv == TL_DKDV_D256
    assert not cuda_kernel_config(256, torch.float32, HOPPER, gluon=True, gluon_d256=True,
                                  gluon_d256_dkdv=True).bwd_dkdv.gluon
    d128 = [cuda_kernel_config(128, torch.bfloat16, HOPPER, gluon=True, gluon_d256_dkdv=on) for on in (False, True)]
    assert d128[0] == d128[1]
    tile = GLUON_D256["dkdv"]
    assert (tile.block_m, tile.block_n, tile.gluon_stages, tile.pingpong) == (64, 64, 2, False)
    for head_dim in (136, 192, 256):
        for dtype in (torch.bfloat16, torch.float16):
            cfg = cuda_kernel_config(head_dim, dtype, HOPPER, gluon=True, gluon_d256=True, gluon_d256_dkdv=True)
            assert cfg.bwd_dkdv == tile and cfg.fwd == GLUON_D256["fwd"] and cfg.bwd_dq == GLUON_D256["dq"]
            assert cfg.gluon_dq_writer is None and cfg.one_pass_tile() == WIDE_ONE_PASS_TMA
            long = plan_attention(cfg, 1, 16, 4, 16384, 16384, cuda, sms=132)
            assert long.kernels() == {"forward": "gluon", "dq": "gluon", "dkdv": "gluon"}
            assert long.dkdv.tile == tile and (64, 64, True) in long.list_tiles()
            long.check_head_dim(head_dim, 2)
            # deterministic=False: the two passes (tests/kernels/test_plan.py), the tl one pass only below a
            # one_pass_max_keys threshold set by hand
            assert plan_attention(cfg, 1, 16, 4, 1500, 1500, cuda, sms=132, deterministic=False).kernels() == \
                {"forward": "tl", "dq": "gluon", "dkdv": "gluon"}
            one_pass = plan_attention(replace(cfg, one_pass_max_keys=2048), 1, 16, 4, 1500, 1500, cuda, sms=132,
                                      deterministic=False)
            assert one_pass.kernels() == {"forward": "tl", "dq": "one-pass", "dkdv": "tl"}
            assert one_pass.dkdv.tile == WIDE_ONE_PASS_TMA
            one_pass.check_head_dim(head_dim, 2)
            dropout = plan_attention(cfg, 1, 16, 4, 16384, 16384, cuda, sms=132, dropout=True)
            assert dropout.kernels() == {"forward": "tl", "dq": "tl", "dkdv": "tl"}
            assert dropout.dkdv.tile == TL_DKDV_D256 == cfg.bwd_dkdv_dropout and (64, 64, True) in dropout.list_tiles()
            tl_dq = cuda_kernel_config(head_dim, dtype, HOPPER, gluon=False).bwd_dq
            assert dropout.dq.tile == tl_dq == cfg.bwd_dq_dropout and (tl_dq.block_m, tl_dq.block_n, False) in \
                dropout.list_tiles()
            assert long.dq.tile == GLUON_D256["dq"]  # without dropout the Gluon dQ tile


def test_tl_dkdv_tile_past_d128_fits_the_gpus_shared_memory():
    """The tl dK/dV tile at head dims 129-256 is the largest whose shared memory the GPU's blocks take (bytes
    Triton allotted when compiled for sm_80, sm_89 and sm_90): 2 stages only through TMA, and the tl one pass
    on Hopper keeps its own tile (its dQ adds need more)."""
    hopper, a100, ada = 232_448, 166_912, 101_376
    big, one_stage, small = (tile for _, tile in WIDE_DKDV_TILES)
    assert (big.block_m, big.num_warps, big.num_stages) == (64, 8, 2)
    assert wide_dkdv_tile(hopper, tma=True) == big and wide_dkdv_tile(hopper, tma=False) == one_stage
    assert wide_dkdv_tile(a100, tma=False) == one_stage and wide_dkdv_tile(ada, tma=False) == small
    assert wide_dkdv_tile(160_000, tma=True) == small
    for capability, shared, tile in (((9, 0), None, big), ((8, 0), None, one_stage), ((8, 9), None, small),
                                     ((8, 6), None, small), ((9, 0), ada, small), ((8, 0), hopper, one_stage)):
        for head_dim in (136, 192, 256):
            cfg = cuda_kernel_config(head_dim, torch.bfloat16, capability, gluon=False, shared_bytes=shared)
            assert cfg.bwd_dkdv == tile, (capability, shared, head_dim)
            assert cfg.bwd_one_pass == (WIDE_ONE_PASS_TMA if cfg.use_tma else tile), (capability, shared)
    d128 = cuda_kernel_config(128, torch.bfloat16, (8, 9), gluon=False)
    assert d128.bwd_dkdv == cuda_kernel_config(128, torch.bfloat16, HOPPER, gluon=False).bwd_dkdv


def test_dkdv_tiles_are_checked_against_the_head_dim():
    """Each Gluon dK/dV kernel runs its own tiles only: 128 keys up to D=128, 64 keys and 64 query rows a step or
    more past it (2 stages of Q and dO within a CTA's shared memory at D=256)."""
    tile = GLUON_D256["dkdv"]
    assert gluon_tile_problem("dkdv", tile, 256) is None
    assert gluon_tile_problem("dkdv", tile, 128) is not None  # the D <= 128 kernel takes 128 keys
    assert gluon_tile_problem("dkdv", tile, 256, itemsize=4) is not None  # float32: twice the shared memory
    assert gluon_tile_problem("dkdv", replace(tile, gluon_stages=3), 256) is not None  # shared memory
    assert gluon_tile_problem("dkdv", replace(tile, block_m=128), 256) is not None
    assert gluon_tile_problem("dkdv", replace(tile, block_m=32), 256) is not None  # S^T is one m64 wgmma
    assert gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=4), 128) is None
    assert "shared memory" in gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=5), 128)
    assert gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=3), 256) is not None


def test_tiles_a_head_dim_cannot_run_are_refused(device):
    """A Gluon tile that cannot run at the call's head dim (the D=128 table's at D=256: its dK/dV accumulators and
    its forward's 128-key stages) is refused before anything compiles, with the reason."""
    assert gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=4), 256) is not None
    assert gluon_tile_problem("dkdv", Tile(64, 128, gluon_stages=4), 128) is None
    assert gluon_tile_problem("fwd", Tile(128, 128, gluon_stages=3), 256) is not None
    assert gluon_tile_problem("fwd", Tile(128, 128, gluon_stages=3), 128) is None
    assert gluon_tile_problem("dq", Tile(128, 64, gluon_stages=2), 256) is not None  # Q and dO take 128 KB
    assert gluon_tile_problem("dq", replace(GLUON_D256["dq"], gluon_stages=4), 256) is not None
    q, k, v = make_qkv(1, 2, 1, 60, 60, 256, torch.float32, device)
    d128 = cuda_kernel_config(128, torch.bfloat16, HOPPER, gluon=True)
    assert d128.bwd_dkdv.gluon
    with use_tuning(d128), pytest.raises(ValueError, match="mmsparse: the Gluon (dq|dK/dV) kernel"):
        mbs_attention(q, k, v, HUB, (9, 30, 21))


def test_backward_dispatches_the_d256_dkdv_launcher(monkeypatch, device):
    """A plan whose dK/dV pass is the D=256 Gluon tile calls ``run_dkdv_d256`` with that tile and the lists built
    for it (recorded here instead of run: anywhere, through the interpreter on a CPU), never the D <= 128
    launcher; an error inside it reaches the caller."""
    from mmsparse.attention import gluon_launch
    from mmsparse.attention.config import kernel_config

    calls = []

    def record(*args, **kwargs):
        calls.append((args[7], args[12]))  # the mask arguments of the tile's lists, the tile
        raise RuntimeError("recorded, not run")

    def refuse(*args, **kwargs):
        raise AssertionError("the D <= 128 dK/dV launcher was called at D=256")

    monkeypatch.setattr(gluon_launch, "run_dkdv_d256", record)
    monkeypatch.setattr(gluon_launch, "run_dkdv", refuse)
    tile = GLUON_D256["dkdv"]
    cfg = replace(kernel_config(256, torch.bfloat16, device), bwd_dkdv=tile)
    q, k, v = make_qkv(1, 2, 1, 150, 150, 256, torch.bfloat16, device)
    with use_tuning(cfg):
        out = mbs_attention(q, k, v, CYCLIC, (40, 70, 40))
        with pytest.raises(RuntimeError, match="recorded, not run"):
            out.sum().backward()
    (mask, planned), = calls
    assert planned == tile
    mask_tensors, mask_scalars = mask
    counts = mask_tensors[3]  # COUNTS: each key block's (full, partial, start, order): 150 keys, 3 blocks of 64
    assert counts.reshape(counts.shape[0], -1, COUNT_WORDS).shape[1] == 3
