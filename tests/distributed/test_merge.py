"""The pieces' log-sum-exp merge (the forward's split-KV combine kernel, or for two pieces the pair kernel that
reads them as they are) against a float64 merge, with rows that some pieces, or all of them, do not see."""

import pytest
import torch

from mmsparse.attention.forward import combine_partials
from mmsparse.distributed.pieces import merge


@pytest.mark.parametrize("parts", [2, 3])
def test_merge_matches_float64(parts, device):
    gen = torch.Generator().manual_seed(parts)
    outs = [torch.randn(2, 3, 40, 16, generator=gen).to(device, torch.bfloat16) for _ in range(parts)]
    lses = [(torch.randn(2, 3, 40, generator=gen) * 4).to(device) for _ in range(parts)]
    for lse, rows in zip(lses, (3, 5, 3)):  # rows 0-2 see nothing anywhere; rows 3-4 only in some pieces
        lse[0, 0, :rows] = float("inf")
    out, lse = merge(outs, lses)
    stacked, part_lses = torch.stack(outs).double(), torch.stack(lses).double()
    weights = torch.where(part_lses == float("inf"), 0.0, torch.exp2(part_lses))
    total = weights.sum(0)
    want = (weights[..., None] * stacked).sum(0) / torch.where(total == 0, 1.0, total)[..., None]
    want_lse = torch.where(total > 0, torch.log2(torch.where(total > 0, total, 1.0)), float("inf"))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
    seen = want_lse.isfinite()
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    assert (lse[~seen] == float("inf")).all() and (out[0, 0, :3] == 0).all()
    if parts == 2:  # the pair kernel's sums are the stacked kernel's, in the same order
        lse_in = torch.stack([torch.where(s == float("inf"), float("-inf"), s) for s in lses])
        want_out, want_lse = combine_partials(torch.stack([o.float() for o in outs]), lse_in, torch.bfloat16)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
