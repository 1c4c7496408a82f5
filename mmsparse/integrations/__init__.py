"""Optional integrations with other libraries.

Each submodule imports its library only when used: ``import mmsparse`` never imports them. See
:mod:`mmsparse.integrations.hf` for Hugging Face transformers (``attn_implementation="mmsparse"``).
"""
