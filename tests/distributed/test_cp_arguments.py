"""ContextParallel.attention checks q, k, v and its scale as mbs_attention does: a clear ValueError or TypeError,
never a run on heads that do not group, head dims that differ, or a dtype the kernels do not take (it checked only
the shapes' local length, dtypes alike and batches alike before). A world of one rank over gloo (CPU)."""

from __future__ import annotations

import pytest
import torch

from mmsparse.distributed import ContextParallel
from tests.helpers import HUB

LENS = (9, 20, 13)
S = sum(LENS)


def _qkv(heads=(2, 1, 1), dims=(16, 16, 16), dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.randn(1, h, S, d).to(dtype) for h, d in zip(heads, dims)]


@pytest.mark.parametrize(("args", "error", "message"), [
    (dict(heads=(3, 2, 2)), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    (dict(dims=(12, 12, 12)), ValueError, "head dim 12 is not supported"),
    (dict(dims=(16, 32, 32)), ValueError, "head dims differ: q has 16, k/v have 32"),
    (dict(dtype=torch.float64), TypeError, "q has dtype torch.float64"),
    (dict(dtype=torch.int32), TypeError, "q has dtype torch.int32"),
], ids=["gqa-3-over-2", "head-dim-12", "head-dims-differ", "float64", "int32"])
def test_bad_qkv_are_refused(one_rank_world, args, error, message):
    cp = ContextParallel(HUB, LENS)
    with pytest.raises(error, match=message):
        cp.attention(*_qkv(**args))


def test_a_non_tensor_and_a_wrong_local_length_are_refused(one_rank_world):
    cp = ContextParallel(HUB, LENS)
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be a torch.Tensor; got list"):
        cp.attention([1], k, v)
    with pytest.raises(ValueError, match=r"q must be \[B, H, S_local=42, D\]"):
        cp.attention(q[:, :, :40], k[:, :, :40], v[:, :, :40])


def test_a_bad_softmax_scale_is_refused(one_rank_world):
    cp = ContextParallel(HUB, LENS)
    with pytest.raises(ValueError, match="softmax_scale must be a finite positive number; got 0.0"):
        cp.attention(*_qkv(), softmax_scale=0.0)
    with pytest.raises(TypeError, match="softmax_scale must be a positive float or None"):
        cp.attention(*_qkv(), softmax_scale="x")


def test_shard_and_unshard_check_their_sequence_dim(one_rank_world):
    """A seq_dim that is not a dim of the tensor, or not an int, is named in a ValueError/TypeError (an IndexError
    from inside before); a negative one counts from the end, as torch's dims do."""
    cp = ContextParallel(HUB, LENS)
    positions = torch.arange(S)[None]
    assert torch.equal(cp.shard(positions, seq_dim=-1), cp.shard(positions, seq_dim=1))
    local = cp.shard(positions, seq_dim=1)
    assert torch.equal(cp.unshard(local, seq_dim=-1), positions)
    with pytest.raises(ValueError, match=r"seq_dim 5 is not a dim of x, which has shape \(1, 42\)"):
        cp.shard(positions, seq_dim=5)
    with pytest.raises(ValueError, match="seq_dim -3 is not a dim of x_local"):
        cp.unshard(local, seq_dim=-3)
    with pytest.raises(TypeError, match="seq_dim must be an int"):
        cp.shard(positions, seq_dim=1.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor; got list"):
        cp.shard([0, 1], seq_dim=0)


def test_lengths_of_other_samples_than_the_batch_are_refused(one_rank_world):
    cp = ContextParallel(HUB, [LENS, LENS])
    with pytest.raises(ValueError, match="seg_lens has 2 rows but the batch has 1 sample$"):
        cp.attention(*_qkv())


def test_a_double_backward_through_attention_or_unshard_raises(one_rank_world):
    """Their gradients are computed outside autograd (kernels, collectives): differentiated again (a gradient
    penalty) they raise instead of dropping the terms through them (``mmsparse.attention.first_order``)."""
    cp = ContextParallel(HUB, LENS)
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = cp.attention(q, k, v)
    grad_q, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="ContextParallel.attention's gradients .* cannot be differentiated again"):
        grad_q.square().sum().backward()
    local = torch.randn(1, 2, cp.local_len, 16, requires_grad=True)
    whole = cp.unshard(local, seq_dim=2)
    grad_local, = torch.autograd.grad(whole.square().sum(), local, create_graph=True)
    with pytest.raises(RuntimeError, match="ContextParallel.unshard's gradients .* cannot be differentiated again"):
        torch.autograd.grad(grad_local.sum(), local)
