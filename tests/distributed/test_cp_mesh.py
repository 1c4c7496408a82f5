"""Context parallelism over 4 processes (gloo, Triton's interpreter): test_context_parallel.py's sample of cases for 4
ranks, then the context-parallel group as one dim of a 2-D (dp x cp) mesh, with FSDP2 sharding the weights over the
other. A file of its own so that the test runner can run it beside the 2- and 3-rank ones."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_context_parallel import _worker


def test_four_ranks_and_a_dp_cp_mesh_match_the_reference(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo test; GPUs run the NCCL one")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    mp.spawn(_worker, args=(4, str(tmp_path / "init")), nprocs=4, join=True)
