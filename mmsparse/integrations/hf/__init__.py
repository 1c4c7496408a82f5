"""Hugging Face transformers backend: ``attn_implementation="mmsparse"``.

Usage::

    from mmsparse.integrations import hf
    hf.register()  # once; idempotent
    model = Gemma3ForConditionalGeneration.from_config(config, attn_implementation="mmsparse")
    out = model(input_ids, pixel_values=pixel_values, token_type_ids=token_type_ids)

Two routes:

- The model's own mask (:mod:`.model_mask`): the mask transformers composes for each layer type (causal, sliding
  window, packed samples, right padding, and the vision models' bidirectional blocks: Gemma 3's images, PaliGemma's
  image and prompt prefix) becomes an mmsparse topology of pair types over runs of tokens, exact, with no S x S
  tensor and nothing for the user to write. A mask it cannot express exactly is an error at the first forward.
- ``mm_topology`` / ``mm_seg_lens`` (:mod:`.topology_route`): a user-given topology for models whose mask
  transformers does not know (Llama/Qwen2-style decoders fed multimodal sequences).

transformers is an optional dependency: it is imported by :func:`register`, never by ``import mmsparse``.
"""

from __future__ import annotations

from .attention import mmsparse_attention_forward, mmsparse_mask
from .model_mask import MaskSpec, ModelMask
from .versions import SUPPORTED, check_transformers_version

NAME = "mmsparse"

__all__ = [
    "NAME", "SUPPORTED", "MaskSpec", "ModelMask", "mmsparse_attention_forward", "mmsparse_mask",
    "register",
]


def register(name: str = NAME) -> None:
    """Register mmsparse with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``. Idempotent.

    Args:
        name: the ``attn_implementation`` string to register.

    Raises:
        ImportError: transformers is missing or outside the supported versions (:data:`SUPPORTED`).
    """
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            f"mmsparse.integrations.hf needs transformers{SUPPORTED}: pip install 'transformers{SUPPORTED}'"
        ) from e
    check_transformers_version(transformers.__version__)
    AttentionInterface.register(name, mmsparse_attention_forward)
    AttentionMaskInterface.register(name, mmsparse_mask)
