"""The benchmark's FlashAttention-4 dense row (``fa4_dense``) and its head-dim-256 mask rows: opt-in, skipped with
its reason where it cannot run (this CPU), the rows shaped as Gemma 3's."""

from __future__ import annotations

import pytest
import torch

from benchmarks.baselines import DEFAULT_IMPLS, IMPLS, SETUPS, setup_fa4_dense
from benchmarks.cases import Case
from benchmarks.configs import CAUSAL, GROUPS, MASK_CONFIGS, TINY
from benchmarks.errors import Skip
from benchmarks.run import parse_args, select
from benchmarks.timing import Timing

CPU = torch.device("cpu")


def test_fa4_dense_is_an_opt_in_impl():
    assert "fa4_dense" in IMPLS and "fa4_dense" in SETUPS and "fa4_dense" not in DEFAULT_IMPLS
    assert select(parse_args(["--impls", "mmsparse,fa4_dense"]))[1] == ["mmsparse", "fa4_dense"]


def test_fa4_dense_is_skipped_with_its_reason_on_cpu():
    case = Case.make(TINY["tiny_cyclic"], CPU, torch.float32)
    with pytest.raises(Skip, match="Hopper's \\(sm_90\\)"):
        setup_fa4_dense(case, Timing(CPU, warmup=0, rep=0, cpu_warmup=1, cpu_reps=1))


def test_the_head_dim_256_rows_are_what_they_say():
    vlm, window = MASK_CONFIGS["vlm32k_d256"], MASK_CONFIGS["vlm32k_d256_window1k"]
    for cfg in (vlm, window):
        assert (cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim, cfg.seq_k) == (1, 8, 4, 256, 32768)
        assert cfg.seg_lens == MASK_CONFIGS["vlm32k_window4k"].seg_lens and cfg.seg_lens[1::2] == (256,) * 32
    assert vlm.window is None and window.window == 1024
    assert window.live_pairs < vlm.live_pairs < 32768 * 32769 // 2 + 32 * 256 * 255 // 2 + 1
    dense = MASK_CONFIGS["dense_causal_d256"]
    assert (dense.heads_q, dense.heads_kv, dense.head_dim, dense.seg_lens) == (16, 4, 256, (16384,))
    assert dense.topology == ((CAUSAL,),) and dense.live_pairs == 16384 * 16385 // 2 and dense.dense_causal
    assert {"vlm32k_d256", "vlm32k_d256_window1k", "dense_causal_d256"} <= set(GROUPS["masks"])
