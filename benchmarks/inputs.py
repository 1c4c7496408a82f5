"""Seeded inputs of one benchmark config: the same seed gives the same tensors in every process on a device."""

from __future__ import annotations

import torch

from .configs import BenchConfig


def make_inputs(cfg: BenchConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random attention inputs for ``cfg`` from a private generator (the global RNG is left alone).

    Returns:
        q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv, S, D]`` (all three requiring grad), dout ``[B, Hq, Sq, D]``.
    """
    gen = torch.Generator(device).manual_seed(seed)
    b, hq, hkv, d = cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(b, hq, cfg.q_len, d).requires_grad_()
    k = randn(b, hkv, cfg.seq_k, d).requires_grad_()
    v = randn(b, hkv, cfg.seq_k, d).requires_grad_()
    return q, k, v, randn(b, hq, cfg.q_len, d)
