"""A copy of a Topology starts with none of the original's bookkeeping: the streams recorded per kept table are keyed
by the table's id, which a copy's own tables could reuse (a stream then taken as recorded would not be)."""

from __future__ import annotations

import copy
import pickle

import torch

from mmsparse import Topology


def test_a_copy_starts_with_no_kept_tables_nor_readers(device):
    topo = Topology([[1, 2], [0, 1]])
    topo.pair_table(device)
    Topology([[1, 1], [0, 1]]).bit_tables(device)
    topo._readers[12345] = {7}  # what a GPU run records
    for twin in (pickle.loads(pickle.dumps(topo)), copy.deepcopy(topo)):
        assert twin._readers == {} and twin._pair_tables == {} and twin._tables == {}
        assert twin == topo and torch.equal(twin.pair_table(device).cpu(), topo.pair_table(device).cpu())
