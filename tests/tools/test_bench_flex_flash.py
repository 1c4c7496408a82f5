"""The benchmark's ``flex_flash`` impl (FlexAttention on its FLASH backend) where it cannot run, as on this CPU: listed,
skipped with its reason, never crashing a run; its int32 ``mask_mod`` variant is the ``flex`` one; its setup records
the first call and whether the backward is deterministic, and turns a first call that fails to lower into a skip."""

from __future__ import annotations

import json

import pytest
import torch

import mmsparse
from benchmarks import baselines
from benchmarks.baselines import (
    IMPLS,
    SETUPS,
    config_mask_mod,
    deterministic_backward,
    flex_flash_unavailable,
    setup_flex_flash,
)
from benchmarks.cases import Case
from benchmarks.configs import HUB, TINY
from benchmarks.errors import Skip
from benchmarks.flex_mask import flex_mask_mod, segment_ids
from benchmarks.report import markdown
from benchmarks.run import parse_args, select
from benchmarks.timing import Timing

CPU = torch.device("cpu")


def _case_and_timing() -> tuple[Case, Timing]:
    return (Case.make(TINY["tiny_cyclic"], CPU, torch.float32),
            Timing(CPU, warmup=0, rep=0, cpu_warmup=1, cpu_reps=1))


def _mask_mods(cfg, index_dtype):
    return config_mask_mod(cfg, CPU, index_dtype)


def test_flex_flash_is_an_impl():
    assert "flex_flash" in IMPLS and "flex_flash" in SETUPS
    assert IMPLS.index("flex_flash") == IMPLS.index("flex") + 1
    assert select(parse_args(["--impls", "mmsparse,flex_flash"]))[1] == ["mmsparse", "flex_flash"]
    assert "flex_flash" in select(parse_args([]))[1]  # in a default run, skipped where it cannot run


def test_flex_flash_is_skipped_with_its_reason_on_cpu():
    case, timing = _case_and_timing()
    with pytest.raises(Skip) as skip:
        setup_flex_flash(case, timing)
    reason = str(skip.value)
    assert "needs a CUDA device, not cpu" in reason and "benchmarks/README.md, 'Installing the FLASH backend'" in reason
    assert case.q.grad is None


def test_an_old_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    assert "needs torch >= 2.11, this is 2.10.1+cu128" in flex_flash_unavailable(CPU)


def test_the_benchmark_records_flex_flash_as_skipped(tmp_path):
    """``python -m benchmarks --impls mmsparse,flex_flash --configs tiny_cyclic --device cpu`` (flex_flash alone here,
    to keep it quick): exit status 0, a skipped row with the reason, the flex_flash columns in the table."""
    from benchmarks.run import main

    threads = torch.get_num_threads()
    try:
        status = main(["--device", "cpu", "--configs", "tiny_cyclic", "--impls", "flex_flash", "--no-plot", "--out",
                       str(tmp_path), "--warmup", "0", "--rep", "0", "--cpu-warmup", "1", "--cpu-reps", "1",
                       "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    (row,) = json.loads((tmp_path / "latest.json").read_text())
    assert row["impl"] == "flex_flash" and "needs a CUDA device" in row["skipped"]
    assert row["error"].startswith("skipped: ") and row["fwd_ms"] is None
    table = (tmp_path / "latest.md").read_text()
    assert "flex_flash fwd ms" in table and "| tiny_cyclic | flex_flash |" in table and "needs a CUDA device" in table


@pytest.mark.parametrize("cfg", list(TINY.values()), ids=lambda c: c.name)
def test_the_int32_mask_mod_is_the_flex_one(cfg):
    from torch.nn.attention.flex_attention import create_mask

    want = create_mask(_mask_mods(cfg, torch.int64), 1, 1, cfg.q_len, cfg.seq_k, device="cpu")
    got = create_mask(_mask_mods(cfg, torch.int32), 1, 1, cfg.q_len, cfg.seq_k, device="cpu")
    assert torch.equal(got, want)
    if cfg.packed:
        assert torch.equal(got[0, 0], mmsparse.reference_packed_mask(cfg.topology, cfg.seg_lens, cfg.causal)[0])


def test_the_int32_mask_mod_with_per_sample_padding():
    from torch.nn.attention.flex_attention import create_mask

    lens = torch.tensor([[10, 30, 20], [5, 0, 40], [0, 0, 0]])
    seg, real = segment_ids(lens, 64, CPU)
    got = create_mask(flex_mask_mod(HUB, seg, True, real=real, index_dtype=torch.int32), 3, 1, 64, 64, device="cpu")
    assert torch.equal(got[:, 0], mmsparse.reference_mask(HUB, lens, 64, 64, True))


@pytest.mark.parametrize("name", ["tiny_decode", "tiny_pack", "tiny_transfusion", "tiny_window"])
def test_the_int32_mask_mod_captures_and_computes_only_what_flash_lowers(name):
    """FLASH lowers int32 captures only, and no clamp / maximum: every captured tensor and every integer value of
    the traced mask_mod is int32 (with int32 indices, as the kernel passes them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mask_mod = _mask_mods(TINY[name], torch.int32)
    captured = [c.cell_contents for c in mask_mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert captured and all(t.dtype == torch.int32 for t in captured)
    idx = torch.zeros(1, dtype=torch.int32)
    graph = make_fx(mask_mod)(idx, idx, idx, idx).graph
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not {op for op in ops if any(w in op for w in ("clamp", "maximum", "minimum"))}
    dtypes = {n.meta["val"].dtype for n in graph.nodes if "val" in n.meta}
    assert dtypes <= {torch.int32, torch.bool}


def test_flex_mask_mod_refuses_other_index_dtypes():
    seg, _ = segment_ids((3, 4), 7, CPU)
    with pytest.raises(ValueError, match="index_dtype"):
        flex_mask_mod(((1, 1), (1, 1)), seg, False, index_dtype=torch.int16)


def test_deterministic_backward_compares_the_bits():
    case, _ = _case_and_timing()

    def plain(q, k, v):
        return q * 2 + (k.sum() + v.sum())

    def noisy(q, k, v):
        q = q * 1
        q.register_hook(lambda g: g + torch.rand_like(g))  # a different dq on every backward
        return plain(q, k, v)

    assert deterministic_backward(case, plain) is True
    assert deterministic_backward(case, noisy) is False
    assert case.q.grad is None


def test_setup_records_the_first_call_and_determinism(monkeypatch):
    """Where FLASH is available, setup builds the 128 x 128 block mask, times the first forward + backward and
    checks the backward for determinism; a first call that fails to lower is a skip naming the cause."""
    case, timing = _case_and_timing()
    monkeypatch.setattr(baselines, "flex_flash_unavailable", lambda device: None)
    seen = {}

    def fake_flex(q, k, v, block_mask, enable_gqa):
        seen["block"], seen["gqa"] = block_mask.BLOCK_SIZE, enable_gqa
        return q * 2 + (k.sum() + v.sum())

    monkeypatch.setattr(baselines, "compiled_flex_flash", lambda: fake_flex)
    impl = setup_flex_flash(case, timing)
    assert seen == {"block": (128, 128), "gqa": False}
    assert impl.info["first_call_s"] > 0 and impl.info["deterministic_bwd"] is True
    assert impl.build_ms > 0 and "FLASH" in impl.info["backend"] and case.q.grad is None

    def unlowerable(q, k, v, block_mask, enable_gqa):
        try:
            raise NotImplementedError("Unsupported op: aten.clamp.default\nsecond line")
        except NotImplementedError as e:
            raise RuntimeError("backend='inductor' raised:") from e

    monkeypatch.setattr(baselines, "compiled_flex_flash", lambda: unlowerable)
    with pytest.raises(Skip, match=r"first call \(compile\) failed: NotImplementedError: Unsupported op: aten.clamp"):
        setup_flex_flash(case, timing)
    assert case.q.grad is None


def test_the_report_compares_with_flex_flash():
    rows = [
        {"config": "c", "impl": "mmsparse", "fwd_ms": 1.0, "bwd_ms": 2.0, "seq_len": 96, "density": 0.3, "check": "ok"},
        {"config": "c", "impl": "flex", "fwd_ms": 3.0, "bwd_ms": 3.0, "check": "ok"},
        {"config": "c", "impl": "flex_flash", "fwd_ms": 1.5, "bwd_ms": 4.0, "check": "ok", "first_call_s": 41.7,
         "deterministic_bwd": False, "peak_mib": 12.0},
    ]
    table = markdown(rows, "t")
    assert "| flex_flash fwd ms | fwd speedup vs flex_flash |" in table
    assert "| 1.000 | 3.000 | 3.00x | 1.500 | 1.50x | 2.000 | 3.000 | 1.50x | 4.000 | 2.00x |" in table
    assert "| c | mmsparse | 1.000 | 2.000 | - | - | - | - | 3.00x | 1.50x | 1.50x | 2.00x | ok |" in table
    assert "| c | 41.7 | no | 12 | ok |" in table
    assert "flex_flash" not in markdown(rows[:2], "t")  # runs without it keep the old tables


def test_the_skip_reason_points_at_install_steps_in_the_repository():
    """The hint names a section of benchmarks/README.md, and that section pins the packages FLASH needs."""
    from tests.helpers import REPO

    assert "benchmarks/README.md, 'Installing the FLASH backend'" in baselines.FLASH_SETUP_HINT
    text = (REPO / "benchmarks" / "README.md").read_text()
    steps = text.split("### Installing the FLASH backend\n", 1)[1].split("\n### ", 1)[0]
    assert "pip install --no-deps flash-attn-4==" in steps and "nvidia-cutlass-dsl==" in steps
