"""The mask cache keys lengths and topologies by their whole value. numpy and torch print past 1000 elements with
the middle elided, so a key made of a printout gave two masks that differ only there one cache entry: the second
call ran with the first one's mask. Each case here has 1001 segments (most of them empty, so the sequence stays a
few tokens long) and checks both calls against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmsparse import mbs_attention, reference_attention, reference_mask
from mmsparse.mask.keys import value_key

SEGMENTS = 1001  # past numpy's and torch's printout threshold of 1000 elements


def _inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(1, 2, seq, 16, generator=g) for _ in range(3))


def _check(out: torch.Tensor, q, k, v, topology, lens) -> None:
    ref = reference_attention(q, k, v, reference_mask(topology, lens, k.shape[2]))
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-5, f"max error {err:.3e} against the float64 reference: another call's mask was used"


def test_numpy_lengths_that_differ_only_in_the_middle(device):
    """Same sum, same first and last elements: the lengths differ only where numpy's printout elides."""
    topology = torch.ones(SEGMENTS, SEGMENTS, dtype=torch.int8)
    topology[499] = 0  # segment 499 sees only itself; every other one sees all
    topology[499, 499] = 1
    a = np.zeros(SEGMENTS, dtype=np.int64)
    b = a.copy()
    a[[0, 499, 1000]] = 1
    b[[0, 501, 1000]] = 1
    assert repr(a) == repr(b) and not (a == b).all()
    q, k, v = (t.to(device) for t in _inputs(3))
    for lens in (a, b):
        _check(mbs_attention(q, k, v, topology, lens), q, k, v, topology, lens.tolist())


@pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy.ndarrays")  # the rows are the point
def test_topology_rows_that_differ_only_in_the_middle(device):
    """A topology given as a list of numpy rows: rows 0 of the two differ only in column 500."""
    first = [np.ones(SEGMENTS, dtype=np.int64) for _ in range(SEGMENTS)]
    second = [row.copy() for row in first]
    second[0][500] = 0  # segment 0 no longer sees segment 500
    assert repr(first) == repr(second)
    lens = [0] * SEGMENTS
    lens[0], lens[500] = 2, 1
    q, k, v = (t.to(device) for t in _inputs(3))
    for topology in (first, second):
        dense = torch.tensor(np.stack(topology))
        _check(mbs_attention(q, k, v, topology, tuple(lens)), q, k, v, dense, lens)


def test_keys_hold_every_element_and_tell_kinds_apart():
    """The common case is the tuple itself; numpy integers are ints; bools, floats and arrays are told apart from
    the ints they equal, so that a value the validation refuses never finds the entry of one it accepts."""
    lens = (3, 4, 5)
    assert value_key(lens) is lens
    assert value_key([3, 4, 5]) == lens
    assert value_key(tuple(np.array(lens))) == lens
    long = np.zeros(SEGMENTS, dtype=np.int64)
    other = long.copy()
    other[500] = 1
    assert value_key(long) != value_key(other)
    assert value_key((True, 1)) != value_key((1, 1))
    assert value_key([(1, 2), (3, 4)]) != value_key((1, 2, 3, 4))
    assert value_key([np.array([1, 2])]) != value_key([(1, 2)])
    assert value_key((1.0, 2)) is None and value_key(None) is None


def test_bool_lengths_still_refused_after_equal_ints_are_cached(device):
    q = torch.randn(1, 1, 2, 16, device=device)
    mbs_attention(q, q, q, [[1, 1], [1, 1]], (1, 1))
    with pytest.raises(TypeError, match="must be an int"):
        mbs_attention(q, q, q, [[1, 1], [1, 1]], (True, True))
