"""tools/one_pass.py: the one-pass backward against the two-pass one on a tiny config, checked and compared (on the
session's device in the first test: float32 through the interpreter on a CPU, bfloat16 on a GPU)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from benchmarks.configs import ALL_CONFIGS
from mmsparse.attention.config import kernel_config
from tools import one_pass


def test_one_pass_tool_checks_and_compares(tmp_path, capsys, device):
    # The tool runs on CUDA when there is one. The sides are the CPU's default; a GPU's adds the dQ writer, which has
    # no kernel at tiny_ab's head dim (16). The dtype is the tool's default on each: its use is bf16 on a GPU.
    cuda = device.type == "cuda"
    out = tmp_path / "one_pass.json"
    assert one_pass.main(["--configs", "tiny_ab", "--rounds", "1", "--dtype", "bf16" if cuda else "fp32",
                          "--sides", "two-pass,one-pass", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["sides"] == ["two-pass", "one-pass"]
    row = record["rows"][0]
    assert row["config"] == "tiny_ab"
    for side in record["sides"]:
        assert row[f"{side}_check"] == "ok", side
        # CPU times mean nothing, and the backward's is a difference of two of them (it can come out <= 0 on a
        # busy machine): only that every side was timed.
        assert row[f"{side}_fwd_ms"] > 0 and math.isfinite(row[f"{side}_bwd_ms"]), side
    assert row["one-pass_out_equal"]
    diff = max(row[f"one-pass_{g}_rel_diff"] for g in ("dq", "dk", "dv"))
    if cuda:
        # float32 sums within 1e-5 of each other (tests/kernels/test_one_pass.py), each stored in bfloat16, which may
        # put them a bf16 step apart: 2^-7 of the value, itself at most a step above the largest
        assert diff < 1e-5 + 2.0**-7 * (1 + 2.0**-7)
        # the record says which tile the one pass ran: no Gluon kernel at D=16, so the tl one at the device's tile
        tile = kernel_config(ALL_CONFIGS["tiny_ab"].head_dim, torch.bfloat16, device).one_pass_tile()
        assert row["one-pass_tile"] == f"{tile.block_m}x{tile.block_n} tl"
    else:
        assert diff < 1e-5
        assert row["one-pass_tile"] == "16x32 tl"  # the record says which tile the one pass ran (the tl kernel here)
    assert "| tiny_ab | ok / ok | True, " in capsys.readouterr().out


def test_one_pass_tool_sides_and_head_dim(tmp_path):
    """The first side is the baseline, whichever it is; --head-dim reruns a config at another head dim under its
    own row name (one run for both)."""
    out = tmp_path / "one_pass.json"
    args = ["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--out", str(out)]
    assert one_pass.main([*args, "--sides", "one-pass,two-pass", "--head-dim", "24"]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["config"] == "tiny_ab_d24"
    assert row["one-pass_check"] == row["two-pass_check"] == "ok"
    assert "two-pass_bwd_speedup" in row and "one-pass_bwd_speedup" not in row  # the first side is the baseline
    with pytest.raises(SystemExit):
        one_pass.main([*args, "--sides", "two-pass,one-pass-atomic"])  # a side that is gone



def test_dq_writer_side(tmp_path):
    """The dQ-writer side runs the device's config with the warp-specialised kernel's tile; a Gluon kernel, so a
    CPU run refuses the side rather than timing something else under its name."""
    import torch

    from benchmarks.configs import ALL_CONFIGS
    from mmsparse.attention.config import GLUON_DQ_WRITER

    cfg = ALL_CONFIGS["mm13k_hub"]
    config = one_pass.side_config(cfg, "dq-writer", torch.device("cpu"), torch.bfloat16)
    assert config.gluon_dq_writer == GLUON_DQ_WRITER[128]
    # the tl one pass, also at D=64, whose default one pass is the dQ writer
    d64 = ALL_CONFIGS["mm13k_hub_d64"]
    assert one_pass.side_config(d64, "one-pass", torch.device("cpu"), torch.bfloat16).gluon_dq_writer is None
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            one_pass.main(["--configs", "tiny_ab", "--rounds", "1", "--sides", "two-pass,dq-writer"])


def test_dq_writer_stage_sides(tmp_path):
    """"dq-writer-s<N>" runs the dQ-writer kernel at N stages and "dq-writer-m<M>-s<N>" at M query rows a block
    too, refused where they would not fit a CTA's shared memory; a stage count on another side is refused."""
    import torch

    from benchmarks.configs import ALL_CONFIGS
    from mmsparse.attention.config import GLUON_DQ_WRITER

    assert one_pass.side_kind("dq-writer-s5") == "dq-writer" and one_pass.side_stages("dq-writer-s5") == 5
    assert one_pass.side_block_m("dq-writer-s5") is None
    assert one_pass.side_kind("one-pass-s5") == "one-pass-s5"  # not a side: main refuses it
    assert one_pass.side_kind("dq-writer-s5-m128") == "dq-writer-s5-m128"  # rows before stages only
    cfg = ALL_CONFIGS["mm13k_hub_d64"]
    config = one_pass.side_config(cfg, "dq-writer-s6", torch.device("cpu"), torch.bfloat16)
    assert config.gluon_dq_writer == replace(GLUON_DQ_WRITER[64], gluon_stages=6)
    # 128-query blocks: their own stage count, or the table's
    config = one_pass.side_config(cfg, "dq-writer-m128-s3", torch.device("cpu"), torch.bfloat16)
    assert config.gluon_dq_writer == replace(GLUON_DQ_WRITER[64], block_m=128, gluon_stages=3)
    assert one_pass.side_stages("dq-writer-m128") is None and one_pass.side_block_m("dq-writer-m128") == 128
    with pytest.raises(ValueError, match="shared memory"):  # 4 stages at D=128 need 249,856 B of 232,448
        one_pass.side_config(ALL_CONFIGS["mm13k_hub"], "dq-writer-s4", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):  # the table's 5 stages at 128 query rows do not fit
        one_pass.side_config(cfg, "dq-writer-m128", torch.device("cpu"), torch.bfloat16)
    out = tmp_path / "one_pass.json"
    args = ["--configs", "tiny_ab", "--rounds", "1", "--dtype", "fp32", "--out", str(out)]
    with pytest.raises(SystemExit):
        one_pass.main([*args, "--sides", "two-pass,one-pass-s5"])


def test_a_windowed_config_is_called_with_its_window(tmp_path, device):
    """Each side calls mmsparse with the config's sliding window, which the reference applies: called without it,
    every side failed its check (and the times were of another mask)."""
    out = tmp_path / "one_pass.json"
    dtype = "bf16" if device.type == "cuda" else "fp32"
    assert ALL_CONFIGS["tiny_window"].window
    assert one_pass.main(["--configs", "tiny_window", "--rounds", "1", "--dtype", dtype, "--sides", "two-pass,one-pass",
                          "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["two-pass_check"] == "ok" and row["one-pass_check"] == "ok", row


def test_two_pass_tile_sides():
    """"two-pass-m<M>-s<N>" runs the two passes with the Gluon dK/dV kernel at M query rows a step and N stages,
    refused where the kernel cannot take the tile; a Gluon kernel, so a CPU run refuses the side."""
    import torch

    from benchmarks.configs import ALL_CONFIGS
    from mmsparse.attention.config import _GLUON_DKDV

    d64, d128 = ALL_CONFIGS["mm13k_hub_d64"], ALL_CONFIGS["mm13k_hub"]
    assert one_pass.side_kind("two-pass-m64-s3") == "two-pass" and one_pass.gluon_dkdv_side("two-pass-m64-s3")
    assert not one_pass.gluon_dkdv_side("two-pass") and not one_pass.gluon_dkdv_side("dq-writer-s3")
    config = one_pass.side_config(d64, "two-pass-s3", torch.device("cpu"), torch.bfloat16)
    assert config.bwd_dkdv == replace(_GLUON_DKDV[64], gluon_stages=3)
    config = one_pass.side_config(d128, "two-pass-m64-s3", torch.device("cpu"), torch.bfloat16)
    assert config.bwd_dkdv == replace(_GLUON_DKDV[128], gluon_stages=3)
    with pytest.raises(ValueError, match="query rows"):  # the kernel's 64 rows a step
        one_pass.side_config(d64, "two-pass-m128", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):  # 235,520 B of 232,448
        one_pass.side_config(d128, "two-pass-s5", torch.device("cpu"), torch.bfloat16)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            one_pass.main(["--configs", "tiny_ab", "--rounds", "1", "--sides", "two-pass,two-pass-s3"])


def test_the_two_pass_side_runs_two_passes_over_packs_of_short_samples(monkeypatch):
    """deterministic=True's default over a pack of short samples is the ordered dQ writer, not two passes: the
    two-pass sides turn it off, so that they time what their name says (on an H200's config, as on the GPU)."""
    import torch

    from benchmarks.configs import ALL_CONFIGS
    from mmsparse.attention.config import cuda_kernel_config
    from mmsparse.attention.plan import plan_attention

    monkeypatch.setattr(one_pass, "kernel_config", lambda head_dim, dtype, device: cuda_kernel_config(head_dim, dtype))
    cfg = ALL_CONFIGS["pack_64k_x512"]
    sample_len = cfg.seq_k // len(cfg.rows)

    def plan(config):
        return plan_attention(config, 1, cfg.heads_q, cfg.heads_kv, cfg.seq_k, cfg.seq_k, torch.device("cpu"),
                              sample_len, sms=132, deterministic=True)

    default = cuda_kernel_config(cfg.head_dim, torch.bfloat16)
    assert plan(default).dq is None and plan(default).dkdv.ordered  # the default: the ordered dQ writer
    for side in ("two-pass", "two-pass-s3"):
        two = plan(one_pass.side_config(cfg, side, torch.device("cuda"), torch.bfloat16))
        assert two.dq is not None and not two.dkdv.one_pass, side
    writer = plan(one_pass.side_config(cfg, "dq-writer-ordered", torch.device("cuda"), torch.bfloat16))
    assert writer.dq is None and writer.dkdv.ordered


def test_ordered_head_section_sides(monkeypatch):
    """"dq-writer-ordered-h<K>" runs the ordered dQ writer with its programs taking each key block for the KV
    heads of K query heads in turn ("dq-writer-ordered": the config's sections, "-h1": one head after the other);
    K past the config's bound is refused with the reason. The two passes stay two passes over a mask that
    deterministic=True would otherwise run in the ordered writer (launched longest first)."""
    import torch

    from benchmarks.configs import ALL_CONFIGS
    from mmsparse.attention.config import cuda_kernel_config
    from mmsparse.attention.plan import plan_attention

    monkeypatch.setattr(one_pass, "kernel_config", lambda head_dim, dtype, device: cuda_kernel_config(head_dim, dtype))
    assert one_pass.side_kind("dq-writer-ordered-h4") == "dq-writer-ordered"
    assert one_pass.side_head_section("dq-writer-ordered-h4") == 4 and one_pass.side_head_section("dq-writer") is None
    assert one_pass.side_kind("dq-writer-h4") == "dq-writer-h4"  # the unordered writer has no sections: refused
    cfg = ALL_CONFIGS["mm13k_cyclic"]

    def plan(side):
        config = one_pass.side_config(cfg, side, torch.device("cuda"), torch.bfloat16)
        return plan_attention(config, 1, cfg.heads_q, cfg.heads_kv, cfg.seq_k, cfg.seq_k, torch.device("cpu"),
                              sms=132, deterministic=True, longest_first=True)

    assert plan("dq-writer-ordered-h8").dkdv.ordered and plan("dq-writer-ordered-h8").dkdv.head_section == 8
    assert plan("dq-writer-ordered-h1").dkdv.head_section == 1
    assert plan("dq-writer-ordered").dkdv.head_section == cuda_kernel_config(128, torch.bfloat16).ordered_head_section
    assert plan("two-pass").dq is not None and plan("two-pass-s3").dq is not None
    with pytest.raises(ValueError, match="ordered_head_section"):
        one_pass.side_config(cfg, "dq-writer-ordered-h17", torch.device("cuda"), torch.bfloat16)
