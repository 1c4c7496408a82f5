"""A tile or threshold the kernels cannot run is refused when it is made or set (``Tile(...)``,
``KernelConfig(...)``, ``use_tuning(...)``), with a message that names the field and what it must be, never at a
launch (where a negative tile size crashed the interpreter). Every tile of the tables still constructs."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mmsparse.attention import config
from mmsparse.attention.config import cuda_kernel_config, kernel_config
from mmsparse.tuning import THRESHOLDS, KernelConfig, Tile, use_tuning

SMALL = dict(fwd=Tile(32, 16), bwd_dkdv=Tile(16, 32), bwd_dq=Tile(32, 16), decode=Tile(16, 16))

BAD_TILES = {
    "block_m-negative": (dict(block_m=-16), ValueError,
                         r"Tile\.block_m must be a power of two from 16 to 256.*got -16: use 16"),
    "block_m-zero": (dict(block_m=0), ValueError, r"Tile\.block_m .*got 0"),
    "block_m-48": (dict(block_m=48), ValueError, r"Tile\.block_m .*got 48: use 32 or 64"),
    "block_n-8": (dict(block_n=8), ValueError, r"Tile\.block_n .*tl\.dot.*got 8: use 16"),
    "block_n-512": (dict(block_n=512), ValueError, r"Tile\.block_n .*got 512: use 256"),
    "block_m-float": (dict(block_m=32.0), TypeError, r"Tile\.block_m must be an int; got float 32\.0"),
    "block_m-bool": (dict(block_m=True), TypeError, r"Tile\.block_m must be an int; got bool"),
    "num_warps-3": (dict(num_warps=3), ValueError, r"Tile\.num_warps must be a power of two from 1 to 16.*got 3"),
    "num_warps-0": (dict(num_warps=0), ValueError, r"Tile\.num_warps .*got 0"),
    "num_warps-32": (dict(num_warps=32), ValueError, r"Tile\.num_warps .*got 32"),
    "num_stages-0": (dict(num_stages=0), ValueError, r"Tile\.num_stages must be at least 1.*got 0"),
    "num_stages-str": (dict(num_stages="2"), TypeError, r"Tile\.num_stages must be an int; got str"),
    "gluon_stages-1": (dict(gluon_stages=1), ValueError, r"Tile\.gluon_stages must be 0 \(no Gluon kernel\) or at "
                                                         r"least 2.*got 1"),
    "gluon_stages-negative": (dict(gluon_stages=-2), ValueError, r"Tile\.gluon_stages .*got -2"),
    "pingpong-str": (dict(pingpong="yes"), TypeError, r"Tile\.pingpong must be True or False; got str"),
    "pingpong-int": (dict(pingpong=1), TypeError, r"Tile\.pingpong must be True or False; got int"),
}


@pytest.mark.parametrize("fields, exc, match", BAD_TILES.values(), ids=BAD_TILES)
def test_a_tile_the_kernels_cannot_run_is_refused_when_made(fields, exc, match):
    """Without running a kernel: ``Tile(-16, 16)`` reached the interpreter and crashed the process."""
    with pytest.raises(exc, match=match):
        Tile(**{"block_m": 64, "block_n": 32, **fields})
    with pytest.raises(exc, match=match):  # replace() makes the tile again
        dataclasses.replace(Tile(64, 32), **fields)


def test_the_smallest_and_largest_tiles_are_accepted():
    for block_m, block_n, warps in itertools.product((16, 256), (16, 256), (1, 16)):
        Tile(block_m, block_n, num_warps=warps, num_stages=1, gluon_stages=0)
    Tile(128, 128, gluon_stages=2, pingpong=True, turns="named_release")


BAD_CONFIGS = {
    "fwd-tuple": (dict(fwd=(32, 16)), TypeError, r"KernelConfig\.fwd must be a mmsparse\.tuning\.Tile; got tuple"),
    "decode-none": (dict(decode=None), TypeError, r"KernelConfig\.decode must be a mmsparse\.tuning\.Tile; got "
                                                  r"NoneType"),
    "fwd_short-tuple": (dict(fwd_short=(64, 32)), TypeError, r"KernelConfig\.fwd_short must be a mmsparse\.tuning"
                                                             r"\.Tile or None; got tuple"),
    "use_tma-str": (dict(use_tma="no"), TypeError, r"KernelConfig\.use_tma must be True or False; got str"),
    "short_keys-negative": (dict(short_keys=-1), ValueError, r"KernelConfig\.short_keys must be an int >= 0.*-1"),
    "short_samples-float": (dict(short_samples=1.5), TypeError, r"KernelConfig\.short_samples must be an int"),
    "decode_max_q-bool": (dict(decode_max_q=True), TypeError, r"KernelConfig\.decode_max_q must be an int"),
    "one_pass_max_keys-str": (dict(one_pass_max_keys="x"), TypeError, r"KernelConfig\.one_pass_max_keys must be an "
                                                                      r"int"),
    "compact_bytes-none": (dict(compact_bytes=None), TypeError, r"KernelConfig\.compact_bytes must be an int"),
    # The Gluon kernels' blocks are fixed: 128 query rows (forward, dQ), 128 keys (dK/dV; 64 in the kernel of head
    # dims 129-256, which the plan checks against the head dim); a launch refused any other tile, and only on a
    # Hopper GPU.
    "gluon-fwd-64-rows": (dict(fwd=Tile(64, 64, gluon_stages=2)), ValueError,
                          r"KernelConfig\.fwd is a Gluon tile \(gluon_stages=2\).*128 query rows.*block_m=64"),
    "gluon-fwd_short-64-rows": (dict(fwd_short=Tile(64, 64, gluon_stages=2)), ValueError,
                                r"KernelConfig\.fwd_short is a Gluon tile.*128 query rows"),
    "gluon-decode-16-rows": (dict(decode=Tile(16, 64, gluon_stages=2)), ValueError,
                             r"KernelConfig\.decode is a Gluon tile.*128 query rows.*gluon_stages=0"),
    "gluon-dq-64-rows": (dict(bwd_dq=Tile(64, 64, gluon_stages=3)), ValueError,
                         r"KernelConfig\.bwd_dq is a Gluon tile.*128 query rows"),
    "gluon-dkdv-32-keys": (dict(bwd_dkdv=Tile(64, 32, gluon_stages=4)), ValueError,
                           r"KernelConfig\.bwd_dkdv is a Gluon tile.*128 keys per block \(64 at head dims "
                           r"129-256\).*block_n=32"),
    "gluon_dq_writer-64-keys": (dict(gluon_dq_writer=Tile(64, 64, gluon_stages=3)), ValueError,
                                r"KernelConfig\.gluon_dq_writer is a Gluon tile.*128 keys"),
    # Dropout runs the tl kernels only: a Gluon tile for it would be silently ignored
    "gluon-dkdv-dropout": (dict(bwd_dkdv_dropout=Tile(64, 128, gluon_stages=2)), ValueError,
                           r"KernelConfig\.bwd_dkdv_dropout is a tl kernel's tile with dropout.*gluon_stages=0"),
    "gluon-dq-dropout": (dict(bwd_dq_dropout=Tile(128, 64, gluon_stages=2)), ValueError,
                         r"KernelConfig\.bwd_dq_dropout is a tl kernel's tile with dropout.*gluon_stages=0"),
    "dkdv-dropout-tuple": (dict(bwd_dkdv_dropout=(32, 64)), TypeError, r"KernelConfig\.bwd_dkdv_dropout must be a "
                                                                       r"mmsparse\.tuning\.Tile or None"),
}


@pytest.mark.parametrize("fields, exc, match", BAD_CONFIGS.values(), ids=BAD_CONFIGS)
def test_a_config_the_kernels_cannot_run_is_refused_when_made(fields, exc, match):
    with pytest.raises(exc, match=match):
        KernelConfig(**{**SMALL, **fields})
    with pytest.raises(exc, match=match):
        dataclasses.replace(KernelConfig(**SMALL), **fields)


def test_the_d256_dkdv_block_is_checked_against_the_head_dim_when_planned(device):
    """A 64-key Gluon dK/dV tile is the D=256 kernel's: a config takes it, and a call at a head dim up to 128 refuses
    it before anything compiles, with the reason."""
    from mmsparse import mbs_attention
    from tests.helpers import CYCLIC, make_qkv

    cfg = KernelConfig(**{**SMALL, "bwd_dkdv": Tile(64, 64, gluon_stages=2)})
    q, k, v = make_qkv(1, 2, 1, 60, 60, 32, torch.float32, device)
    with use_tuning(cfg), pytest.raises(ValueError, match="mmsparse: the Gluon dK/dV kernel at head dims up to 128 "
                                                          "takes 128 keys"):
        mbs_attention(q, k, v, CYCLIC, (9, 30, 21))


def test_a_gluon_tile_keeps_its_rows_only_where_the_pass_runs_gluon():
    """The tl one-pass tile never runs the Gluon kernel (gluon_dq_writer does): its gluon_stages are not read."""
    KernelConfig(**SMALL, bwd_one_pass=Tile(32, 16, gluon_stages=2))
    KernelConfig(fwd=Tile(128, 64, gluon_stages=3), bwd_dkdv=Tile(32, 128, gluon_stages=2),
                 bwd_dq=Tile(128, 32, gluon_stages=2), decode=Tile(16, 16),
                 gluon_dq_writer=Tile(16, 128, gluon_stages=2))


BAD_THRESHOLDS = {
    "short_keys-negative": (dict(short_keys=-1), ValueError, r"use_tuning\(short_keys=\.\.\.\) must be an int >= 0, "
                                                             r"a number of keys; got int -1"),
    "short_keys-float": (dict(short_keys=1.5), TypeError, r"use_tuning\(short_keys=\.\.\.\) must be an int"),
    "one_pass_max_keys-str": (dict(one_pass_max_keys="x"), TypeError, r"use_tuning\(one_pass_max_keys=\.\.\.\) must "
                                                                      r"be an int >= 0, a number of keys; got str 'x'"),
    "compact_bytes-bool": (dict(compact_bytes=True), TypeError, r"use_tuning\(compact_bytes=\.\.\.\) must be an int"),
    "decode_max_q-none": (dict(decode_max_q=None), TypeError, r"use_tuning\(decode_max_q=\.\.\.\) must be an int"),
    "short_samples-negative": (dict(short_samples=-5), ValueError, r"use_tuning\(short_samples=\.\.\.\).*>= 0"),
    "ordered_samples-float": (dict(ordered_samples=512.0), TypeError, r"use_tuning\(ordered_samples=\.\.\.\) must be "
                                                                      r"an int >= 0, a number of tokens per sample"),
}


@pytest.mark.parametrize("thresholds, exc, match", BAD_THRESHOLDS.values(), ids=BAD_THRESHOLDS)
def test_a_bad_threshold_is_refused_when_use_tuning_is_called(thresholds, exc, match):
    """At the call, before any ``with``: the thread's settings never hold the value, and no block runs."""
    before = kernel_config(16, torch.float32, torch.device("cpu"))
    with pytest.raises(exc, match=match):
        use_tuning(**thresholds)
    ran = False
    with pytest.raises(exc, match=match):
        with use_tuning(KernelConfig(**SMALL), **thresholds):
            ran = True
    assert not ran and kernel_config(16, torch.float32, torch.device("cpu")) is before


def test_every_threshold_takes_zero_and_large_values():
    """0 is meaningful for each (no decoding tile, no short tiles, always packed lists, never one pass)."""
    for value in (0, 1 << 62):
        with use_tuning(**dict.fromkeys(THRESHOLDS, value)):
            cfg = kernel_config(16, torch.float32, torch.device("cpu"))
            assert all(getattr(cfg, name) == value for name in THRESHOLDS)
        KernelConfig(**SMALL, **dict.fromkeys(THRESHOLDS, value))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["sm90", "sm80"])
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "tl"])
def test_every_table_tile_is_accepted(head_dim, dtype, capability, gluon):
    cfg = cuda_kernel_config(head_dim, dtype, capability, gluon)
    dataclasses.replace(cfg)  # checked again, with every tile
    for field in dataclasses.fields(cfg):
        tile = getattr(cfg, field.name)
        if isinstance(tile, Tile):
            dataclasses.replace(tile)


def test_the_module_tables_are_accepted():
    tables = (config._GLUON_FWD, config._GLUON_FWD_SHORT_SAMPLES, config._GLUON_DQ, config._GLUON_DKDV,
              config.GLUON_DQ_WRITER, config.GLUON_DQ_WRITER_LONG)
    for tile in itertools.chain.from_iterable(table.values() for table in tables):
        dataclasses.replace(tile)
    dataclasses.replace(config._INTERPRETER)


def test_the_gluon_rows_are_the_kernels_blocks():
    """KernelConfig checks Gluon tiles against config.GLUON_BLOCK without importing Gluon: the kernels' fixed blocks
    must be that size."""
    pytest.importorskip("triton.experimental.gluon")
    from mmsparse.kernels.gluon.common import BLOCK_M
    from mmsparse.kernels.gluon.dkdv import BLOCK_N

    assert BLOCK_M == BLOCK_N == config.GLUON_BLOCK
