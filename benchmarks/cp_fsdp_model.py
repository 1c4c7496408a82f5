"""A small multimodal transformer and its synthetic data, for :mod:`benchmarks.cp_fsdp`.

Tokens of three segments (text, image, audio) with a learned position and segment embedding, pre-norm blocks of
attention (any ``attend(q, k, v)``: ``mbs_attention`` on one GPU, ``ContextParallel.attention`` over a group) and
an MLP, and a next-token loss. Parameters stay float32; each forward casts them to the compute dtype (bf16 on a
GPU), so the single-GPU run and the sharded one do the same arithmetic whoever holds the weights. The loss is a
gather of log-softmax, not ``cross_entropy``: CUDA's NLL loss has no deterministic implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seg_lens: tuple[int, ...]

    @property
    def seq_len(self) -> int:
        return sum(self.seg_lens)


class _Linear(nn.Linear):
    """A linear layer whose float32 weights are cast to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight).to(x.dtype)


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        self.norm1, self.norm2 = _Norm(shape.dim), _Norm(shape.dim)
        self.qkv = _Linear(shape.dim, width, bias=False)
        self.proj = _Linear(shape.heads * shape.head_dim, shape.dim, bias=False)
        self.up = _Linear(shape.dim, 4 * shape.dim)
        self.down = _Linear(4 * shape.dim, shape.dim)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x: ``[B, S_local, dim]``."""
        s = self.shape
        b, n, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, s.heads + 2 * s.kv_heads, s.head_dim).transpose(1, 2)
        q, k, v = (t.contiguous() for t in qkv.split([s.heads, s.kv_heads, s.kv_heads], dim=1))
        x = x + self.proj(attend(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class MultimodalLM(nn.Module):
    """Token, position and segment embeddings, ``layers`` blocks, a norm and the output projection."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.dtype = shape, dtype
        self.tokens = nn.Embedding(shape.vocab, shape.dim)
        self.positions = nn.Embedding(shape.seq_len, shape.dim)
        self.segments = nn.Embedding(len(shape.seg_lens), shape.dim)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = _Norm(shape.dim)
        self.head = _Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        """ids, positions, segments: int64 ``[B, S_local]``. Returns float32 logits ``[B, S_local, vocab]``."""
        x = (self.tokens(ids) + self.positions(positions) + self.segments(segments)).to(self.dtype)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x)).float()


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token losses over the positions whose label is not -100 (a gather of log-softmax)."""
    valid = labels != -100
    picked = logits.log_softmax(-1).gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
    return -(picked * valid).sum()


def synthetic_batches(steps: int, per_step: int, shape: ModelShape, seed: int = 0) -> torch.Tensor:
    """int64 ``[steps, per_step, S]`` token ids with structure to learn: each next token follows a fixed random
    successor table with probability 0.8, else is uniform (the same on every rank: a seeded CPU generator)."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(shape.vocab, generator=gen)
    ids = torch.empty(steps, per_step, shape.seq_len, dtype=torch.int64)
    ids[..., 0] = torch.randint(shape.vocab, (steps, per_step), generator=gen)
    noise = torch.randint(shape.vocab, ids.shape, generator=gen)
    follow = torch.rand(ids.shape, generator=gen) < 0.8
    for i in range(1, shape.seq_len):
        ids[..., i] = torch.where(follow[..., i], successor[ids[..., i - 1]], noise[..., i])
    return ids


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels of ``[..., S]`` ids, -100 at the last position (shift before sharding)."""
    labels = torch.full_like(ids, -100)
    labels[..., :-1] = ids[..., 1:]
    return labels


def segment_ids(seg_lens: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[S]``: each position's segment."""
    return torch.repeat_interleave(torch.arange(len(seg_lens)), torch.tensor(seg_lens))
