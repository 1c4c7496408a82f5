"""attn_implementation="mmsparse" in real transformers model classes (tiny random configs) against SDPA + 4-D mask."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE, reference_mask, reference_packed_mask
from mmsparse.nn import clip_seg_lens
from tests.helpers import RING

transformers = pytest.importorskip("transformers")
from mmsparse.integrations import hf  # noqa: E402

SEG = (5, 20, 15)
S = sum(SEG)
VOCAB = 128
# The KV cache's argument and output field: `past_key_values` in transformers 5.17, `cache` in later 5.x releases.
CACHE = "cache" if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__ else (
    "past_key_values")


def _config(family: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)


def _pair(family: str, device):
    """The same random weights under attn_implementation "sdpa" and "mmsparse" (separate config objects)."""
    hf.register()
    torch.manual_seed(0)
    config = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    mm = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="mmsparse")
    mm.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa" and mm.config._attn_implementation == "mmsparse"
    return ref.to(device).eval(), mm.to(device).eval()


def _sdpa_mask(seg_lens, batch: int, device) -> torch.Tensor:
    """bool [B, 1, S, S] for SDPA: the topology and causal mask; padded query rows see only themselves (their
    outputs are ignored, and this keeps them finite)."""
    mask = reference_mask(RING, seg_lens, S, causal=True).expand(batch, S, S).clone()
    empty = ~mask.any(-1)
    mask |= torch.eye(S, dtype=torch.bool)[None] & empty[..., None]
    return mask[:, None].to(device)


def assert_logits_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN"
    scale = max(e.abs().max().item(), 1.0)
    rel = ((a - e).norm() / max(e.norm().item(), scale)).item()
    max_abs = (a - e).abs().max().item()
    assert rel <= tol and max_abs <= tol * scale, f"{name}: rel L2 {rel:.3e}, max abs {max_abs:.3e} (tol {tol:.0e})"


@pytest.mark.parametrize(
    ("family", "source"), [("llama", "kwargs"), ("qwen2", "config")], ids=["llama-kwargs", "qwen2-config"]
)
def test_logits_match_sdpa_with_equivalent_mask(family, source, device):
    ref, mm = _pair(family, device)
    ids = torch.randint(0, VOCAB, (2, S), device=device)
    if source == "config":
        mm.config.mm_topology, mm.config.mm_seg_lens = RING, SEG
        kwargs = {}
    else:
        kwargs = dict(mm_topology=RING, mm_seg_lens=SEG)
    with torch.no_grad():
        out = mm(ids, **kwargs).logits
        expected = ref(ids, attention_mask=_sdpa_mask(SEG, 2, device)).logits
        plain_causal = ref(ids).logits
    assert_logits_close("logits", out, expected)
    assert (out - plain_causal).abs().max() > 1e-2  # the topology is in effect


def test_training_step_gradients_match_sdpa(device):
    ref, mm = _pair("llama", device)
    ref.train()
    mm.train()
    ids = torch.randint(0, VOCAB, (2, S), device=device)
    loss_ref = ref(ids, attention_mask=_sdpa_mask(SEG, 2, device), labels=ids).loss
    loss_mm = mm(ids, labels=ids, mm_topology=RING, mm_seg_lens=SEG).loss
    loss_ref.backward()
    loss_mm.backward()
    assert abs(loss_mm.item() - loss_ref.item()) < 1e-5, (loss_mm.item(), loss_ref.item())
    ref_params = dict(ref.named_parameters())
    for name, param in mm.named_parameters():
        assert_logits_close(f"d{name}", param.grad, ref_params[name].grad)


def test_right_padding_from_attention_mask(device):
    ref, mm = _pair("llama", device)
    ids = torch.randint(0, VOCAB, (2, S), device=device)
    am = torch.ones(2, S, dtype=torch.long, device=device)
    am[1, 30:] = 0
    lens = clip_seg_lens(SEG, am.sum(-1).cpu())
    assert lens.tolist() == [list(SEG), [5, 20, 5]]
    with torch.no_grad():
        out = mm(ids, attention_mask=am, mm_topology=RING, mm_seg_lens=SEG).logits
        expected = ref(ids, attention_mask=_sdpa_mask(lens, 2, device)).logits
    keep = am.bool()[..., None]
    assert_logits_close("logits (real tokens)", out * keep, expected * keep)
    with pytest.raises(ValueError, match="right padding"):
        mm(ids, attention_mask=am.flip(-1), mm_topology=RING, mm_seg_lens=SEG)


def test_kv_cache_queries_are_the_last_positions(device):
    _, mm = _pair("llama", device)
    ids = torch.randint(0, VOCAB, (1, S), device=device)
    prompt = S - 3
    with torch.no_grad():
        full = mm(ids, mm_topology=RING, mm_seg_lens=SEG).logits
        pre = mm(ids[:, :prompt], mm_topology=RING, mm_seg_lens=(5, 20, 12), use_cache=True)
        cache = copy.deepcopy(getattr(pre, CACHE))
        step = mm(ids[:, prompt:], **{CACHE: getattr(pre, CACHE)}, mm_topology=RING, mm_seg_lens=SEG).logits
        grown = mm(ids[:, prompt:], **{CACHE: cache}, mm_topology=RING, mm_seg_lens=(5, 20, 12),
                   mm_extend_last_segment=True).logits
    assert_logits_close("cached step", step, full[:, prompt:])
    assert_logits_close("cached step, last segment extended", grown, full[:, prompt:])
    with torch.no_grad(), pytest.raises(ValueError, match="mm_extend_last_segment"):
        pre = mm(ids[:, :prompt], mm_topology=RING, mm_seg_lens=(5, 20, 12), use_cache=True)
        mm(ids[:, prompt:], **{CACHE: getattr(pre, CACHE)}, mm_topology=RING, mm_seg_lens=(5, 20, 12))


def test_without_a_topology_the_models_own_mask(device):
    """No mm_topology: the mask transformers builds for the model (causal, with right padding) on the kernels."""
    ref, mm = _pair("llama", device)
    ids = torch.randint(0, VOCAB, (2, S), device=device)
    am = torch.ones(2, S, dtype=torch.long, device=device)
    am[1, 30:] = 0
    with torch.no_grad():
        out, expected = mm(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    keep = am.bool()[..., None]
    assert_logits_close("logits (real tokens)", out * keep, expected * keep)


def test_clear_errors(device):
    _, mm = _pair("llama", device)
    ids = torch.randint(0, VOCAB, (1, S), device=device)
    with pytest.raises(ValueError, match="2-D padding mask"):
        mm(ids, attention_mask=_sdpa_mask(SEG, 1, device), mm_topology=RING, mm_seg_lens=SEG)
    with pytest.raises(ValueError, match="sum to 39"):
        mm(ids, mm_topology=RING, mm_seg_lens=(5, 20, 14))
    packed = torch.cat([torch.arange(20), torch.arange(20)])[None].to(device)  # two sequences in one row
    with pytest.raises(ValueError, match=r"one row of segment lengths per sample, \[2, k\]"):
        mm(ids, position_ids=packed, use_cache=False, mm_topology=RING, mm_seg_lens=SEG)
    with pytest.raises(ValueError, match="packed sample 1 has 20 tokens"):
        mm(ids, position_ids=packed, use_cache=False, mm_topology=RING, mm_seg_lens=[(5, 10, 5), (5, 10, 4)])
    # lengths that are not ints are refused as mbs_attention refuses them, not truncated (10.5 -> 10)
    with pytest.raises(TypeError, match=r"mm_seg_lens\[1\] must be an int; got float 19.5"):
        mm(ids, mm_topology=RING, mm_seg_lens=(5, 19.5, 15.5))
    with pytest.raises(TypeError, match="mm_seg_lens must hold integers; got dtype torch.float32"):
        mm(ids, mm_topology=RING, mm_seg_lens=torch.tensor([5.0, 20.0, 15.0]))
    with pytest.raises(TypeError, match=r"mm_seg_lens\[1\]\[2\] must be an int; got float 4.5"):
        mm(ids, position_ids=packed, use_cache=False, mm_topology=RING, mm_seg_lens=[(5, 10, 5), (5, 10, 4.5)])
    static = transformers.StaticCache(config=mm.config, max_cache_len=64)  # queries would not be the last keys
    with pytest.raises(NotImplementedError, match="last key positions"):
        mm(ids, **{CACHE: static}, mm_topology=RING, mm_seg_lens=SEG, mm_extend_last_segment=True)


def test_packed_batch_matches_sdpa_with_the_block_diagonal_mask(device):
    """DataCollatorWithFlattening's layout: one row, position ids restarting per sample; per-sample modality
    lengths with pair types (text causal, the image full); against SDPA with the equivalent 4-D mask."""
    hf.register()
    ref, mm = _pair("llama", device)
    topo = [[CAUSAL, NONE], [FULL, FULL]]  # text then image: text causal, the image sees the text and itself
    rows = [(3, 6), (5, 0), (2, 9), (4, 3)]
    total = sum(map(sum, rows))
    ids = torch.randint(0, VOCAB, (1, total), device=device)
    pos = torch.cat([torch.arange(sum(r)) for r in rows])[None].to(device)
    mask = reference_packed_mask(topo, rows)
    with torch.no_grad():
        out = mm(ids, position_ids=pos, use_cache=False, mm_topology=topo, mm_seg_lens=rows, mm_causal=False).logits
        expected = ref(ids, position_ids=pos, attention_mask=mask[:, None].to(device)).logits
    assert_logits_close("packed logits", out, expected)
    cu = torch.tensor([0, *torch.tensor([sum(r) for r in rows]).cumsum(0).tolist()], device=device)
    with torch.no_grad():
        by_cu = mm(ids, position_ids=pos, cu_seq_lens_k=cu, use_cache=False, mm_topology=topo, mm_seg_lens=rows,
                   mm_causal=False).logits
        causal = mm(ids, position_ids=pos, use_cache=False, mm_topology=topo, mm_seg_lens=rows).logits
        expected_causal = ref(ids, position_ids=pos,
                              attention_mask=reference_packed_mask(topo, rows, True)[:, None].to(device)).logits
    assert_logits_close("packed logits from cu_seq_lens", by_cu, expected)
    assert_logits_close("packed logits, the decoder's causal mask too", causal, expected_causal)


def test_register_is_idempotent_and_import_is_lazy():
    hf.register()
    hf.register()
    assert transformers.AttentionInterface._global_mapping["mmsparse"] is hf.mmsparse_attention_forward
    assert transformers.masking_utils.AttentionMaskInterface._global_mapping["mmsparse"] is hf.mmsparse_mask
    code = "import sys, mmsparse, mmsparse.nn, mmsparse.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
