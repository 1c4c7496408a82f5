"""The public entry points document the topologies they take: pair types 0/1/2, any number of segments, a
Topology; none of them says the topology is a 0/1 matrix."""

from __future__ import annotations

import pytest

import mmsparse
from mmsparse.__main__ import build_parser
from mmsparse.distributed import ContextParallel
from mmsparse.nn import MultiheadMBSAttention, MultimodalSelfAttention, replace_attention

PUBLIC = [mmsparse.mbs_attention, mmsparse.TritonMBSAttnKernel, MultimodalSelfAttention, MultiheadMBSAttention,
          replace_attention, ContextParallel, mmsparse.tile_map, mmsparse.tile_picture]


@pytest.mark.parametrize("obj", PUBLIC, ids=[o.__name__ for o in PUBLIC])
def test_topology_argument_documents_pair_types(obj):
    doc = obj.__doc__
    assert "0/1 matrix" not in doc
    assert all(word in doc for word in ("NONE", "FULL", "CAUSAL", "Topology")), doc


def test_cli_help_documents_pair_types_and_packs():
    text = " ".join(build_parser().format_help().split())
    assert "0/1 matrix" not in text
    assert "0 none, 1 full, 2 causal" in text and "any number of segments" in text and "--packed" in text
