"""The context-parallel performance model (tools/cp_model.py, benchmarks/cp_traffic.py): its arithmetic on the plan."""

from __future__ import annotations

import pytest

from benchmarks.cp_traffic import exchange_bytes
from tools import cp_model


def test_one_gpu_is_the_baseline_and_more_bandwidth_never_hurts():
    table = cp_model.rows()
    for row in table:
        speeds = [row[f"speedup_{bw / 1e9:.0f}"] for bw in cp_model.BANDWIDTHS]
        hidden = [row[f"speedup_{bw / 1e9:.0f}_overlap"] for bw in cp_model.BANDWIDTHS]
        if row["world_size"] == 1:
            assert row["exchange_mib"] == 0 and speeds == pytest.approx([1.0] * 3)
        assert speeds == sorted(speeds)  # faster links, faster steps
        assert all(h >= s for h, s in zip(hidden, speeds))  # hiding the exchange can only help
        assert max(hidden) <= row["world_size"] * 1.001  # no more than linear: the plan balances live pairs


def test_the_exchange_counts_what_the_busiest_rank_fetches_and_serves():
    # rank 0 fetches 10 bytes of K/V and serves 4; rank 1 fetches 1 and serves 2
    summary = {"recv_bytes": [10, 1], "sent_bytes": [4, 2]}
    # rank 0, inbound: K/V twice (2 * 10) and the fp32 dK/dV of what it serves (2 * 4)
    assert exchange_bytes(summary) == 2 * 10 + 2 * 4
    # the return in the inputs' dtype (one piece a rank): rank 0's outbound, K/V served twice (2 * 4) and the
    # dK/dV of what it fetched (10), is then below its inbound (2 * 10 + 4)
    assert exchange_bytes(summary, dkv_ratio=1) == 2 * 10 + 4
    assert exchange_bytes({"recv_bytes": [1], "sent_bytes": [10]}, dkv_ratio=1) == 2 * 10 + 1
    # the fetched K/V kept for the backward: fetched once; rank 0's outbound (4 + 2 * 10) now outweighs its inbound
    assert exchange_bytes(summary, fetches=1) == 4 + 2 * 10


def test_compute_follows_the_flops_of_a_live_pair():
    pairs = 1e9
    flops = 4 * cp_model.HEADS_Q * cp_model.HEAD_DIM * pairs
    assert cp_model.step_seconds(pairs) == pytest.approx(flops / cp_model.RATE_FWD + 2.5 * flops / cp_model.RATE_BWD)
