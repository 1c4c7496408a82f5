"""attn_implementation="mmsparse" on real vision-language model classes (tiny random Gemma 3 and PaliGemma, built
from configs, inputs by hand) against eager attention with transformers' own 4-D masks, in float32: logits, every
parameter's gradient, packed rows, right padding, greedy generate(), and the errors."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from mmsparse.integrations import hf  # noqa: E402

IMAGE, BOI, EOI = 60, 61, 62  # token ids inside the vocabulary
VOCAB = 64
TOKENS_PER_IMAGE = 4  # a 16x16 image in 4x4 patches, pooled 2x2


def gemma3_config(window: int = 64, layer_types=("sliding_attention", "full_attention"), **text):
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                sliding_window=window, query_pre_attn_scalar=20, layer_types=list(layer_types),
                pad_token_id=0, **text)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1, image_size=16,
                  patch_size=4)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                     image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)


def paligemma_config(**text):
    text = {**dict(model_type="gemma", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                   pad_token_id=0), **text}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1, image_size=16,
                  patch_size=4, projection_dim=32)
    return transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                        projection_dim=32)


def pair(cls, config, device, reference: str = "eager"):
    """The same random weights under ``reference`` and "mmsparse" (separate config objects)."""
    hf.register()
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(config), attn_implementation=reference)
    mm = cls._from_config(copy.deepcopy(config), attn_implementation="mmsparse")
    mm.load_state_dict(ref.state_dict())
    assert mm.config.get_text_config()._attn_implementation == "mmsparse"
    return ref.to(device), mm.to(device)


def gemma3_inputs(rows: list[tuple[int, list[int]]], device, seed: int = 1):
    """Per row (length, image starts): ids with <boi> image tokens <eoi> around each image, token types, pixels;
    rows shorter than the longest are right-padded."""
    g = torch.Generator().manual_seed(seed)
    seq = max(n for n, _ in rows)
    ids = torch.randint(1, IMAGE, (len(rows), seq), generator=g)
    tt = torch.zeros_like(ids)
    am = torch.zeros_like(ids)
    for b, (n, starts) in enumerate(rows):
        am[b, :n] = 1
        ids[b, n:] = 0
        for s in starts:
            ids[b, s - 1], ids[b, s + TOKENS_PER_IMAGE] = BOI, EOI
            ids[b, s : s + TOKENS_PER_IMAGE] = IMAGE
            tt[b, s : s + TOKENS_PER_IMAGE] = 1
    pixels = torch.randn(int(tt.sum()) // TOKENS_PER_IMAGE, 3, 16, 16, generator=g)
    return ids.to(device), tt.to(device), am.to(device), pixels.to(device)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN"
    # Floors: a gradient that is zero in exact arithmetic (a key bias, under the softmax) is rounding noise in both.
    scale = max(e.abs().max().item(), 1e-6)
    max_abs = (a - e).abs().max().item()
    rel = ((a - e).norm() / max(e.norm().item(), 1e-5)).item()
    assert rel <= tol and max_abs <= tol * scale, f"{name}: rel L2 {rel:.3e}, max abs {max_abs:.3e} (scale {scale:.2e})"


def check_training_step(ref, mm, inputs: dict, keep: torch.Tensor, labels: torch.Tensor) -> None:
    """Logits on the real tokens, the loss and every parameter's gradient, mmsparse against the reference."""
    ref.train()
    mm.train()
    out_ref = ref(**inputs, labels=labels)
    out_mm = mm(**inputs, labels=labels)
    k = keep[..., None].bool()
    assert_close("logits", out_mm.logits * k, out_ref.logits * k)
    out_ref.loss.backward()
    out_mm.loss.backward()
    assert_close("loss", out_mm.loss, out_ref.loss)
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in mm.named_parameters():
        if ref_params[name].grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert_close(f"d {name}", p.grad, ref_params[name].grad)
        checked += 1
    assert checked > 20


def test_gemma3_images_at_several_positions_and_right_padding(device):
    """Two rows: images at the start, in the middle and at the end of the text; the second row right-padded."""
    ref, mm = pair(transformers.Gemma3ForConditionalGeneration, gemma3_config(), device)
    ids, tt, am, pixels = gemma3_inputs([(26, [1, 9, 20]), (19, [6])], device)
    labels = torch.where(am.bool() & (tt == 0), ids, -100)
    inputs = dict(input_ids=ids, token_type_ids=tt, attention_mask=am, pixel_values=pixels)
    check_training_step(ref, mm, inputs, am, labels)
    with torch.no_grad():
        no_images = ref(input_ids=ids, attention_mask=am, pixel_values=pixels).logits
        ours = mm(**inputs).logits
    assert ((ours - no_images).abs() * am[..., None]).max() > 1e-3  # the images' bidirectional blocks are in effect


def test_gemma3_sliding_window_shorter_than_the_images(device):
    """Sliding layers with a window of 3 keys: images of 4 tokens are cut by it (transformers ANDs the window over
    the blocks, as mmsparse's window does)."""
    ref, mm = pair(transformers.Gemma3ForConditionalGeneration, gemma3_config(window=3), device)
    ids, tt, am, pixels = gemma3_inputs([(20, [2, 12])], device)
    inputs = dict(input_ids=ids, token_type_ids=tt, pixel_values=pixels)
    check_training_step(ref, mm, inputs, am, torch.where(tt == 0, ids, -100))


def test_paligemma_prefix_and_suffix(device):
    """PaliGemma on Gemma text: the image and prompt prefix bidirectional, the suffix causal; two rows of
    different prefix lengths, one right-padded."""
    ref, mm = pair(transformers.PaliGemmaForConditionalGeneration, paligemma_config(), device)
    n_img = 16  # a 16x16 image in 4x4 patches, no pooling
    seq = n_img + 10
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, IMAGE, (2, seq), generator=g)
    ids[:, :n_img] = IMAGE
    tt = torch.ones_like(ids)
    tt[0, : n_img + 6] = 0
    tt[1, : n_img + 3] = 0
    am = torch.ones_like(ids)
    am[1, n_img + 7 :] = 0
    ids[1, n_img + 7 :] = 0
    tt[1, n_img + 7 :] = 0  # padding has token type 0, as tokenizers give it
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    ids, tt, am, pixels = ids.to(device), tt.to(device), am.to(device), pixels.to(device)
    labels = torch.where((tt == 1) & am.bool(), ids, -100)
    inputs = dict(input_ids=ids, token_type_ids=tt, attention_mask=am, pixel_values=pixels)
    check_training_step(ref, mm, inputs, am, labels)


@pytest.mark.parametrize("window", [64, 5], ids=["window-64", "window-5"])
def test_gemma3_packed_row_matches_eager(window, device):
    """DataCollatorWithFlattening's layout: one row, position ids restarting per sample, any number of images per
    sample; against eager on the same packed row (transformers' own packed mask)."""
    config = gemma3_config(window, layer_types=("full_attention", "sliding_attention"))
    ref, mm = pair(transformers.Gemma3ForConditionalGeneration, config, device)
    parts = [gemma3_inputs([(n, starts)], device, seed=10 + i) for i, (n, starts) in
             enumerate([(12, [3]), (9, []), (17, [1, 11])])]
    ids = torch.cat([p[0] for p in parts], 1)
    tt = torch.cat([p[1] for p in parts], 1)
    pixels = torch.cat([p[3] for p in parts])
    pos = torch.cat([torch.arange(p[0].shape[1]) for p in parts])[None].to(device)
    inputs = dict(input_ids=ids, token_type_ids=tt, pixel_values=pixels, position_ids=pos)
    check_training_step(ref, mm, inputs, torch.ones_like(ids), torch.where(tt == 0, ids, -100))


def test_packed_samples_see_only_themselves(device):
    """With full-attention layers only, a packed row gives each sample the logits it gets alone."""
    config = gemma3_config(layer_types=("full_attention", "full_attention"))
    _, mm = pair(transformers.Gemma3ForConditionalGeneration, config, device)
    mm.eval()
    parts = [gemma3_inputs([(n, starts)], device, seed=20 + i) for i, (n, starts) in
             enumerate([(14, [2, 8]), (11, [5])])]
    ids = torch.cat([p[0] for p in parts], 1)
    tt = torch.cat([p[1] for p in parts], 1)
    pixels = torch.cat([p[3] for p in parts])
    pos = torch.cat([torch.arange(p[0].shape[1]) for p in parts])[None].to(device)
    with torch.no_grad():
        packed = mm(input_ids=ids, token_type_ids=tt, pixel_values=pixels, position_ids=pos).logits
        alone = torch.cat([mm(input_ids=p[0], token_type_ids=p[1], pixel_values=p[3]).logits for p in parts], 1)
    assert_close("packed vs alone", packed, alone)


@pytest.mark.parametrize("family", ["gemma3", "gemma3-window-6", "paligemma"])
def test_generate_matches_eager(family, device):
    """Greedy generate() with images: the prefill (queries over the image blocks) and the cached decoding steps
    (one query at an offset; with a window of 6, the sliding layers' cache keeps the last keys only) give eager's
    tokens and scores."""
    if family.startswith("gemma3"):
        window = 6 if family.endswith("6") else 64
        ref, mm = pair(transformers.Gemma3ForConditionalGeneration, gemma3_config(window), device)
        ids, tt, am, pixels = gemma3_inputs([(18, [2, 10]), (18, [5])], device, seed=4)
    else:
        ref, mm = pair(transformers.PaliGemmaForConditionalGeneration, paligemma_config(), device)
        ids = torch.randint(1, IMAGE, (2, 22), generator=torch.Generator().manual_seed(5))
        ids[:, :16] = IMAGE
        tt, am = torch.zeros_like(ids), torch.ones_like(ids)
        pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(6))
        ids, tt, am, pixels = ids.to(device), tt.to(device), am.to(device), pixels.to(device)
    kw = dict(input_ids=ids, token_type_ids=tt, attention_mask=am, pixel_values=pixels, max_new_tokens=4,
              do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ref.eval()
    mm.eval()
    with torch.no_grad():
        expected = ref.generate(**kw)
        got = mm.generate(**kw)
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    for i, (a, e) in enumerate(zip(got.scores, expected.scores)):
        assert_close(f"scores of step {i}", a, e)


def test_soft_capping_is_an_error_at_the_first_forward(device):
    """PaliGemma 2 runs Gemma 2 text with attention logit soft-capping, which mmsparse does not compute."""
    text = dict(model_type="gemma2", attn_logit_softcapping=50.0, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"])
    config = paligemma_config(**text)
    hf.register()
    model_class = transformers.PaliGemmaForConditionalGeneration
    model = model_class._from_config(config, attn_implementation="mmsparse").to(device)
    ids = torch.full((1, 20), 5)
    ids[:, :16] = IMAGE
    with pytest.raises(NotImplementedError, match="soft-capping"):
        model(input_ids=ids.to(device), token_type_ids=torch.zeros_like(ids).to(device),
              pixel_values=torch.randn(1, 3, 16, 16).to(device))


def test_bidirectional_gemma3_is_an_error(device):
    """Gemma 3 with use_bidirectional_attention (embedding models) ORs a lambda in: not a known mask piece."""
    hf.register()
    config = gemma3_config(use_bidirectional_attention=True).get_text_config()
    model = transformers.Gemma3TextModel._from_config(config, attn_implementation="mmsparse").to(device)
    with pytest.raises(NotImplementedError, match="cannot express the mask piece"):
        model(input_ids=torch.randint(1, IMAGE, (1, 10), device=device))
