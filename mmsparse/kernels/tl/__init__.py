"""Triton (``tl``) kernels: ``common`` holds the helpers the attention passes share."""
