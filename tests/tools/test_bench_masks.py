"""The benchmark's mask rows: packs and topologies of pair types 0/1/2 (pack_64k_x512, transfusion_16k, video_64k and
their tiny CPU versions): exact live-pair counts, the Flex mask_mod, the dense reference masks, the config groups,
and the harness end to end on the tiny rows. The sliding-window row has its own tests (test_bench_window.py)."""

import json
import random

import pytest
import torch

import mmsparse
from benchmarks.baselines import config_mask_mod, mmsparse_build
from benchmarks.cases import packed_mask, topology_mask
from benchmarks.configs import (
    ALL_CONFIGS,
    CAUSAL,
    FULL,
    GROUPS,
    HUB,
    MASK_CONFIGS,
    NONE,
    TINY,
    BenchConfig,
    expand_names,
    live_pairs,
    pack_lengths,
    transfusion_layout,
    video_layout,
)
from benchmarks.flex_mask import flex_mask_mod, segment_ids
from benchmarks.run import parse_args, select

TINY_MASKS = [TINY[n] for n in GROUPS["tiny_masks"]]


def _reference(cfg: BenchConfig) -> torch.Tensor:
    """The dense reference mask of a config, straight from mmsparse (small sizes only)."""
    if cfg.packed:
        return mmsparse.reference_packed_mask(cfg.topology, cfg.seg_lens, cfg.causal, window=cfg.window)[0]
    return mmsparse.reference_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, cfg.q_len, cfg.causal, window=cfg.window)[0]


def _random_case(rng: random.Random) -> tuple[list[list[int]], list[int], int | None, bool]:
    k = rng.randint(1, 6)
    topology = [[rng.choice((NONE, FULL, CAUSAL)) for _ in range(k)] for _ in range(k)]
    lens = [rng.choice((0, 1, rng.randint(2, 40))) for _ in range(k)]
    lens[rng.randrange(k)] += 1  # at least one position
    seq_k = sum(lens)
    seq_q = rng.choice((None, rng.randint(1, seq_k)))
    return topology, lens, seq_q, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(40))
def test_live_pairs_is_the_reference_mask_sum(seed):
    rng = random.Random(seed)
    topology, lens, seq_q, causal = _random_case(rng)
    seq_k = sum(lens)
    want = int(mmsparse.reference_mask(topology, lens, seq_k, seq_q, causal).sum())
    assert live_pairs(topology, lens, seq_q, causal) == want
    rows = [[rng.choice((0, rng.randint(1, 12))) for _ in topology] for _ in range(rng.randint(1, 5))]
    rows[0][0] += 1
    packed = int(mmsparse.reference_packed_mask(topology, rows, causal).sum())
    assert live_pairs(topology, rows, causal=causal, packed=True) == packed


@pytest.mark.parametrize("cfg", TINY_MASKS, ids=lambda c: c.name)
def test_tiny_mask_rows_count_what_the_reference_allows(cfg):
    assert cfg.live_pairs == int(_reference(cfg).sum())


def test_the_mask_rows_are_what_they_say():
    pack = MASK_CONFIGS["pack_64k_x512"]
    assert pack.packed and len(pack.rows) == 512 and pack.seq_k == 65536 and pack.topology == HUB and pack.causal
    assert all(r[0] >= 1 and r[1] >= 1 for r in pack.rows) and any(r[2] == 0 for r in pack.rows)
    assert pack.live_pairs == sum(live_pairs(HUB, r, causal=True) for r in pack.rows)
    assert pack.rows == pack_lengths(512, ((16, 64), (64, 256), (0, 64)), seed=0, total=65536)  # seeded: stable

    tf = MASK_CONFIGS["transfusion_16k"]
    assert tf.num_segments == 81 and tf.seg_lens[1::2] == (256,) * 40
    assert all(20 <= n <= 200 for n in tf.seg_lens[::2])
    text, image = tf.topology[2], tf.topology[3]
    assert text[:3] == (FULL, FULL, CAUSAL) and set(text[3:]) == {NONE}
    assert image[:4] == (FULL,) * 4 and set(image[4:]) == {NONE}
    assert tf.dense_causal and not tf.causal

    video = MASK_CONFIGS["video_64k"]
    assert video.num_segments == 257 and video.seq_k == 2048 + 256 * 240
    assert video.topology[0] == (CAUSAL,) + (NONE,) * 256
    assert video.topology[5][:6] == (FULL,) * 6 and set(video.topology[5][6:]) == {NONE}
    for cfg in (pack, tf, video):
        assert (cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim) == (1, 16, 4, 128) and cfg.window is None


def test_live_pairs_of_a_long_video_are_exact_and_quick():
    """The closed form of the video topology: the text's causal triangle, and frame f sees the text, f - 1 earlier
    frames and all of itself."""
    text, frames, frame = 2048, 256, 240
    want = text * (text + 1) // 2 + sum(frame * (text + f * frame) for f in range(1, frames + 1))
    assert MASK_CONFIGS["video_64k"].live_pairs == want


@pytest.mark.parametrize("cfg", TINY_MASKS, ids=lambda c: c.name)
def test_flex_mask_mod_is_the_reference_mask(cfg):
    from torch.nn.attention.flex_attention import create_mask

    mask_mod = config_mask_mod(cfg, torch.device("cpu"))  # the harness's: pack documents, offsets, window
    got = create_mask(mask_mod, 1, 1, cfg.q_len, cfg.seq_k, device="cpu")[0, 0]
    assert torch.equal(got, _reference(cfg))


def test_flex_mask_mod_with_pair_types_and_decode_offsets():
    from torch.nn.attention.flex_attention import create_mask

    lens, topology = transfusion_layout(3, 8, (2, 9), seed=3)
    seq_k = sum(lens)
    seg, _ = segment_ids(lens, seq_k, torch.device("cpu"))
    for seq_q, causal in ((seq_k, False), (5, False), (7, True)):
        mask_mod = flex_mask_mod(topology, seg, causal, past=seq_k - seq_q)
        got = create_mask(mask_mod, 1, 1, seq_q, seq_k, device="cpu")[0, 0]
        assert torch.equal(got, mmsparse.reference_mask(topology, lens, seq_k, seq_q, causal)[0])


def test_the_harness_masks_are_the_reference_masks():
    """Chunked topology masks, packed masks made sample by sample, and the causal dense mask."""
    cpu = torch.device("cpu")
    lens, topology = video_layout(10, 5, 7)
    seq_k = sum(lens)
    for seq_q, causal in ((seq_k, False), (seq_k, True), (9, False)):
        got = topology_mask(topology, lens, seq_k, seq_q, causal, cpu, chunk_pairs=3 * seq_k + 5)  # 3 rows a call
        assert torch.equal(got, mmsparse.reference_mask(topology, lens, seq_k, seq_q, causal)[0])
    rows = pack_lengths(5, ((0, 6), (1, 9), (0, 4)), seed=2)
    for causal in (False, True):
        want = mmsparse.reference_packed_mask(HUB, rows, causal)[0]
        assert torch.equal(packed_mask(HUB, rows, causal, cpu), want)
    from benchmarks.cases import Case

    case = Case.make(TINY["tiny_video"], cpu, torch.float32)
    cfg = case.cfg
    assert torch.equal(case.mask("dense"), mmsparse.reference_mask([[1]], (cfg.seq_k,), cfg.seq_k, causal=True)[0])
    assert torch.equal(case.mask("topology"), _reference(cfg))


def test_pack_lengths_scale_to_the_total():
    rows = pack_lengths(50, ((16, 64), (64, 256), (0, 64)), seed=5, total=6400)
    assert len(rows) == 50 and sum(map(sum, rows)) == 6400 and all(len(r) == 3 for r in rows)
    drawn = pack_lengths(50, ((16, 64), (64, 256), (0, 64)), seed=5)
    assert all((a == 0) == (b == 0) for r, d in zip(rows, drawn) for a, b in zip(r, d))  # zeros stay zeros


def test_the_packed_build_is_the_reference_mask():
    """The metadata build timed for a pack (packed_lens_tensor + MaskInfo.from_segments(packed=True) + the block
    lists) describes the pack's reference mask."""
    from mmsparse.attention.config import kernel_config

    cfg, cpu = TINY["tiny_pack"], torch.device("cpu")
    info = mmsparse_build(cfg, cpu, kernel_config(cfg.head_dim, torch.bfloat16, cpu))()
    assert torch.equal(info.code_mask()[0], _reference(cfg))


def test_groups_select_the_mask_rows():
    configs, impls = select(parse_args(["--configs", "masks,mm13k_hub_causal", "--impls", "mmsparse,flex,dense_flash"]))
    assert [c.name for c in configs] == ["pack_64k_x512", "transfusion_16k", "video_64k", "vlm32k_window4k",
                                         "vlm32k_d256", "vlm32k_d256_window1k", "vlm32k_d192", "dense_causal_d256",
                                         "mm13k_hub_causal"]
    assert impls == ["mmsparse", "flex", "dense_flash"]
    assert expand_names(["tiny_masks", "tiny_pack"]) == ["tiny_pack", "tiny_transfusion", "tiny_video", "tiny_window"]
    assert set(MASK_CONFIGS) <= {c.name for c in select(parse_args([]))[0]}  # the default run has them
    assert set(GROUPS["masks"]) <= set(ALL_CONFIGS)
    with pytest.raises(SystemExit):
        select(parse_args(["--configs", "masks,nope"]))


def test_the_benchmark_runs_the_tiny_mask_rows(tmp_path, device):
    """``python -m benchmarks`` on tiny_pack, tiny_transfusion and tiny_window: mmsparse (varlen for the pack),
    sdpa_mask and dense_flash checked against their reference masks (dense_flash: its own unwindowed one), timed,
    written; Flex checked too (forward only on CPU, which has no Flex backward); the window row and the tables carry
    the window. One run for the three: each run pays the harness's fixed costs again."""
    from benchmarks.run import main

    threads = torch.get_num_threads()
    try:
        status = main(["--device", device.type, "--configs", "tiny_pack,tiny_transfusion,tiny_window",
                       "--impls", "mmsparse,flex,sdpa_mask,dense_flash", "--no-plot", "--out", str(tmp_path),
                       "--warmup", "0",
                       "--rep", "0", "--cpu-warmup", "1", "--cpu-reps", "1", "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    rows = {(r["config"], r["impl"]): r for r in json.loads((tmp_path / "latest.json").read_text())}
    for name in ("tiny_pack", "tiny_transfusion"):
        mm, flex, dense = rows[name, "mmsparse"], rows[name, "flex"], rows[name, "dense_flash"]
        assert mm["check"] == "ok" and mm["fwd_ms"] > 0 and mm["bwd_ms"] is not None and mm["build_ms"] > 0
        assert mm["reference"] == "topology" and mm["live_pairs"] == ALL_CONFIGS[name].live_pairs
        assert dense["check"] == "ok" and dense["reference"] == "dense" and "is_causal" in dense["backend"]
        if device.type == "cuda" and name == "tiny_transfusion" and flex["check"] is None:
            # torch 2.11's Inductor (Triton 3.6, H200) lowers no Flex kernel for this shape, forward included
            # (NoValidChoicesError): the harness records torch's refusal as the row's error and runs on
            assert flex["error"].startswith("check: InductorError") and "NoValidChoicesError" in flex["error"], flex
        else:
            assert flex["check"] == ("ok" if device.type == "cuda" else "ok (fwd only)")
    assert rows["tiny_pack", "mmsparse"]["packed"] and rows["tiny_pack", "mmsparse"]["samples"] == 6
    assert "varlen" in rows["tiny_pack", "mmsparse"]["backend"]
    table = (tmp_path / "latest.md").read_text()
    assert "| tiny_pack | dense_flash |" in table and "ok (speed only: other mask)" in table
    window = {impl: r for (config, impl), r in rows.items() if config == "tiny_window"}
    cfg = ALL_CONFIGS["tiny_window"]
    for row in window.values():
        assert row["window"] == 11 and row["live_pairs"] == cfg.live_pairs and row["density"] == round(cfg.density, 4)
    mm = window["mmsparse"]
    assert mm["check"] == "ok" and mm["fwd_ms"] > 0 and mm["build_ms"] > 0
    assert window["sdpa_mask"]["check"] == "ok" and window["sdpa_mask"]["reference"] == "topology"
    assert window["flex"]["check"] == ("ok" if device.type == "cuda" else "ok (fwd only)")
    assert window["dense_flash"]["check"] == "ok" and window["dense_flash"]["reference"] == "dense"
    assert "| config | S | density | window |" in table and f"| tiny_window | {cfg.seq_k} | 0.24 | 11 |" in table
