"""Host-side TMA descriptors of the Gluon kernels (mmsparse.attention.host_tma): what a kernel receives for a
[B, H, S, D] tensor. The kernels themselves need an sm_90 GPU (tests/kernels/test_hopper_*.py)."""

from __future__ import annotations

import pytest
import torch

from mmsparse.attention.host_tma import box_descriptor, head_rows_descriptor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_descriptor_describes_the_tensor_as_it_is_stored(dtype):
    q = torch.empty(2, 7, 3, 96, dtype=dtype).transpose(1, 2)  # [B, S, H, D] storage seen as [B, H, S, D]
    desc = box_descriptor(q, 64, 128)
    assert desc.base is q
    assert tuple(desc.shape) == (2, 3, 7, 96)  # the true head dim: TMA zero-fills the box past it
    assert tuple(desc.strides) == q.stride() == (7 * 3 * 96, 96, 3 * 96, 1)
    assert desc.block_shape == [1, 1, 64, 128]
    assert desc.padding == "zero"
    assert desc.layout.rank == 4 and desc.layout.element_bitwidth == 16 and desc.layout.swizzle_byte_width == 128


def test_layouts_are_shared_between_calls():
    """The layout is computed once per (box, dtype): Gluon's get_default_for costs ~18 us a call."""
    a = box_descriptor(torch.empty(1, 1, 8, 64, dtype=torch.bfloat16), 64, 64)
    b = box_descriptor(torch.empty(3, 2, 90, 64, dtype=torch.bfloat16), 64, 64)
    c = box_descriptor(torch.empty(1, 1, 8, 64, dtype=torch.bfloat16), 128, 64)
    assert a.layout is b.layout
    assert c.layout is not a.layout


def test_descriptor_matches_the_checked_constructor():
    """box_descriptor skips TensorDescriptor's checks for speed; on a valid tensor it must build the same object."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    k = torch.empty(2, 4, 130, 64, dtype=torch.bfloat16)
    fast = box_descriptor(k, 64, 64)
    checked = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, 64, 64], fast.layout)
    assert (list(fast.shape), list(fast.strides), fast.block_shape, fast.layout, fast.padding) == (
        checked.shape, checked.strides, checked.block_shape, checked.layout, checked.padding)


def test_head_rows_descriptor_sees_batch_and_heads_as_one_dimension():
    """The one-pass dQ sum's descriptor: [B, H, S, D] float32 as [B * H, S, D] (rows still end at S, per head), as
    the checked constructor builds it; a tensor whose batch and head strides do not fold is refused."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dq = torch.zeros(2, 3, 70, 96)
    fast = head_rows_descriptor(dq, 64, 64)
    assert fast.base is dq and tuple(fast.shape) == (6, 70, 96) and tuple(fast.strides) == (70 * 96, 96, 1)
    assert fast.block_shape == [1, 64, 64] and fast.padding == "zero"
    assert fast.layout.rank == 3 and fast.layout.element_bitwidth == 32 and fast.layout.swizzle_byte_width == 128
    checked = TensorDescriptor(dq.flatten(0, 1), [6, 70, 96], [70 * 96, 96, 1], [1, 64, 64], fast.layout)
    assert (list(fast.shape), list(fast.strides), fast.block_shape, fast.layout) == (
        checked.shape, checked.strides, checked.block_shape, checked.layout)
    with pytest.raises(ValueError, match="contiguous"):
        head_rows_descriptor(torch.zeros(3, 2, 70, 96).transpose(0, 1), 64, 64)


def test_gluon_launchers_pass_what_the_kernels_take(monkeypatch):
    """The Gluon launchers of the forward and the three backward kernels, with the kernel launch replaced by a
    recorder: every kernel parameter is given
    (positionally or by keyword), the tensors the kernels read through TMA arrive as descriptors with the boxes
    their shared tiles take, and the tiles' stage counts arrive. On a GPU a mismatch would only show as the
    warning of a failed build and a fall-back to the slower tl kernels."""
    from mmsparse.attention import gluon_launch
    from mmsparse.attention.config import _GLUON_DKDV, _GLUON_DQ, _GLUON_FWD
    from mmsparse.attention.kernel_args import kernel_args
    from mmsparse.mask.build import build_mask_info

    launched = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.params = name, list(kernel.arg_names)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                given = self.params[: len(args)] + [k for k in kwargs if k not in ("num_warps", "maxnreg")]
                # defaulted flags a variant leaves off: the one pass's and the landing keys' (off in a plain two-pass
                # launch), the forward's turns, the ordered writer's order and sections of heads
                optional = {"dkdv": ("WAIT_ARRIVAL",), "fwd": ("TURNS",),
                            "dq_writer": ("ORDERED", "SHORTEST_FIRST", "HEADS_SECTION")}.get(self.name, ())
                assert sorted(given) == sorted(p for p in self.params if p not in optional or p in kwargs), self.name
                launched[self.name] = dict(zip(self.params, args)) | kwargs

            return launch

    # No sm_90 here: the launches are recorded instead of run.
    monkeypatch.setattr(gluon_launch, "_DKDV", Recorder("dkdv", gluon_launch._DKDV.fn))
    monkeypatch.setattr(gluon_launch, "_DQ", Recorder("dq", gluon_launch._DQ.fn))
    monkeypatch.setattr(gluon_launch, "_FWD", Recorder("fwd", gluon_launch._FWD.fn))
    monkeypatch.setattr(gluon_launch, "_DQ_WRITER", Recorder("dq_writer", gluon_launch._DQ_WRITER.fn))
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 300, 96
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    info = build_mask_info([[1, 1], [0, 1]], (100, 200), seq, seq, False, torch.device("cpu"))
    dkdv_t, dq_t, fwd_t = _GLUON_DKDV[128], _GLUON_DQ[128], _GLUON_FWD[128]
    args = kernel_args(info.prepare([(dkdv_t.block_m, dkdv_t.block_n, True), (dq_t.block_m, dq_t.block_n, False),
                                     (fwd_t.block_m, fwd_t.block_n, False)]))
    mask = (info.mode, info.causal)
    rows = torch.zeros(batch, heads, seq)
    gluon_launch.run_dkdv(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)),
                          args.tile(dkdv_t.block_m, dkdv_t.block_n, True), *mask, 1.0, 1.0, dkdv_t)
    gluon_launch.run_dq(q, k, v, q.clone(), rows, rows, torch.empty_like(q), args.tile(dq_t.block_m, dq_t.block_n),
                        *mask, 1.0, 1.0, dq_t)
    gluon_launch.run_forward(q, k, v, args.tile(fwd_t.block_m, fwd_t.block_n), *mask, 1.0, fwd_t)

    dkdv, dq, fwd = launched["dkdv"], launched["dq"], launched["fwd"]
    dkdv_tile, dq_tile = _GLUON_DKDV[128], _GLUON_DQ[128]
    assert {n: dkdv[n].block_shape for n in ("q_desc", "do_desc", "k_desc", "v_desc", "dk_desc", "dv_desc")} == {
        "q_desc": [1, 1, dkdv_tile.block_m, 128], "do_desc": [1, 1, dkdv_tile.block_m, 128],
        **{n: [1, 1, 64, 128] for n in ("k_desc", "v_desc", "dk_desc", "dv_desc")}}
    assert {n: dq[n].block_shape for n in ("q_desc", "do_desc", "dq_desc", "k_desc", "v_desc")} == {
        **{n: [1, 1, 64, 128] for n in ("q_desc", "do_desc", "dq_desc")},
        **{n: [1, 1, dq_tile.block_n, 128] for n in ("k_desc", "v_desc")}}
    assert fwd["k_desc"].block_shape == [1, 1, _GLUON_FWD[128].block_n, 128]
    assert dkdv["k_desc"].base is k and dq["v_desc"].base is v and fwd["q_desc"].base is q
    assert (dkdv["STAGES"], dq["STAGES"], fwd["STAGES"]) == (4, 4, _GLUON_FWD[128].gluon_stages)
    assert dkdv["HEAD_DIM_PAD"] == dq["HEAD_DIM_PAD"] == fwd["HEAD_DIM_PAD"] == 128
    assert dkdv["GROUP"] == dq["GROUP"] == fwd["GROUP"] == 2
    assert "WAIT_ARRIVAL" not in dkdv  # the plain variant keeps its compile key
    assert dkdv["own_blocks"] == 0 and dkdv["ARRIVAL"] is dkdv["DELTA"]  # unread there

    # Keys still landing: the flag, the fetch's epoch and the key blocks already there (whole 128-key blocks).
    from mmsparse.runtime.arrival import KeysArrival

    flag = torch.zeros(1, dtype=torch.int32)
    gluon_launch.run_dkdv(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)),
                          args.tile(dkdv_t.block_m, dkdv_t.block_n, True), *mask, 1.0, 1.0, dkdv_t,
                          arrival=KeysArrival(flag, 7, 200, lambda: None))
    landing = launched["dkdv"]
    assert landing["WAIT_ARRIVAL"]
    assert landing["ARRIVAL"] is flag and (landing["arrival_epoch"], landing["own_blocks"]) == (7, 1)

    # The one pass (the dQ writer): dQ's float32 sum as a [B * Hq, Sq, D] descriptor whose box is one MMA
    # warpgroup's half of a block's dQ (TMA bulk reduce-adds); ordered, its counters and ranks.
    from dataclasses import replace

    from mmsparse.attention.config import GLUON_DQ_WRITER

    dq_sum = torch.zeros(batch, heads, seq, head_dim)
    writer_t = GLUON_DQ_WRITER[128]
    one_mask = args.tile(writer_t.block_m, writer_t.block_n, True)
    gluon_launch.run_bwd_dq_writer(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)), dq_sum,
                                   one_mask, *mask, 1.0, 1.0, writer_t)
    writer = launched["dq_writer"]
    assert "ORDERED" not in writer and writer["STAGES"] == writer_t.gluon_stages == 3
    assert writer["DQ"].base is dq_sum and tuple(writer["DQ"].shape) == (batch * heads, seq, head_dim)
    assert writer["DQ"].block_shape == [1, 64, 64] and writer["DQ"].layout.element_bitwidth == 32
    assert writer["COUNTERS"] is writer["RANKS"] is writer["DELTA"]  # unread without ORDERED
    counters, ranks = torch.zeros(batch * heads, 5, dtype=torch.int32), torch.zeros(7, dtype=torch.int32)
    gluon_launch.run_bwd_dq_writer(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)), dq_sum,
                                   one_mask, *mask, 1.0, 1.0, writer_t, order=(counters, ranks, 5),
                                   shortest_first=False)
    ordered = launched["dq_writer"]
    assert ordered["ORDERED"] and ordered["SHORTEST_FIRST"] is False
    assert ordered["COUNTERS"] is counters and ordered["RANKS"] is ranks and ordered["query_blocks"] == 5
    assert "HEADS_SECTION" not in ordered  # one head after the other keeps its compile key
    gluon_launch.run_bwd_dq_writer(q, k, v, q.clone(), rows, rows, (torch.empty_like(k), torch.empty_like(v)), dq_sum,
                                   one_mask, *mask, 1.0, 1.0, writer_t, order=(counters, ranks, 5),
                                   shortest_first=False, head_section=4)
    assert launched["dq_writer"]["HEADS_SECTION"] == 4 and launched["dq_writer"]["ORDERED"]
    for run, tile in ((gluon_launch.run_dq, dq_t), (gluon_launch.run_dkdv, dkdv_t)):  # only the forward has turns
        launched.clear()
        outputs = torch.empty_like(q) if run is gluon_launch.run_dq else (torch.empty_like(k), torch.empty_like(v))
        lists = args.tile(tile.block_m, tile.block_n, run is gluon_launch.run_dkdv)
        with pytest.raises(ValueError, match="Tile.pingpong is the Gluon forward's"):
            run(q, k, v, q.clone(), rows, rows, outputs, lists, *mask, 1.0, 1.0, replace(tile, pingpong=True))
        assert not launched



def test_d256_dkdv_launcher_passes_what_the_kernel_takes(monkeypatch):
    """The D=256 dK/dV launcher (``run_dkdv_d256``), its launch recorded: every kernel parameter given, Q and dO as
    descriptors of block_m-row boxes, K, V, dK and dV of 64-key boxes, all 256 wide (a head dim of 192 padded);
    tiles of another block or with ping-pong refused."""
    from dataclasses import replace

    from mmsparse.attention import gluon_launch
    from mmsparse.attention.config import GLUON_D256
    from mmsparse.attention.kernel_args import kernel_args
    from mmsparse.mask.build import build_mask_info

    launched = {}
    params = list(gluon_launch._DKDV_D256.fn.arg_names)

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                given = params[: len(args)] + [k for k in kwargs if k not in ("num_warps", "maxnreg")]
                assert sorted(given) == sorted(params)
                launched.update(dict(zip(params, args)) | kwargs, grid=grid)

            return launch

    monkeypatch.setattr(gluon_launch, "_DKDV_D256", Recorder())
    batch, heads, kv_heads, seq, head_dim = 2, 4, 1, 300, 192
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    info = build_mask_info([[1, 1], [0, 1]], (100, 200), seq, seq, True, torch.device("cpu"))
    tile = GLUON_D256["dkdv"]
    args = kernel_args(info.prepare([(tile.block_m, tile.block_n, True)]))
    lists = args.tile(tile.block_m, tile.block_n, True)
    rows = torch.zeros(batch, heads, seq)
    outputs = (torch.empty_like(k), torch.empty_like(v))
    gluon_launch.run_dkdv_d256(q, k, v, q.clone(), rows, rows, outputs, lists, info.mode, info.causal, 1.0, 1.0, tile)
    assert {n: launched[n].block_shape for n in ("q_desc", "do_desc", "k_desc", "v_desc", "dk_desc", "dv_desc")} == {
        "q_desc": [1, 1, tile.block_m, 256], "do_desc": [1, 1, tile.block_m, 256],
        **{n: [1, 1, 64, 256] for n in ("k_desc", "v_desc", "dk_desc", "dv_desc")}}
    assert launched["dk_desc"].base is outputs[0] and launched["dv_desc"].base is outputs[1]
    assert (launched["STAGES"], launched["BM"], launched["HEAD_DIM_PAD"], launched["GROUP"]) == (2, 64, 256, 4)
    assert launched["IS_CAUSAL"] and launched["grid"] == (5, batch * kv_heads)  # 300 keys: 5 blocks of 64
    with pytest.raises(ValueError, match="blocks have 64 rows, the planned tile 128"):
        gluon_launch.run_dkdv_d256(q, k, v, q.clone(), rows, rows, outputs, lists, info.mode, info.causal, 1.0, 1.0,
                                   replace(tile, block_n=128))
    with pytest.raises(ValueError, match="Tile.pingpong is the Gluon forward's"):
        gluon_launch.run_dkdv_d256(q, k, v, q.clone(), rows, rows, outputs, lists, info.mode, info.causal, 1.0, 1.0,
                                   replace(tile, pingpong=True))
