"""The torch tile classes of segment-code masks (mmsparse.mask.code_blocks) against the dense float64-path references:
pair types, many segments, packs, causal, q_start offsets, ragged ends, tiles that do and do not divide."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import CAUSAL, FULL, NONE
from mmsparse.mask import code_blocks
from mmsparse.mask.blocks import classify_blocks_from_mask
from mmsparse.mask.code_blocks import classify_blocks_from_codes, count_pairs_from_codes
from mmsparse.mask.segment_codes import query_codes, token_codes
from mmsparse.mask.topology import Topology
from mmsparse.reference import reference_mask, reference_packed_mask

TILES = ((16, 16), (16, 32), (32, 16), (1, 1), (3, 5))


def _types(rng: random.Random, k: int) -> list[list[int]]:
    return [[rng.choice((NONE, FULL, CAUSAL, FULL)) for _ in range(k)] for _ in range(k)]


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, torch.Tensor, torch.Tensor]:
    """(query codes, key codes, pair table, causal, q_start, the dense mask [B, Sq, Sk]) of a random case."""
    rng = random.Random(seed)
    k = (1, 2, 5, 7, 40)[seed % 5]  # 40: past the 32 segments of the bit vectors
    topo = Topology(_types(rng, k))
    causal = rng.random() < 0.3
    if seed % 3 == 0:  # a pack: samples end to end, each seeing only itself
        lens = torch.tensor([[rng.choice((0, 0, 1, 3, 9, 17)) for _ in range(k)] for _ in range(rng.randint(1, 9))])
        lens[0, 0] += 1  # never empty
        seq = int(lens.sum())
        codes = token_codes(lens, k, seq, packed=True)
        return codes, codes, topo.pair_table(codes.device), causal, torch.zeros(1, dtype=torch.int64), (
            reference_packed_mask(topo, lens, causal))
    batch = rng.randint(1, 3)
    lens = torch.tensor([[rng.choice((0, 1, 5, 13, 30)) for _ in range(k)] for _ in range(batch)])
    seq = max(int(lens.sum(-1).max()), 1) + rng.choice((0, 3))  # 3: padding at every row's end
    seq_q = rng.choice((seq, max(1, seq // 3)))
    starts = [rng.randint(0, seq - seq_q) for _ in range(batch)] if seed % 3 == 2 else [seq - seq_q] * batch
    k_codes = token_codes(lens, k, seq, packed=False)
    q_start = torch.tensor(starts)
    q_codes = query_codes(k_codes, seq_q, q_start, k)
    dense = reference_mask(topo, lens, seq, seq_q, causal, starts)
    return q_codes, k_codes, topo.pair_table(k_codes.device), causal, q_start, dense


@pytest.mark.parametrize("seed", range(30))  # every (k, pack / batch / q_start) pairing, twice
def test_classes_match_the_dense_mask(seed, monkeypatch):
    if seed % 2:  # piece pairs in many small steps
        monkeypatch.setattr(code_blocks, "_PAIRS_PER_STEP", 7)
    q_codes, k_codes, table, causal, q_start, dense = _case(seed)
    for block_m, block_n in TILES:
        want_live, want_full = classify_blocks_from_mask(dense, block_m, block_n, False, q_start)
        live, full = classify_blocks_from_codes(q_codes, k_codes, table, block_m, block_n, causal, q_start)
        assert torch.equal(live, want_live.expand_as(live)), f"live tiles differ at {block_m}x{block_n}"
        assert torch.equal(full, want_full.expand_as(full)), f"full tiles differ at {block_m}x{block_n}"
    pairs = count_pairs_from_codes(q_codes, k_codes, table, causal, q_start)
    assert pairs.tolist() == dense.sum((1, 2)).expand(q_codes.shape[0]).tolist()


def test_causal_pair_diagonal_is_partial():
    """A CAUSAL pair of one segment over 64 tokens at 16x16 tiles: full below the diagonal, partial on it,
    empty above."""
    codes = token_codes(torch.tensor([[64]]), 1, 64, packed=False)
    live, full = classify_blocks_from_codes(codes, codes, Topology([[CAUSAL]]).pair_table(codes.device), 16, 16,
                                            False, 0)
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    assert torch.equal(live[0], cols <= rows)
    assert torch.equal(full[0], cols < rows)


def test_no_pairs_across_samples_of_a_pack():
    """Two samples of one FULL segment: two full diagonal blocks, nothing between them."""
    lens = torch.tensor([[32], [32]])
    codes = token_codes(lens, 1, 64, packed=True)
    live, full = classify_blocks_from_codes(codes, codes, Topology([[FULL]]).pair_table(codes.device), 32, 32,
                                            False, 0)
    assert torch.equal(live[0], torch.eye(2, dtype=torch.bool)) and torch.equal(full[0], live[0])


def test_empty_sides():
    codes = torch.zeros((1, 0), dtype=torch.int32)
    live, full = classify_blocks_from_codes(codes, codes, Topology([[FULL]]).pair_table(codes.device), 16, 16,
                                            False, 0)
    assert live.shape == full.shape == (1, 0, 0)


def test_mask_info_classes_build_no_dense_mask(monkeypatch):
    """MaskInfo.classes of a segment-code mask comes from the runs, never from the S x S code mask."""
    from mmsparse.mask.info import CodeMask, MaskInfo

    topo = Topology([[CAUSAL, NONE, FULL], [FULL, FULL, NONE], [NONE, CAUSAL, CAUSAL]])
    lens = torch.tensor([[10, 25, 7], [3, 0, 30]])
    info = MaskInfo.from_segments(topo, lens, 20, 45, True, q_start=torch.tensor([25, 4]))
    dense = info.code_mask()

    def no_dense_mask(self):
        raise AssertionError("classes() built the S x S mask")

    monkeypatch.setattr(CodeMask, "code_mask", no_dense_mask)
    live, full = info.classes(16, 16)
    want_live, want_full = classify_blocks_from_mask(dense, 16, 16, False, info.q_start)
    assert torch.equal(live, want_live) and torch.equal(full, want_full)
