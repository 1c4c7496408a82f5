"""Fixtures of the context-parallel tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_world():
    """A process group of one rank over gloo, on the CPU (the kernels on CPU tensors run through the interpreter);
    skipped where CUDA is: what these tests check is Python."""
    if torch.cuda.is_available():
        pytest.skip("the CPU/gloo test (the kernels on CPU tensors run through the interpreter); the guard is Python")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()
