"""The Triton block lists of segment-code masks (mmsparse.mask.code_lists) against the torch tile classes
(mmsparse.mask.code_blocks): random pair-type topologies, many segments, packs, causal, q_start offsets, ragged ends."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE
from mmsparse.mask import bit_lists
from mmsparse.mask.blocks import lists_from_classes
from mmsparse.mask.code_blocks import classify_blocks_from_codes
from mmsparse.mask.info import MaskInfo
from mmsparse.mask.topology import Topology


def _info(seed: int, device: torch.device) -> MaskInfo:
    rng = random.Random(seed)
    k = (1, 3, 6, 37)[seed % 4]  # 37: past the bit vectors' 32 segments
    topo = Topology([[rng.choice((NONE, FULL, CAUSAL)) for _ in range(k)] for _ in range(k)])
    causal = rng.random() < 0.4
    if seed % 3 == 0:  # a pack
        lens = torch.tensor([[rng.choice((0, 2, 7, 19)) for _ in range(k)] for _ in range(rng.randint(1, 6))])
        lens[0, 0] += 1
        seq = int(lens.sum())
        return MaskInfo.from_segments(topo, lens.to(device), seq, seq, causal, packed=True)
    batch = rng.randint(1, 3)
    lens = torch.tensor([[rng.choice((0, 1, 6, 21, 40)) for _ in range(k)] for _ in range(batch)])
    seq = max(int(lens.sum(-1).max()), 1) + rng.choice((0, 5))  # ragged: padding past every row
    seq_q = rng.choice((seq, max(1, seq // 3)))
    q_start = torch.tensor([rng.randint(0, seq - seq_q) for _ in range(batch)]) if seed % 3 == 2 else None
    return MaskInfo.from_segments(topo, lens.to(device), seq_q, seq, causal, q_start=q_start)


@pytest.mark.parametrize("seed", range(12))  # every (k, pack / batch / q_start) pairing
def test_kernel_lists_match_torch_classes(seed, device):
    """Fixed-slot lists for even seeds, packed (CSR) lists for odd ones; by query and by key."""
    compact_bytes = 0 if seed % 2 else bit_lists.COMPACT_BYTES
    info = _info(seed, device)
    for block_m, block_n in ((16, 16), (32, 16)):
        live, full = classify_blocks_from_codes(info.q_codes, info.k_codes, info.table, block_m, block_n,
                                                info.causal, info.q_start)
        for by_key in (False, True):
            l, f = (live.transpose(1, 2), full.transpose(1, 2)) if by_key else (live, full)
            want_counts, want_ids = (t.cpu() for t in lists_from_classes(l, f).padded(l.shape[2]))
            got = info.lists(block_m, block_n, by_key, compact_bytes).padded(l.shape[2])
            got_counts, got_ids = (t.cpu().expand_as(w) for t, w in zip(got, (want_counts, want_ids)))
            where = f"tile {block_m}x{block_n}, by_key={by_key}"
            assert torch.equal(got_counts, want_counts), f"counts differ at {where}"
            wrong = got_ids != want_ids
            assert not wrong.any(), f"list entries differ at {wrong.nonzero()[:5].tolist()} ({where})"
