"""The per-rank context-parallel benchmark (tools/cp_local.py): each rank's local problem, run without a process
group, put back in sequence order equals the single-process attention and the float64 reference (output and all
three gradients); and the harness end to end on a tiny config, with its table's fields."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.configs import live_pairs
from benchmarks.cp_rank import local_backward, local_forward
from mmsparse import mbs_attention, reference_mask
from mmsparse.distributed import RankProblem
from tests.helpers import check_outputs
from tools import cp_local

CPU = torch.device("cpu")


def _run_ranks(cfg: cp_local.LocalConfig, world: int, full: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Every rank's local forward and backward on its share of ``full`` (q, k, v, dout, on one device), assembled
    in sequence order: (out, dq, dk, dv). Rows no rank writes stay NaN; dK/dV add each rank's own and gathered keys'
    parts."""
    q, k, v, _ = full
    hkv = k.shape[1]
    out, dq = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    scale = q.shape[-1] ** -0.5
    for rank in range(world):
        # the config's chunks (16 tokens on any device): several ranks, each with several chunks
        problem = RankProblem(cfg.topology, cfg.seg_lens, rank, world, causal=cfg.causal, tile=cfg.tile)
        x = cp_local.rank_inputs(problem, cfg.shape, torch.float32, q.device, full=full)
        o, lse = local_forward(problem, x, scale)
        dq_l, dkv_l, dkv_g = local_backward(problem, x, o, lse, scale)
        index, gathered = problem.token_index.to(q.device), problem.gathered_positions().to(q.device)
        out[:, :, index], dq[:, :, index] = o, dq_l
        for target, part in ((dk, slice(0, hkv)), (dv, slice(hkv, 2 * hkv))):
            if dkv_l is not None:  # None: one piece over the gathered keys, own keys among them
                target.index_add_(2, index, dkv_l[:, part])
            target.index_add_(2, gathered, dkv_g[:, part])
    return out, dq, dk, dv


@pytest.mark.parametrize("name, world", [("tiny_cyclic", 3), ("tiny_hub_causal", 2), ("tiny_pair_types", 3)],
                         ids=lambda v: str(v))
def test_local_problems_put_together_equal_one_process(name, world, device):
    cfg = cp_local.TINY[name]
    s, seq = cfg.shape, sum(cfg.seg_lens)
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(s.batch, h, seq, s.head_dim, generator=gen).to(device)
            for h in (s.heads_q, s.heads_kv, s.heads_kv, s.heads_q)]
    assert all(RankProblem(cfg.topology, cfg.seg_lens, r, world, causal=cfg.causal, tile=cfg.tile).local_len
               for r in range(world)), "every rank has tokens"
    out, dq, dk, dv = _run_ranks(cfg, world, full)
    topology = [list(r) for r in cfg.topology]
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    single = mbs_attention(q, k, v, topology, cfg.seg_lens, causal=cfg.causal)
    single.backward(full[3])
    for got, want, label in ((out, single, "out"), (dq, q.grad, "dq"), (dk, k.grad, "dk"), (dv, v.grad, "dv")):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4, msg=lambda m, label=label: f"{label}: {m}")
    qd, kd, vd = (t.clone() for t in full[:3])
    qd.grad, kd.grad, vd.grad = dq, dk, dv
    check_outputs(qd, kd, vd, out, full[3], reference_mask(topology, cfg.seg_lens, seq, causal=cfg.causal))


def test_rank_problem_needs_no_process_group():
    problem = RankProblem(cp_local.HUB, (20, 70, 41), 1, 4, causal=True)
    assert problem.plan.world_size == 4 and problem.rank == 1
    assert torch.equal(problem.token_index, problem.plan.token_index(1))
    assert problem.live_pairs == problem.plan.live_pairs[1]
    rows = {(p.q_rows.start, p.q_rows.stop) for p in problem.pieces(CPU)}
    assert sum(b - a for a, b in rows) == problem.local_len, "every local query in one group of pieces"
    with pytest.raises(ValueError, match="rank must be"):
        RankProblem(cp_local.HUB, (20, 70, 41), 4, 4)


def test_harness_end_to_end(tmp_path, capsys):
    assert cp_local.main(["--configs", "tiny_cyclic", "--worlds", "2,3", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "cp_local.json").read_text())
    assert {"gpu", "torch", "triton", "commit"} <= set(record["env"])
    assert record["targets"] == {"live_pairs": 1.05, "fwdbwd_ms": 1.10}
    cfg = cp_local.TINY["tiny_cyclic"]
    total = live_pairs(cfg.topology, cfg.seg_lens, causal=cfg.causal)
    assert [(s["config"], s["world_size"]) for s in record["summary"]] == [("tiny_cyclic", 2), ("tiny_cyclic", 3)]
    for s in record["summary"]:
        ranks = [r for r in record["ranks"] if r["world_size"] == s["world_size"]]
        assert [r["rank"] for r in ranks] == list(range(s["world_size"]))
        assert sum(r["live_pairs"] for r in ranks) == total
        assert sum(r["tokens"] for r in ranks) == sum(cfg.seg_lens)
        for r in ranks:
            assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwdbwd_ms"] == r["fwd_ms"] + r["bwd_ms"]
            assert r["pieces"] >= 1 and 0 < r["gathered"] <= sum(cfg.seg_lens)
        pairs = [r["live_pairs"] for r in ranks]
        assert s["live_pairs_ratio"] == pytest.approx(max(pairs) / (sum(pairs) / len(pairs)))
        for key in ("fwd_ms_ratio", "bwd_ms_ratio", "fwdbwd_ms_ratio"):
            assert s[key] >= 1.0
        assert s["pairs_ok"] == (s["live_pairs_ratio"] <= 1.05) and s["time_ok"] == (s["fwdbwd_ms_ratio"] <= 1.10)
    table = (tmp_path / "cp_local.md").read_text()
    assert "| tiny_cyclic | 3 |" in table and "live pairs max/mean" in table and "fwd+bwd max/mean" in table
    assert "rank 2:" in capsys.readouterr().out  # progress per rank


def test_configs_are_the_plan_benchmarks():
    assert set(cp_local.CONFIGS) == {"cyclic_43k", "hub_causal_256k", "long_1m"}
    assert all(c.shape == cp_local.Shape(1, 16, 4, 128) for c in cp_local.CONFIGS.values())
    assert (cp_local.CONFIGS["long_1m"].warmup, cp_local.CONFIGS["long_1m"].reps) == (1, 2)
