"""The model's own mask (mmsparse.integrations.hf): the topology and lengths built from transformers' composed mask
function give, token for token, the dense mask transformers builds for SDPA: Gemma 3's full and sliding layers,
PaliGemma's prefix, padding, packed rows, hand-composed masks and random layouts. No attention kernel runs here."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import reference_mask, reference_packed_mask

transformers = pytest.importorskip("transformers")
from mmsparse.integrations import hf  # noqa: E402
from mmsparse.integrations.hf.pair_types import InexpressibleMask  # noqa: E402

masking_utils = pytest.importorskip("transformers.masking_utils")
gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")


def spec_dense(spec: hf.MaskSpec, batch: int) -> torch.Tensor:
    """bool ``[B, Sq, Sk]``: the mask mmsparse computes for a spec, from mmsparse's dense reference."""
    topology = spec.topology.types.tolist()
    if spec.packed:
        mask = reference_packed_mask(topology, spec.seg_lens)
    else:
        mask = reference_mask(topology, spec.seg_lens, spec.kv_length, seq_q=spec.q_length)
    mask = mask.expand(batch, -1, -1)
    if spec.window is not None:
        q = torch.arange(spec.q_length) + spec.kv_length - spec.q_length
        mask = mask & (torch.arange(spec.kv_length)[None, :] > q[:, None] - spec.window)
    return mask


def assert_same_mask(ours: torch.Tensor, theirs: torch.Tensor, padding: torch.Tensor | None) -> None:
    """ours ``ModelMask``, theirs transformers' bool ``[B, 1, Sq, Sk]``: equal, except the query rows of trailing
    padding, which mmsparse leaves empty (their outputs are 0)."""
    assert isinstance(ours, hf.ModelMask), type(ours)
    expected = theirs[:, 0].clone()
    got = spec_dense(ours.spec, expected.shape[0])
    if padding is not None:
        q_pos = torch.arange(expected.shape[1]) + expected.shape[2] - expected.shape[1]
        last_real = torch.where(padding.bool(), torch.arange(padding.shape[1]), -1).max(-1).values
        trailing = q_pos[None, :] > last_real[:, None]
        assert not got[trailing].any(), "a trailing padded query sees something"
        expected[trailing] = False
    diff = (got != expected).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} pairs differ, first (b, q, k): {diff[:5].tolist()}"


def text_config(sliding_window: int):
    hf.register()
    return transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
    )


def both(config, build):
    """transformers' SDPA mask and mmsparse's for one mask-building call."""
    config._attn_implementation = "sdpa"
    theirs = build(config)
    config._attn_implementation = "mmsparse"
    ours = build(config)
    return theirs, ours


def token_types(batch: int, seq: int, images: list[list[tuple[int, int]]]) -> torch.Tensor:
    """1 on the (start, length) image runs of each row."""
    tt = torch.zeros(batch, seq, dtype=torch.long)
    for b, runs in enumerate(images):
        for start, length in runs:
            tt[b, start : start + length] = 1
    return tt


def gemma3_masks(config, token_type: torch.Tensor, attention_mask=None, position_ids=None):
    embeds = torch.zeros(token_type.shape[0], token_type.shape[1], 1)
    ids = gemma3.get_block_sequence_ids_for_mask(token_type)

    def build(cfg):
        return gemma3.create_masks_for_vision_model(cfg, embeds, attention_mask, None, position_ids, ids)

    theirs, ours = both(config, build)
    return [(theirs[kind], ours[kind]) for kind in ("full_attention", "sliding_attention")]


GEMMA3_CASES = {
    # id: (seq, window, image runs per row, right padding per row)
    "one-image-window-large": (24, 64, [[(4, 6)]], None),
    "images-at-ends-window-3": (26, 3, [[(0, 5), (12, 4), (22, 4)]], None),
    "image-longer-than-window": (20, 4, [[(2, 9)]], None),
    "adjacent-images-merge": (20, 5, [[(3, 4), (7, 4)]], None),
    "B2-right-padding": (22, 6, [[(1, 4), (10, 6)], [(5, 3)]], [22, 15]),
    "B3-no-images-in-one-row": (18, 7, [[(2, 3)], [], [(9, 9)]], [18, 12, 18]),
}


@pytest.mark.parametrize("case", list(GEMMA3_CASES), ids=list(GEMMA3_CASES))
def test_gemma3_full_and_sliding_masks(case):
    seq, window, images, lengths = GEMMA3_CASES[case]
    batch = len(images)
    tt = token_types(batch, seq, images)
    am = None
    if lengths is not None:
        am = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    for theirs, ours in gemma3_masks(text_config(window), tt, am):
        assert_same_mask(ours, theirs, am)


def test_gemma3_left_padding():
    seq = 16
    tt = token_types(2, seq, [[(6, 4)], [(2, 5)]])
    am = torch.ones(2, seq, dtype=torch.long)
    am[0, :3] = 0
    for theirs, ours in gemma3_masks(text_config(5), tt, am):
        assert_same_mask(ours, theirs, None)


def packed_inputs(samples: list[tuple[int, list[tuple[int, int]]]]):
    """One packed row: per sample (length, image runs within it); position ids restarting."""
    seq = sum(n for n, _ in samples)
    tt = torch.zeros(1, seq, dtype=torch.long)
    pos, start = [], 0
    for n, runs in samples:
        for s, length in runs:
            tt[0, start + s : start + s + length] = 1
        pos.append(torch.arange(n))
        start += n
    return tt, torch.cat(pos)[None]


def crosses_samples(mask: torch.Tensor, samples) -> bool:
    sample = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor([n for n, _ in samples]))
    return bool((mask[:, 0] & (sample[:, None] != sample[None, :])).any())


@pytest.mark.parametrize("window", [3, 50], ids=["window-3", "window-50"])
def test_gemma3_packed_row(window):
    """Samples with their own images; transformers' mask is reproduced as it is (on the sliding layers of some
    versions it reads the block ids at per-sample positions)."""
    samples = [(9, [(2, 4)]), (12, [(0, 3), (6, 5)]), (7, []), (10, [(5, 5)])]
    tt, pos = packed_inputs(samples)
    for theirs, ours in gemma3_masks(text_config(window), tt, None, pos):
        assert not crosses_samples(theirs, samples)
        assert ours.spec.packed
        assert_same_mask(ours, theirs, None)


def test_packed_samples_never_see_each_other():
    """An image ending one sample next to an image starting the next share a block id: transformers versions
    that OR the blocks in after the packing let the two samples see each other. mmsparse matches the mask when
    it keeps samples apart, and otherwise refuses."""
    samples = [(8, [(4, 4)]), (8, [(0, 4)])]
    tt, pos = packed_inputs(samples)
    config = text_config(50)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, tt.shape[1], 1)
    ids = gemma3.get_block_sequence_ids_for_mask(tt)
    theirs = gemma3.create_masks_for_vision_model(config, embeds, None, None, pos, ids)["full_attention"]
    config._attn_implementation = "mmsparse"
    if crosses_samples(theirs, samples):
        with pytest.raises(ValueError, match="packed sample see another"):
            gemma3.create_masks_for_vision_model(config, embeds, None, None, pos, ids)
    else:
        ours = gemma3.create_masks_for_vision_model(config, embeds, None, None, pos, ids)["full_attention"]
        assert_same_mask(ours, theirs, None)


def test_paligemma_prefix():
    """PaliGemma: block id 0 on the image and prompt prefix (token type 0), -1 on the causal suffix."""
    hf.register()
    config = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    seq = 20
    tt = torch.ones(2, seq, dtype=torch.long)
    tt[0, :12] = 0
    tt[1, :7] = 0
    am = (torch.arange(seq)[None, :] < torch.tensor([[20], [14]])).long()
    tt[1, 14:] = 0  # padding comes with token type 0 from a tokenizer: it joins block 0, but is never a key
    embeds = torch.zeros(2, seq, 1)
    ids = torch.where(tt == 0, 0, -1)

    def build(cfg):
        return masking_utils.create_causal_mask(cfg, embeds, am, None, None, block_sequence_ids=ids)

    theirs, ours = both(config, build)
    assert_same_mask(ours, theirs, am)


def call_both(fn, batch: int, seq: int, q_len: int | None = None, attention_mask=None):
    """transformers' sdpa_mask of a hand-composed mask function, and mmsparse's mask interface on the same call."""
    q_len = seq if q_len is None else q_len
    kw = dict(batch_size=batch, q_length=q_len, kv_length=seq, q_offset=seq - q_len, kv_offset=0, mask_function=fn,
              attention_mask=attention_mask)
    theirs = masking_utils.sdpa_mask(**kw, allow_is_causal_skip=False, use_vmap=False)
    return theirs, hf.mmsparse_mask(**kw, device=torch.device("cpu"))


def test_blocks_or_after_the_window():
    """A block OR-ed in after the window (transformers before 5.17): exact while every block fits the window, an
    error when one is longer."""
    seq, window = 20, 5
    ids = torch.full((1, seq), -1)
    ids[0, 3:8] = 0  # 5 tokens: the farthest pair is 4 apart, inside the window
    ids[0, 12:15] = 1
    fn = masking_utils.or_masks(masking_utils.sliding_window_causal_mask_function(window),
                                masking_utils.blockwise_overlay(ids))
    theirs, ours = call_both(fn, 1, seq)
    assert_same_mask(ours, theirs, None)
    ids[0, 12:18] = 1  # 6 tokens: its first and last are 5 apart, outside the window
    fn = masking_utils.or_masks(masking_utils.sliding_window_causal_mask_function(window),
                                masking_utils.blockwise_overlay(ids))
    with pytest.raises(InexpressibleMask, match="longer than the window"):
        call_both(fn, 1, seq)


def test_decoding_queries_at_an_offset():
    """Queries that are the last positions of the keys (a KV cache), with blocks in the cached part."""
    seq = 24
    ids = torch.full((2, seq), -1)
    ids[0, 2:6] = 0
    ids[1, 10:19] = 1
    for fn in (
        masking_utils.or_masks(masking_utils.causal_mask_function, masking_utils.blockwise_overlay(ids)),
        masking_utils.and_masks(masking_utils.or_masks(masking_utils.causal_mask_function,
                                                       masking_utils.blockwise_overlay(ids)),
                                masking_utils.sliding_window_overlay(7)),
    ):
        for q_len in (1, 3, 9):
            theirs, ours = call_both(fn, 2, seq, q_len)
            assert_same_mask(ours, theirs, None)


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts(seed):
    """Random rows of blocks (of random ids, contiguous or not), padding and windows, in both orders of the
    window and the blocks."""
    rng = random.Random(seed)
    batch, seq = rng.randint(1, 3), rng.randint(8, 40)
    ids = torch.full((batch, seq), -1)
    for b in range(batch):
        for _ in range(rng.randint(0, 4)):
            start, length = rng.randrange(seq), rng.randint(1, 8)
            ids[b, start : start + length] = rng.randint(0, 2)
    lengths = torch.tensor([rng.randint(seq // 2, seq) for _ in range(batch)])
    am = (torch.arange(seq)[None, :] < lengths[:, None]).long() if rng.random() < 0.5 else None
    window = rng.randint(1, seq + 2)
    blocks = masking_utils.blockwise_overlay(ids)
    causal = masking_utils.causal_mask_function
    cases = [masking_utils.or_masks(causal, blocks),
             masking_utils.and_masks(masking_utils.or_masks(causal, blocks),
                                     masking_utils.sliding_window_overlay(window))]
    q_len = rng.choice([seq, 1, max(1, seq // 3)])
    for fn in cases:
        theirs, ours = call_both(fn, batch, seq, q_len, am)
        assert_same_mask(ours, theirs, am)


def test_unknown_pieces_are_errors():
    seq = 12
    for fn, name in [
        (masking_utils.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)), "chunked"),
        (masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, k: q >= 0), "lambda"),
        (masking_utils.sliding_window_bidirectional_mask_function(3), "sliding_window_bidirectional"),
    ]:
        with pytest.raises(NotImplementedError, match="cannot express the mask piece") as info:
            call_both(fn, 1, seq)
        assert name in str(info.value)


def test_supported_versions():
    for ok in ("5.17.0", "5.24.0", "5.30.1.dev0"):
        hf.check_transformers_version(ok)
    for bad in ("4.57.1", "5.16.2", "6.0.0"):
        with pytest.raises(ImportError, match=r"supports transformers >=5.17,<6"):
            hf.check_transformers_version(bad)
