"""The fuzzer's CPU mode, so that it cannot rot: a few random cases through the interpreter, wrong masks that it
must catch, its two reference mask builders against each other, what its draws cover and that they keep to their
budgets, the reference without autograd, the warm-up and its worker processes, its record (and a merged one) and a
repro."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

import mmsparse.functional
from mmsparse import reference_mask
from tests.stress import fuzz

pytestmark = pytest.mark.stress  # the stress tools' smoke tests: pytest -m stress

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # draw_case reads only the device type


def test_random_cases_pass(device):
    if device.type != "cpu":
        pytest.skip("the GPU runs python -m tests.stress.fuzz --minutes N")
    # 6 cases of seed 1785 draw every feature the CPU's draws have (of the seeds below 3000 whose first cases do,
    # the least reference work: 8.5k pairs, 10 s; seed 7 needs 15 cases, 104k pairs, 24 s); the GPU-only ones
    # (k > 600, packs of > 100 samples, D=64/128) are left out.
    result = fuzz.fuzz(seed=1785, device=device, minutes=None, cases=6)
    assert result["cases"] == 6
    assert result["failures"] == [], result["failures"]
    gpu_only = {"k > 600", "packed, > 100 samples", "D=64", "D=128"}
    for tag in set(fuzz.FEATURES) - gpu_only:
        assert result["coverage"].get(tag), tag


def _causal_as_full(types: torch.Tensor) -> torch.Tensor:
    return torch.where(types == fuzz.CAUSAL, fuzz.FULL, types).to(torch.int8)


def _cheap(case: fuzz.Case) -> bool:
    return case.seq_k >= 8 and case.seq_k * case.batch * case.heads_q <= 400 and not case.dense


def _wrong_types_matter(case: fuzz.Case) -> bool:
    """CAUSAL read as FULL changes the case's mask (a causal pair whose later keys exist)."""
    if case.pair_types != "012" or case.causal or not _cheap(case):
        return False
    return _mask_changes(case, fuzz._allowed_rows(case, CPU, _causal_as_full(fuzz.types_of(case))))


def _causal_flag_matters(case: fuzz.Case) -> bool:
    """Dropping the causal flag changes the case's mask (some FULL pair, made causal by the flag, has later keys):
    a case of CAUSAL and NONE pairs alone reads the same either way."""
    if not case.causal or not _cheap(case):
        return False
    return _mask_changes(case, fuzz._allowed_rows(dataclasses.replace(case, causal=False), CPU))


def _mask_changes(case: fuzz.Case, wrong) -> bool:
    rows = torch.arange(case.seq_q)
    right = fuzz._allowed_rows(case, CPU)
    return any(int((right(b, rows) != wrong(b, rows)).sum()) >= 4 for b in range(len(case.seg_lens)))


@pytest.mark.parametrize("wrong", ["causal flag dropped", "CAUSAL as FULL", "CAUSAL as FULL in a pack"])
def test_a_wrong_mask_is_caught(device, monkeypatch, wrong):
    """The check can fail: with the reference's mask wrong (the causal flag dropped, or the pair type CAUSAL read
    as FULL), a case that depends on it must report errors."""
    original = fuzz._allowed_rows
    if wrong == "causal flag dropped":
        seed = next(s for s in range(1000) if _causal_flag_matters(fuzz.draw_case(s, device)))
        patched = (lambda c, d, types=None: original(dataclasses.replace(c, causal=False), d, types))
    else:
        packed = wrong.endswith("pack")
        seed = next(s for s in range(3000) if fuzz.draw_case(s, CPU).packed == packed
                    and _wrong_types_matter(fuzz.draw_case(s, CPU)))
        patched = (lambda c, d, types=None: original(c, d, _causal_as_full(fuzz.types_of(c))))
    case = fuzz.draw_case(seed, device)
    assert fuzz.run_case(case, device) == [], "the case passes with the right mask"
    # A wrong reference mask is the only way to a case the fuzzer must fail.
    monkeypatch.setattr(fuzz, "_allowed_rows", patched)
    assert fuzz.run_case(case, device)


def _all_rows(allowed, case: fuzz.Case) -> torch.Tensor:
    rows = torch.arange(case.seq_q)
    return torch.stack([allowed(b, rows) for b in range(1 if case.packed else case.batch)])


def test_mask_builders_agree():
    """The reference's mask from token ids (large S) equals the library's dense reference mask (small S) on drawn
    cases: pair types, many segments, per-sample lengths with padding, q_start, causal, packs."""
    checked = 0
    for seed in range(150):
        for dev_type in (CPU, GPU):
            case = fuzz.draw_case(seed, dev_type)
            if not fuzz._dense_reference_fits(case) or case.seq_q * case.seq_k * case.batch > 1 << 18:
                continue
            types = fuzz.types_of(case)
            dense = _all_rows(fuzz._mask_rows_from_dense(case, types, CPU), case)
            ids = _all_rows(fuzz._mask_rows_from_ids(case, types, CPU), case)
            assert torch.equal(dense, ids), f"seed {seed} ({dev_type.type} draw): {case}"
            checked += 1
    assert checked > 200


def test_ids_mask_of_a_large_pack():
    """A GPU-sized pack (thousands of samples, too large for the dense reference): each sampled row sees exactly
    its own sample's keys, as the dense reference of that sample alone has them."""
    seed = next(s for s in range(5000) if fuzz.draw_case(s, GPU).packed and len(fuzz.draw_case(s, GPU).seg_lens) > 1000)
    case = fuzz.draw_case(seed, GPU)
    assert not fuzz._dense_reference_fits(case)
    allowed = fuzz._mask_rows_from_ids(case, fuzz.types_of(case), CPU)
    ends = torch.tensor([sum(r) for r in case.seg_lens]).cumsum(0)
    rows = torch.randperm(case.seq_q, generator=torch.Generator().manual_seed(0))[:40].sort().values
    got = allowed(0, rows)
    for i, row in enumerate(rows.tolist()):
        n = int(torch.searchsorted(ends, torch.tensor(row), right=True))
        lo, hi = (int(ends[n - 1]) if n else 0), int(ends[n])
        own = reference_mask(fuzz.types_of(case), case.seg_lens[n], hi - lo, causal=case.causal)[0, row - lo]
        assert not got[i, :lo].any() and not got[i, hi:].any()
        assert torch.equal(got[i, lo:hi], own)


def test_draws_cover_the_masks():
    """What the draws vary, on each device: pair types 0/1/2, k past 32 (and past 600, up to 4095 only on the
    GPU), packs of many samples in both layouts, zero-length segments, q_start, dense masks, dropout; S stays
    bounded and the compiled menu small."""
    for dev_type, draws in ((CPU, 600), (GPU, 2000)):
        master = random.Random(1)
        cases = [fuzz.draw_case(master.getrandbits(64), dev_type) for _ in range(draws)]
        tally = {tag: sum(tag in fuzz.features(c) for c in cases) for tag in fuzz.FEATURES}
        for tag in ("bit path (0/1, k <= 32)", "segment codes", "pair types 0/1/2", "k > 32", "k > 600", "packed",
                    "packed, [total, H, D]", "per-sample lengths", "q_start", "dense attn_mask", "dropout", "GQA",
                    "lengths as a tensor", "causal", "fewer queries than keys"):
            assert tally[tag], f"no {dev_type.type} draw has {tag}"
        assert tally["pair types 0/1/2"] > draws / 3
        assert any(0 in row for c in cases for row in c.seg_lens)
        assert {c.head_dim for c in cases} == ({64, 128} if dev_type is GPU else {16, 32, 40})
        assert {(c.heads_q, c.heads_kv) for c in cases} == set(fuzz.HEADS)
        if dev_type is GPU:
            assert max(c.k for c in cases) > 2048
            assert max(len(c.seg_lens) for c in cases if c.packed) > 1000
            assert max(c.seq_k for c in cases) <= 1 << 17
            assert all(c.seq_k <= 8192 for c in cases if c.k > 600)
        else:
            assert max(c.k for c in cases) <= fuzz.CPU_MAX_K
            assert max(c.seq_k for c in cases) <= 200
        for c in cases:
            assert all(sum(r) <= c.seq_k for r in c.seg_lens) and c.seq_k >= 1
            if c.packed or len(c.seg_lens) == 1:
                assert sum(map(sum, c.seg_lens)) == c.seq_k
            if c.q_start is not None:
                assert all(0 <= s <= c.seq_k - c.seq_q for s in c.q_start)


def test_types_of():
    """Topologies are drawn again from the case (never stored for large k), 0/1 or 0/1/2 as the case says."""
    for seed in range(100):
        case = fuzz.draw_case(seed, CPU)
        types = fuzz.types_of(case)
        assert types.shape == (case.k, case.k) and types.dtype == torch.int8
        assert torch.equal(types, fuzz._draw_types.__wrapped__(case.k, case.style, case.pair_types, case.topo_seed))
        assert bool((types == fuzz.CAUSAL).any()) == (case.pair_types == "012")
        assert set(types.unique().tolist()) <= {0, 1, 2}


def test_sampled_rows_hit_boundaries():
    edges = torch.tensor([5, 100, 101, 4000, 9999])
    rows = fuzz._sample(10000, 0, edges, torch.Generator().manual_seed(0))
    assert rows.numel() <= fuzz.SAMPLED_ROWS and torch.equal(rows, rows.unique())
    assert set(edges.tolist()) <= set(rows.tolist())
    assert torch.equal(fuzz._sample(7, 3, edges, torch.Generator()), torch.arange(7))
    assert fuzz._runs(torch.tensor([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 1), (7, 2)]


def test_record(tmp_path, monkeypatch):
    """--out writes fuzz.json and fuzz.md: case count, seed, minutes, commit, versions, each failure's repro."""
    monkeypatch.setattr(fuzz, "run_case", lambda case, device: ["out[b=0, kv head 0]: wrong"] if case.k > 3 else [])
    assert fuzz.main(["--cases", "6", "--seed", "3", "--device", "cpu", "--out", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "fuzz.json").read_text())
    assert record["cases"] == 6 and record["seed"] == 3 and record["minutes"] >= 0
    assert {"commit", "torch", "triton", "device", "gpu", "coverage", "memory", "cases_per_second"} <= set(record)
    assert record["warmups"] == [] and record["seeds"] == [3]
    assert record["failures"], "seed 3 draws a case with more than 3 segments"
    md = (tmp_path / "fuzz.md").read_text()
    for failure in record["failures"]:
        assert failure["repro"] == f"python -m tests.stress.fuzz --repro {failure['seed']} --device cpu"
        assert f"`{failure['repro']}`: out[b=0, kv head 0]: wrong" in md
    assert "6 cases in" in md and record["commit"] in md


def test_repro_runs_one_case(capsys):
    assert fuzz.main(["--repro", "12345", "--device", "cuda" if torch.cuda.is_available() else "cpu"]) == 0
    assert "ok" in capsys.readouterr().out


def test_a_gradient_zero_in_exact_arithmetic_passes(device):
    """One query over one key with dropout, bf16: dq and dk are 0 in exact arithmetic, and the kernels, which take
    delta from the stored output (rounded to bf16), leave them at a few units of bf16. The error model must allow
    that: the bf16 reference rounds dP and delta alike, so they cancel and it expects ~1e-7 (this case failed
    before the float32 reference with delta from the rounded output joined the error models). The seed's CPU draw,
    run on the session's device: a GPU draws other sizes from a seed."""
    case = fuzz.draw_case(6008027599163048855, CPU)
    assert (case.seq_q, case.seq_k, case.dtype) == (1, 1, "bf16") and case.dropout_p > 0
    with fuzz.poisoned_empty():
        assert fuzz.run_case(case, device) == []


# The cases of the first 5-minute GPU run that ran out of memory: the reference, run with autograd on (q, k and v
# were the leaves), kept every step's [chunk, Sk] float32 tensors, O(Hq * Sq * Sk) (77 GiB at S = 30k); the one at
# S = 100 failed on the memory the OOMs before it left in torch's cache.
FIRST_RUN_OOMS = (16186967436900617235, 14015392492810597095, 15452065013078747542, 16723719908327564050,
                  11883373483010948178)


def test_draws_keep_to_their_budgets():
    """Every draw's estimated peak fits the memory budget and its reference work WORK_MAX, on each device and
    under a small budget too; sizes still span S from 1 to 64k and B from 1 to 8 on the GPU, most S within 4k;
    a seed draws one case."""
    for dev_type, draws in ((CPU, 600), (GPU, 3000)):
        master = random.Random(2)
        seeds = [master.getrandbits(64) for _ in range(draws)]
        seeds += list(FIRST_RUN_OOMS) if dev_type is GPU else []
        cases = [fuzz.draw_case(s, dev_type) for s in seeds]
        budget, work = fuzz.memory_budget(dev_type), fuzz.WORK_MAX[dev_type.type]
        for c in cases:
            assert fuzz.estimate_bytes(c) <= budget and fuzz.case_work(c) <= work, c.seed
        if dev_type is GPU:
            lengths = [c.seq_k for c in cases]
            assert min(lengths) == 1 and max(lengths) > 60_000 and max(lengths) <= 1 << 17
            assert sum(s <= 4096 for s in lengths) > 0.65 * len(lengths)
            assert sum(s > 8192 for s in lengths) > 0.12 * len(lengths)  # the backward's side stream
            assert {c.batch for c in cases} == {1, 2, 4, 8}
            assert any(c.batch == 8 and c.seq_k > 4096 for c in cases)
            assert sum(c.dense for c in cases) > draws / 20
        assert fuzz.draw_case(seeds[5], dev_type) == cases[5]
    small = 512 << 20
    for seed in range(300):
        case = fuzz.draw_case(seed, GPU, budget=small)
        assert fuzz.estimate_bytes(case) <= small, seed


def test_reference_runs_without_autograd(device, monkeypatch):
    """The reference and the comparisons run with autograd off and on inputs that need no gradient (else every
    step's tensors are kept: the first GPU runs' OOMs), and nothing of a case stays in mmsparse's mask cache."""
    calls = []
    original = fuzz.reference_group_rows

    def spy(q, k, v, grad_out, *args, **kwargs):
        calls.append(torch.is_grad_enabled() or any(t.requires_grad for t in (q, k, v, grad_out)))
        return original(q, k, v, grad_out, *args, **kwargs)

    monkeypatch.setattr(fuzz, "reference_group_rows", spy)
    seed = next(s for s in range(200) if _cheap(fuzz.draw_case(s, device)) and not fuzz.draw_case(s, device).packed)
    case, problems = fuzz.run_one(seed, device)
    assert problems == [] and calls and not any(calls)
    assert not mmsparse.mask.cache.CACHE.masks()


def test_kernel_keys():
    """The warm-up's model of what compiles, from the plan for an H100: the menu's fields split the variants,
    lengths do not; a long half-precision case on many programs takes the Gluon forward, with dropout or split key
    lists the tl one; the list builders' variants are the tiles the passes read."""
    case = fuzz.Case(1, "bf16", 64, 4, 2, 8, 3, "iid", "01", 1, [[4000, 4000, 192]], 8192, 8192, None, False,
                     False, False, 0.0)
    keys = fuzz.kernel_keys(case)
    fwd = next(k for k in keys if k[0] == "fwd")
    assert fwd[-1] is True and (fwd[-3].block_m, fwd[-3].block_n) == (128, 128)  # the Gluon forward's D=64 tile
    lists = {k[2:] for k in keys if k[0] == "bit lists" and k[1] == 4}  # 3 segments: 4 bits
    assert lists == {(128, 128, False, False), (64, 128, True, False), (128, 64, False, False)}  # fwd, dK/dV, dQ
    assert fuzz.kernel_keys(dataclasses.replace(case, seg_lens=[[10, 4000, 4182]])) == keys
    assert not next(k for k in fuzz.kernel_keys(dataclasses.replace(case, dropout_p=0.1)) if k[0] == "fwd")[-1]
    one = dataclasses.replace(case, batch=1, heads_q=2, heads_kv=2, seq_q=4096, seq_k=4096)
    assert ("combine", 64) in fuzz.kernel_keys(one)  # 32 x 2 programs: split key lists, not Gluon
    assert not next(k for k in fuzz.kernel_keys(one) if k[0] == "fwd")[-1]
    decode = dataclasses.replace(case, seq_q=9)
    tile, pack, gluon = next(k for k in fuzz.kernel_keys(decode) if k[0] == "fwd")[-3:]
    assert (tile.block_m, tile.block_n, pack, gluon) == (16, 64, 32, False)  # 2 x 9 rows packed into 32
    for other in (dict(dtype="fp16"), dict(head_dim=128), dict(heads_q=2), dict(causal=True)):
        assert fuzz.kernel_keys(dataclasses.replace(case, **other)) != keys


def test_warmup_workers(device):
    """The warm-up's cases cover every variant its stream of draws touches; worker processes run some of them
    (checked, no failures) and report what they warmed."""
    if device.type != "cpu":
        pytest.skip("the GPU runs python -m tests.stress.fuzz --warmup (its workers compile)")
    seeds = fuzz.warmup_seeds(CPU)
    assert seeds == fuzz.warmup_seeds(CPU)
    master = random.Random(fuzz.WARMUP_SEED)
    drawn = [fuzz.draw_case(master.getrandbits(64), CPU) for _ in range(fuzz.WARMUP_DRAWS["cpu"])]
    wanted = frozenset().union(*(fuzz.kernel_keys(c) for c in drawn if fuzz.estimate_bytes(c) <= fuzz.WARMUP_MAX_BYTES
                                 and fuzz.case_work(c) <= fuzz.WARMUP_MAX_WORK))
    chosen = [fuzz.draw_case(s, CPU) for s in seeds]
    assert frozenset().union(*(fuzz.kernel_keys(c) for c in chosen)) == wanted
    assert len(seeds) < len(drawn)
    some = sorted(seeds[:6], key=lambda s: fuzz.case_work(fuzz.draw_case(s, CPU)))[:4]
    record = fuzz.warmup(CPU, jobs=2, seeds=some)
    assert record["cases"] == 4 and record["failures"] == [] and record["jobs"] == 2
    assert record["warmed"] == frozenset().union(*(fuzz.kernel_keys(fuzz.draw_case(s, CPU)) for s in some))


def test_merged_record(tmp_path, monkeypatch):
    """--merge adds a run to the fuzz.json in --out: cases and minutes summed, seeds and failures of both."""
    monkeypatch.setattr(fuzz, "run_case", lambda case, device: ["out[b=0, kv head 0]: wrong"] if case.k > 3 else [])
    fuzz.main(["--cases", "5", "--seed", "3", "--device", "cpu", "--out", str(tmp_path)])
    first = json.loads((tmp_path / "fuzz.json").read_text())
    fuzz.main(["--cases", "4", "--seed", "4", "--device", "cpu", "--out", str(tmp_path), "--merge"])
    record = json.loads((tmp_path / "fuzz.json").read_text())
    assert record["cases"] == 9 and record["seeds"] == [3, 4] and record["seed"] == 3
    assert record["minutes"] >= first["minutes"] and len(record["runs"]) == 2
    assert record["failures"][:len(first["failures"])] == first["failures"]
    assert sum(record["coverage"].values()) > sum(first["coverage"].values())
    md = (tmp_path / "fuzz.md").read_text()
    assert "9 cases in" in md and "master seeds 3, 4" in md
