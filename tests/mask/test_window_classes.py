"""A sliding window (key position > query position - W) in the torch tile classes of every mask mode, against a
brute-force reduction of the dense windowed mask, tile by tile; the window's pair counts and argument checks."""

from __future__ import annotations

import random

import pytest
import torch

from mmsparse import Topology, reference_mask
from mmsparse.checks import check_window
from mmsparse.mask.blocks import cdiv
from mmsparse.mask.code_blocks import count_pairs_from_codes
from mmsparse.mask.info import MaskInfo
from mmsparse.mask.segment_codes import token_codes


def brute_force_classes(mask: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(live, full) of a dense bool mask ``[B, Sq, Sk]``, tile by tile: live when some pair is allowed, full when
    every pair of the tile's real rows is and the key block lies inside the keys."""
    b, sq, sk = mask.shape
    nq, nk = cdiv(sq, bm), cdiv(sk, bn)
    live = torch.zeros(b, nq, nk, dtype=torch.bool)
    full = torch.zeros(b, nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            tile = mask[:, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            live[:, i, j] = tile.flatten(1).any(1)
            full[:, i, j] = tile.flatten(1).all(1) & ((j + 1) * bn <= sk)
    return live, full


def band_edge(q_start: torch.Tensor, sq: int, sk: int, bm: int, bn: int, window: int) -> torch.Tensor:
    """bool ``[B, NQ, NK]``: tiles with positions both inside and before the band (brute force over positions)."""
    nq, nk = cdiv(sq, bm), cdiv(sk, bn)
    edge = torch.zeros(q_start.numel(), nq, nk, dtype=torch.bool)
    for b, start in enumerate(q_start.tolist()):
        for i in range(nq):
            rows = torch.arange(i * bm, min((i + 1) * bm, sq)) + start
            for j in range(nk):
                cols = torch.arange(j * bn, min((j + 1) * bn, sk))
                inside = cols[None, :] > rows[:, None] - window
                edge[b, i, j] = bool(inside.any()) and not bool(inside.all())
    return edge


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    types = (0, 1, 2) if rng.random() < 0.5 else (0, 1)
    topo = [[rng.choice(types) for _ in range(k)] for _ in range(k)]
    lens = [rng.choice([0, 1, rng.randint(2, 30), rng.randint(30, 90)]) for _ in range(k)]
    if sum(lens) == 0:
        lens[0] = 9
    seq_k = sum(lens)
    seq_q = seq_k if rng.random() < 0.6 else rng.randint(1, seq_k)
    tile = rng.choice([(16, 16), (32, 16), (16, 32), (8, 64)])
    window = rng.choice([1, 3, tile[0], tile[1] + 5, 37, max(seq_k - 1, 1)])
    return dict(topo=topo, lens=lens, seq_q=seq_q, seq_k=seq_k, causal=rng.random() < 0.5, tile=tile,
                window=window)


def _assert_classes(live, full, exact_live, exact_full, edge, exact_everywhere: bool) -> None:
    """Full tiles are exactly the all-allowed ones; live tiles hold every allowed pair, and any live tile without
    one crosses the band's edge (bits) or there is none (codes, dense: exact)."""
    assert torch.equal(full, exact_full), f"full differs at {(full != exact_full).nonzero()[:5].tolist()}"
    missed = exact_live & ~live
    assert not missed.any(), f"tiles with allowed pairs left out at {missed.nonzero()[:5].tolist()}"
    extra = live & ~exact_live
    if exact_everywhere:
        assert not extra.any(), f"empty tiles listed at {extra.nonzero()[:5].tolist()}"
    else:
        assert not (extra & ~edge).any(), f"tiles before the band listed at {(extra & ~edge).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("seed", range(40))
def test_classes_against_the_dense_windowed_mask(seed):
    c = _case(seed)
    topo, lens, seq_q, seq_k, causal, (bm, bn), w = (c[n] for n in ("topo", "lens", "seq_q", "seq_k", "causal",
                                                                      "tile", "window"))
    topology = Topology(topo)
    dense = reference_mask(topo, lens, seq_k, seq_q, causal=causal, window=w)
    exact_live, exact_full = brute_force_classes(dense, bm, bn)
    q_start = torch.tensor([seq_k - seq_q])
    edge = band_edge(q_start, seq_q, seq_k, bm, bn, w)
    lens_t = torch.tensor([lens])
    if topology.uses_bits:
        info = MaskInfo.from_topology(topology, lens_t, seq_q, seq_k, causal, window=w)
        _assert_classes(*info.classes(bm, bn), exact_live, exact_full, edge, exact_everywhere=False)
    info = MaskInfo.from_segments(topology, lens_t, seq_q, seq_k, causal, window=w)
    _assert_classes(*info.classes(bm, bn), exact_live, exact_full, edge, exact_everywhere=True)
    # The dense path: the user's mask (here the topology's, without the window), the window applied by the call.
    plain = reference_mask(topo, lens, seq_k, seq_q, causal=causal)
    info = MaskInfo.from_dense(plain, causal, window=w)
    _assert_classes(*info.classes(bm, bn), exact_live, exact_full, edge, exact_everywhere=True)


def test_tiles_before_the_band_are_empty():
    """Causal, one full segment, W = 20 at 16x16 tiles: a tile is live iff the band meets it, which for this mask
    is exact, and each row block keeps at most 3 tiles, not the causal triangle's up to 10."""
    seq, w = 160, 20
    info = MaskInfo.from_topology(Topology([[1]]), torch.tensor([[seq]]), seq, seq, True, window=w)
    live, full = info.classes(16, 16)
    exact_live, exact_full = brute_force_classes(reference_mask([[1]], [seq], seq, causal=True, window=w), 16, 16)
    assert torch.equal(live, exact_live) and torch.equal(full, exact_full)
    assert live[0].sum(1).tolist() == [1, 2] + [3] * 8
    assert not full.any()  # W < 2 tiles: every tile before the diagonal one crosses the band's edge


@pytest.mark.parametrize("q_start", [[0, 17], [30, 5]])
def test_per_sample_first_queries(q_start):
    """Decoding over caches of different lengths: each sample's band sits at its own query positions."""
    topo, lens, seq_q, seq_k, w = [[1, 2], [1, 1]], [(20, 30), (35, 12)], 13, 50, 11
    dense = reference_mask(topo, lens, seq_k, seq_q, causal=False, q_start=q_start, window=w)
    exact_live, exact_full = brute_force_classes(dense, 8, 16)
    starts = torch.tensor(q_start)
    info = MaskInfo.from_segments(Topology(topo), torch.tensor(lens), seq_q, seq_k, False, q_start=starts, window=w)
    edge = band_edge(starts, seq_q, seq_k, 8, 16, w)
    _assert_classes(*info.classes(8, 16), exact_live, exact_full, edge, exact_everywhere=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 4, 9, 100])
def test_pair_counts(causal, window):
    """The picture's density: allowed pairs counted from the runs equal the dense windowed mask's."""
    topo, lens = [[1, 2, 0], [2, 1, 1], [0, 1, 2]], [[7, 0, 12], [3, 9, 5]]
    codes = token_codes(torch.tensor(lens), 3, 19 + 17, packed=True)
    table = Topology(topo).pair_table(codes.device)
    got = count_pairs_from_codes(codes, codes, table, causal, 0, window)
    want = MaskInfo.from_segments(Topology(topo), torch.tensor(lens), 36, 36, causal, packed=True,
                                  window=window).code_mask().sum()
    assert int(got[0]) == int(want)


def test_reference_window_rule():
    """Key j is kept for query i exactly when j > i - W, on top of the topology: FULL pairs keep future keys."""
    mask = reference_mask([[1]], [6], 6, window=2)[0]
    want = torch.tensor([[j > i - 2 for j in range(6)] for i in range(6)])
    assert torch.equal(mask, want)
    assert torch.equal(reference_mask([[2]], [6], 6, window=2)[0], want & torch.ones(6, 6, dtype=torch.bool).tril())


def test_window_argument_checks():
    assert check_window(None) is None and check_window(5) == 5 and check_window(5, 10) == 5
    assert check_window(10, 10) is None and check_window(99, 10) is None  # keeps every key: no window
    for bad in (0, -3):
        with pytest.raises(ValueError, match="window must be a positive int"):
            check_window(bad)
    for bad in (2.0, "8", True, [4]):
        with pytest.raises(TypeError, match="window must be a positive int"):
            check_window(bad)
