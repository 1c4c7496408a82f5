"""tools.fwd_turns: the settings it compares, and a clear refusal where there is no Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from mmsparse.attention.config import TURN_SCHEMES, cuda_kernel_config
from tools import fwd_turns


def test_settings_cover_every_turn_scheme_and_pingpong_where_it_fits():
    base = cuda_kernel_config(128, torch.bfloat16)
    d128 = fwd_turns.settings(base, 128)
    assert list(d128) == [*TURN_SCHEMES, "no_pingpong_2stages", "no_pingpong_3stages"]
    for turns in TURN_SCHEMES:
        cfg = d128[turns]
        assert cfg.fwd.turns == turns and cfg.fwd_short_samples.turns == turns and cfg.fwd.pingpong
    for stages in (2, 3):
        cfg = d128[f"no_pingpong_{stages}stages"]
        assert not cfg.fwd.pingpong and cfg.fwd.gluon_stages == stages and cfg.fwd_short_samples == \
            base.fwd_short_samples
    d64 = fwd_turns.settings(cuda_kernel_config(64, torch.bfloat16), 64)
    assert next(iter(d64)) == "no_pingpong" and d64["no_pingpong"] == cuda_kernel_config(64, torch.bfloat16)
    assert {(c.fwd.gluon_stages, c.fwd.turns) for k, c in d64.items() if k.startswith("pingpong")} == {
        (s, t) for s in (2, 3) for t in TURN_SCHEMES}
    deeper = {k: c for k, c in d64.items() if k.startswith("no_pingpong_")}  # the config's tile has 2 stages
    assert {k: (c.fwd.gluon_stages, c.fwd.pingpong) for k, c in deeper.items()} == {
        "no_pingpong_3stages": (3, False), "no_pingpong_4stages": (4, False)}
    # D=256: 3 stages of 64 keys beside Q do not fit a CTA, so only 2-stage ping-pong is compared
    d256 = fwd_turns.settings(cuda_kernel_config(256, torch.bfloat16), 256)
    assert next(iter(d256)) == "no_pingpong" and {(c.fwd.gluon_stages, c.fwd.turns) for k, c in d256.items()
                                                  if k != "no_pingpong"} == {(2, t) for t in TURN_SCHEMES}
    assert not any(k.startswith("no_pingpong_") for k in d256)  # 3 stages of 64 keys beside Q do not fit


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where there is no GPU")
def test_without_a_hopper_gpu_it_says_so(capsys):
    assert fwd_turns.main(["--configs", "mm13k_hub"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err
