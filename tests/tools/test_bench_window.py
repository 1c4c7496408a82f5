"""The benchmark's sliding-window row (vlm32k_window4k, tiny_window): the window on a config, its exact live-pair
count, the Flex mask_mod with a window for both index dtypes, the harness's masks, build and check (the CPU run end
to end is in test_bench_masks.py, with the other tiny mask rows)."""

import random

import pytest
import torch

import mmsparse
from benchmarks.baselines import config_mask_mod, mmsparse_build
from benchmarks.cases import Case, packed_mask, topology_mask
from benchmarks.check import check
from benchmarks.configs import (
    ALL_CONFIGS,
    CAUSAL,
    FULL,
    GPU_CONFIGS,
    GROUPS,
    HUB,
    NONE,
    TINY,
    BenchConfig,
    live_pairs,
    scale_to_total,
    transfusion_layout,
)
from benchmarks.flex_mask import flex_mask_mod, packed_ids, segment_ids
from benchmarks.impl import Impl
from benchmarks.run import parse_args, select

CPU = torch.device("cpu")
INDEX_DTYPES = [torch.int64, torch.int32]


def _random_case(rng: random.Random) -> tuple[list[list[int]], list[int], int | None, bool, int]:
    k = rng.randint(1, 6)
    topology = [[rng.choice((NONE, FULL, CAUSAL)) for _ in range(k)] for _ in range(k)]
    lens = [rng.choice((0, 1, rng.randint(2, 40))) for _ in range(k)]
    lens[rng.randrange(k)] += 1
    seq_k = sum(lens)
    seq_q = rng.choice((None, rng.randint(1, seq_k)))
    window = rng.choice((1, 2, rng.randint(1, seq_k + 3)))  # up to past S: a window that keeps every key
    return topology, lens, seq_q, rng.random() < 0.5, window


def _evaluate(mask_mod, batch: int, seq_q: int, seq_k: int, index_dtype: torch.dtype) -> torch.Tensor:
    """The mask_mod over every (query, key) pair with plain tensors of ``index_dtype``: ``[batch, Sq, Sk]``."""
    q_idx = torch.arange(seq_q, dtype=index_dtype)[:, None]
    kv_idx = torch.arange(seq_k, dtype=index_dtype)[None, :]
    head = torch.zeros((), dtype=index_dtype)
    rows = [mask_mod(torch.tensor(b, dtype=index_dtype), head, q_idx, kv_idx) for b in range(batch)]
    return torch.stack([r.expand(seq_q, seq_k) for r in rows])


# ---------------------------------------------------------------------------------------------------------------
# The config


def test_a_window_is_a_positive_int_or_none():
    base = dict(name="w", batch=1, heads_q=2, heads_kv=1, head_dim=16, seg_lens=(5, 7), topology=((1, 0), (1, 1)))
    assert BenchConfig(**base).window is None and BenchConfig(**base, window=1).window == 1
    for bad in (2.5, True, "4", torch.tensor(4)):
        with pytest.raises(TypeError, match="window must be a positive int"):
            BenchConfig(**base, window=bad)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="window must be at least 1"):
            BenchConfig(**base, window=bad)
    with pytest.raises(ValueError, match="at least 1"):
        live_pairs(((1,),), (4,), window=0)
    with pytest.raises(ValueError, match="at least 1"):
        flex_mask_mod(((1,),), torch.zeros(4, dtype=torch.int64), False, window=0)
    assert "window=11 S=61" in TINY["tiny_window"].describe()
    assert "window" not in TINY["tiny_transfusion"].describe()


@pytest.mark.parametrize("seed", range(40))
def test_live_pairs_with_a_window_is_the_reference_mask_sum(seed):
    """Shared lengths, decode queries (seq_q) and packs, with and without causal, against the dense reference."""
    rng = random.Random(1000 + seed)
    topology, lens, seq_q, causal, window = _random_case(rng)
    seq_k = sum(lens)
    want = int(mmsparse.reference_mask(topology, lens, seq_k, seq_q, causal, window=window).sum())
    assert live_pairs(topology, lens, seq_q, causal, window=window) == want
    assert want <= live_pairs(topology, lens, seq_q, causal)
    rows = [[rng.choice((0, rng.randint(1, 12))) for _ in topology] for _ in range(rng.randint(1, 5))]
    rows[0][0] += 1
    packed = int(mmsparse.reference_packed_mask(topology, rows, causal, window=window).sum())
    assert live_pairs(topology, rows, causal=causal, packed=True, window=window) == packed


def test_a_windowed_config_counts_its_window():
    for cfg in (TINY["tiny_window"], BenchConfig("decode_window", 2, 2, 1, 16, (9, 20, 6), HUB, seq_q=5, window=7),
                BenchConfig("pack_window", 1, 2, 1, 16, ((3, 9, 0), (5, 2, 4), (0, 11, 1)), HUB, causal=True,
                            packed=True, window=4)):
        if cfg.packed:
            want = mmsparse.reference_packed_mask(cfg.topology, cfg.seg_lens, cfg.causal, window=cfg.window)
        else:
            want = mmsparse.reference_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, cfg.q_len, cfg.causal,
                                           window=cfg.window)
        assert cfg.live_pairs == int(want.sum()) > 0
        assert cfg.density == cfg.live_pairs / (cfg.q_len * cfg.seq_k)


def test_the_32k_window_row_is_what_it_says():
    cfg = ALL_CONFIGS["vlm32k_window4k"]
    assert (cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim, cfg.window) == (2, 16, 8, 128, 4096)
    assert cfg.seq_k == 32768 and cfg.num_segments == 65 and cfg.seg_lens[1::2] == (256,) * 32
    assert not cfg.causal and cfg.seq_q is None and not cfg.packed and cfg.topology_name == "transfusion"
    text, image = cfg.topology[2], cfg.topology[3]  # text: FULL before it, CAUSAL within; image: FULL up to itself
    assert text[:3] == (FULL, FULL, CAUSAL) and set(text[3:]) == {NONE}
    assert image[:4] == (FULL,) * 4 and set(image[4:]) == {NONE}
    assert min(cfg.seg_lens[::2]) > 0  # every image has text before and after it
    assert "vlm32k_window4k" in GROUPS["masks"] and "vlm32k_window4k" in GPU_CONFIGS
    assert "vlm32k_window4k" in {c.name for c in select(parse_args([]))[0]}  # the default run has it
    assert "tiny_window" in GROUPS["tiny_masks"] and "tiny_window" in GROUPS["tiny"]


def test_live_pairs_of_the_32k_window_row_are_exact():
    """An independent count, query by query (no prefix sums): query i of a text sees every key from
    max(i - W + 1, 0) up to itself; query i of an image [s, e) also the keys of the image after it, up to e - 1."""
    cfg = ALL_CONFIGS["vlm32k_window4k"]
    seg, _ = segment_ids(cfg.seg_lens, cfg.seq_k, CPU)
    ends = torch.tensor(cfg.seg_lens).cumsum(0)[seg]  # each position's segment end
    pos = torch.arange(cfg.seq_k)
    last = torch.where(seg % 2 == 1, ends - 1, pos)  # images (odd segments) see to their end
    first = (pos - cfg.window + 1).clamp(min=0)
    assert cfg.live_pairs == int((last - first + 1).sum())
    assert 0.11 < cfg.density < 0.13  # ~ the causal band of a 4k window over 32k, with the images' upper corners


def test_transfusion_lengths_scale_to_a_total():
    lens, topology = transfusion_layout(32, 256, (256, 1280), seed=0, total=32768)
    drawn, _ = transfusion_layout(32, 256, (256, 1280), seed=0)
    assert sum(lens) == 32768 and lens[1::2] == drawn[1::2] == (256,) * 32
    assert all(abs(a - b * 24576 / sum(drawn[::2])) < 1 for a, b in zip(lens[::2], drawn[::2]))
    assert topology == transfusion_layout(32, 256, (256, 1280), seed=0)[1]
    assert scale_to_total([3, 0, 5], 16) == [6, 0, 10] and scale_to_total([1, 1, 1], 5) == [2, 2, 1]
    with pytest.raises(ValueError, match="cannot scale"):
        scale_to_total([0, 0], 4)


# ---------------------------------------------------------------------------------------------------------------
# The Flex mask_mod


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(12))
def test_the_window_mask_mod_is_the_reference_mask(seed, index_dtype):
    """Shared lengths with decode offsets and the causal flag, evaluated over every (query, key) pair."""
    topology, lens, seq_q, causal, window = _random_case(random.Random(2000 + seed))
    seq_k = sum(lens)
    seq_q = seq_k if seq_q is None else seq_q
    seg, _ = segment_ids(lens, seq_k, CPU)
    mask_mod = flex_mask_mod(topology, seg, causal, past=seq_k - seq_q, index_dtype=index_dtype, window=window)
    want = mmsparse.reference_mask(topology, lens, seq_k, seq_q, causal, window=window)
    assert torch.equal(_evaluate(mask_mod, 1, seq_q, seq_k, index_dtype), want)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
def test_the_window_mask_mod_in_packs_and_per_sample_lengths(index_dtype):
    rows = ((3, 9, 0), (5, 2, 4), (0, 11, 1), (6, 6, 6))
    doc, seg = packed_ids(rows, CPU)
    for causal, window in ((False, 1), (True, 4), (False, 7), (True, 40)):
        mask_mod = flex_mask_mod(HUB, seg, causal, doc=doc, index_dtype=index_dtype, window=window)
        want = mmsparse.reference_packed_mask(HUB, rows, causal, window=window)
        assert torch.equal(_evaluate(mask_mod, 1, seg.numel(), seg.numel(), index_dtype), want)

    lens = torch.tensor([[10, 30, 20], [5, 0, 40], [0, 0, 0]])  # padded rows, one all padding
    seg, real = segment_ids(lens, 64, CPU)
    for causal, window in ((False, 3), (True, 17)):
        mask_mod = flex_mask_mod(HUB, seg, causal, real=real, index_dtype=index_dtype, window=window)
        want = mmsparse.reference_mask(HUB, lens, 64, 64, causal, window=window)
        assert torch.equal(_evaluate(mask_mod, 3, 64, 64, index_dtype), want)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["tiny_window", "vlm32k_window4k"])
def test_the_harness_mask_mod_has_the_window(name, index_dtype):
    """The harness's mask_mod of a windowed config (rows of the 32k row: a few query rows, all keys) against the
    reference."""
    cfg = ALL_CONFIGS[name]
    mask_mod = config_mask_mod(cfg, CPU, index_dtype)
    q_rows = torch.tensor([0, 1, 255, 4095, 4096, 4097, 10000, cfg.seq_k - 1], dtype=index_dtype)
    q_rows = q_rows[q_rows < cfg.q_len]
    kv_idx = torch.arange(cfg.seq_k, dtype=index_dtype)[None, :]
    got = mask_mod(torch.zeros((), dtype=index_dtype), torch.zeros((), dtype=index_dtype), q_rows[:, None], kv_idx)
    want = torch.stack([mmsparse.reference_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, 1, cfg.causal,
                                                q_start=[int(r)], window=cfg.window)[0, 0] for r in q_rows])
    assert torch.equal(got, want)
    assert not bool(got[:, 0].all())  # the window cuts the first key from the later rows


def test_the_int32_window_mask_mod_computes_only_what_flash_lowers():
    """The window is a Python int: the traced int32 mask_mod holds no int64 value, no clamp / maximum."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mask_mod = config_mask_mod(TINY["tiny_window"], CPU, torch.int32)
    captured = [c.cell_contents for c in mask_mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert captured and all(t.dtype == torch.int32 for t in captured)
    closed = dict(zip(mask_mod.__code__.co_freevars, (c.cell_contents for c in mask_mod.__closure__)))
    assert type(closed["window"]) is int and closed["window"] == 11
    idx = torch.zeros(1, dtype=torch.int32)
    graph = make_fx(mask_mod)(idx, idx, idx, idx).graph
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not {op for op in ops if any(w in op for w in ("clamp", "maximum", "minimum"))}
    assert "aten.gt.Tensor" in ops  # kv_idx > q_pos - window, the window a scalar of the graph
    assert {n.meta["val"].dtype for n in graph.nodes if "val" in n.meta} <= {torch.int32, torch.bool}


# ---------------------------------------------------------------------------------------------------------------
# The harness


def test_the_harness_masks_and_build_have_the_window():
    cfg = TINY["tiny_window"]
    want = mmsparse.reference_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, cfg.q_len, cfg.causal, window=cfg.window)
    got = topology_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, cfg.q_len, cfg.causal, CPU,
                        chunk_pairs=3 * cfg.seq_k + 5, window=cfg.window)  # 3 rows a call
    assert torch.equal(got, want[0])
    case = Case.make(cfg, CPU, torch.float32)
    assert torch.equal(case.mask("topology"), want[0]) and int(case.mask("topology").sum()) == cfg.live_pairs
    assert bool(case.mask("dense")[-1, 0])  # dense_flash's mask has no window

    from mmsparse.attention.config import kernel_config

    tiles = kernel_config(cfg.head_dim, torch.bfloat16, CPU)
    assert torch.equal(mmsparse_build(cfg, CPU, tiles)().code_mask()[0], want[0])
    rows = ((3, 9, 0), (5, 2, 4), (0, 11, 1))
    pack = BenchConfig("pack_window", 1, 2, 1, 16, rows, HUB, causal=True, packed=True, window=4)
    want = mmsparse.reference_packed_mask(HUB, rows, True, window=4)[0]
    assert torch.equal(packed_mask(HUB, rows, True, CPU, window=4), want)
    assert torch.equal(mmsparse_build(pack, CPU, kernel_config(16, torch.bfloat16, CPU))().code_mask()[0], want)


def test_the_check_fails_an_impl_that_drops_the_window():
    """The float32 check compares with the windowed reference: attention under the same mask without its window
    is a FAIL, with it a pass."""
    import torch.nn.functional as F

    cfg = TINY["tiny_window"]
    case = Case.make(cfg, CPU, torch.float32)
    group = cfg.heads_q // cfg.heads_kv

    def sdpa_under(mask: torch.Tensor):
        def fn(q, k, v):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return fn

    no_window = topology_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, cfg.q_len, cfg.causal, CPU)
    assert check(case, Impl(sdpa_under(case.mask("topology"))), grads=True)["check"] == "ok"
    res = check(case, Impl(sdpa_under(no_window)), grads=True)
    assert res["check"] == "FAIL" and not res["correct"]
