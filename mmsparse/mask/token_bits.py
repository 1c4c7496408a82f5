"""Per-token row and column bits of a topology mask in one launch (``topology.token_bits_torch`` takes six torch ops:
cumsum, arange, expand, searchsorted and two gathers; building metadata for new lengths every step is bound by
that host work, not by the GPU)."""

from __future__ import annotations

import torch

from ..kernels.tl.token_bits import token_bits_kernel
from ..runtime.launch import FastKernel
from .bit_lists import kernels_run_on
from .blocks import cdiv, next_power_of_2
from .topology import Topology, token_bits_torch

_TOKENS = 1024  # tokens per program



_TOKEN_BITS = FastKernel(token_bits_kernel)


def launch_token_bits(topology: Topology, seg_lens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topology.token_bits_torch`` (int32 ``[B, S]`` row and column bits; padding 0) with one kernel where the
    kernels run; the torch ops elsewhere and when traced (the compiler fuses those; it cannot trace a launch)."""
    if not kernels_run_on(seg_lens.device) or torch.compiler.is_compiling() or seg_lens.shape[0] == 0:
        return token_bits_torch(topology, seg_lens, seq_len)
    lens = seg_lens if seg_lens.dtype in (torch.int32, torch.int64) and seg_lens.stride(-1) == 1 else (
        seg_lens.to(torch.int32).contiguous())
    row_table, col_table = topology.bit_tables(lens.device)
    rows = lens.shape[0]
    row_bits = torch.empty((rows, seq_len), dtype=torch.int32, device=lens.device)
    col_bits = torch.empty((rows, seq_len), dtype=torch.int32, device=lens.device)
    if seq_len > 0:
        k = topology.num_segments
        _TOKEN_BITS[(rows, cdiv(seq_len, _TOKENS))](
            lens, row_table, col_table, row_bits, col_bits, lens.stride(0), seq_len,
            K=k, KP=max(2, next_power_of_2(k)), BLOCK=_TOKENS,
        )
    return row_bits, col_bits
