"""The pieces' log-sum-exp merge (the forward's split-KV combine kernel) against a float64 merge, with rows that
some pieces, or all of them, do not see."""

import torch

from mmsparse.distributed.pieces import merge


def test_merge_matches_float64(device):
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 3, 40, 16, generator=gen).to(device, torch.bfloat16) for _ in range(3)]
    lses = [(torch.randn(2, 3, 40, generator=gen) * 4).to(device) for _ in range(3)]
    for lse, rows in zip(lses, (3, 5, 3)):  # rows 0-2 see nothing anywhere; rows 3-4 only in two pieces
        lse[0, 0, :rows] = float("inf")
    out, lse = merge(outs, lses)
    parts, part_lses = torch.stack(outs).double(), torch.stack(lses).double()
    weights = torch.where(part_lses == float("inf"), 0.0, torch.exp2(part_lses))
    total = weights.sum(0)
    want = (weights[..., None] * parts).sum(0) / torch.where(total == 0, 1.0, total)[..., None]
    want_lse = torch.where(total > 0, torch.log2(torch.where(total > 0, total, 1.0)), float("inf"))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
    seen = want_lse.isfinite()
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    assert (lse[~seen] == float("inf")).all() and (out[0, 0, :3] == 0).all()
