"""tools.d256_probe: the settings it compares, the mask it times, and a one-line refusal where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from mmsparse.attention.config import GLUON_D256, HOPPER
from tools import d256_probe


def test_settings_put_tl_first_then_the_candidates():
    plain = d256_probe.settings(HOPPER, sweep=False)
    assert list(plain) == ["tl", "gluon", "gluon dkdv"]
    assert not (plain["tl"].fwd.gluon or plain["tl"].bwd_dq.gluon or plain["tl"].bwd_dkdv.gluon)
    for label in ("gluon", "gluon dkdv"):
        assert plain[label].fwd == GLUON_D256["fwd"] and plain[label].bwd_dq == GLUON_D256["dq"]
    assert not plain["gluon"].bwd_dkdv.gluon and plain["gluon dkdv"].bwd_dkdv == GLUON_D256["dkdv"]
    swept = d256_probe.settings(HOPPER, sweep=True)
    assert list(swept)[:3] == list(plain)
    assert len(swept) == 3 + len(d256_probe.SWEEP_FWD) + len(d256_probe.SWEEP_DQ)
    assert all(cfg.bwd_dkdv == plain["gluon"].bwd_dkdv for label, cfg in swept.items() if label != "gluon dkdv")


def test_mask_is_gemma3_like_at_16k():
    cfg = d256_probe.GEMMA3_16K
    assert (cfg.seq_k, cfg.heads_q, cfg.heads_kv, cfg.head_dim) == (16384, 16, 4, 256)
    assert cfg.seg_lens[1::2] == (256,) * 16 and 0 < cfg.density < 0.6


def test_run_compares_and_times_every_setting(device):
    """The record's plumbing on a tiny transfusion mask (through the interpreter on a CPU): errors against the first
    setting and the float32 reference, one time a round and pass, ratios to the first setting."""
    from dataclasses import replace

    from benchmarks.configs import BenchConfig, transfusion_layout
    from mmsparse.attention.config import kernel_config

    cfg = BenchConfig("tiny", 1, 2, 1, 16, *transfusion_layout(2, 8, (3, 8)))
    base = kernel_config(cfg.head_dim, torch.bfloat16, device)
    variants = {"a": base, "b": replace(base, fwd=replace(base.fwd, block_n=base.fwd.block_n * 2))}
    ticks = iter(range(1, 100))

    def bench(fn, **kwargs):
        fn()
        return float(next(ticks))

    record = d256_probe.run(1, variants, cfg, device, bench)
    assert list(record["rows"]) == ["a", "b"] and record["reference"] == "a"
    for row in record["rows"].values():
        assert max(row["vs_float32"].values()) < 2e-2 and max(row["vs_tl"].values()) < 2e-2
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and set(row["kernels"]) == {"forward", "dq", "dkdv"}
    assert record["rows"]["a"]["fwd_speedup"] == 1.0
    assert "| a |" in d256_probe.markdown(record)

    dropped = d256_probe.run(1, variants, cfg, device, bench, dropout_p=0.25)  # the same seed for both settings
    assert dropped["dropout_p"] == 0.25 and "attention dropout 0.25" in d256_probe.markdown(dropped)
    assert max(dropped["rows"]["b"]["vs_tl"].values()) < 2e-2 and dropped["rows"]["b"]["vs_float32"] == {}
    assert max(dropped["rows"]["a"]["vs_tl"].values()) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where there is no GPU")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert d256_probe.main([]) == 2
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and "needs a CUDA GPU" in out.out and not out.err
