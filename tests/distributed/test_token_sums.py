"""The dK/dV return's sum (``TokenSum``): each local token adds its rows from several sources, through a per-token
index (-1: nothing there), in float32, the last pass writing the result's dtype. Checked against a float64 sum
in plain torch, at a head dim that is not a power of two, a token count that is not a multiple of the program's
block, and tokens that no source reaches."""

from __future__ import annotations

import pytest
import torch

from mmsparse.distributed.token_sums import TokenSum


def _index(n: int, source_len: int, gen: torch.Generator) -> torch.Tensor:
    index = torch.randperm(source_len, generator=gen)[:n].to(torch.int32)
    index[torch.rand(n, generator=gen) < 0.3] = -1
    return index


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                              (torch.float16, torch.float32)])
@pytest.mark.parametrize("count", [1, 3])
def test_sums_every_source_through_its_index(dtype, out_dtype, count, device):
    gen = torch.Generator().manual_seed(count)
    shape = (2, 3, 70, 24)  # 70 tokens: past one 64-token program, ragged; D = 24
    sources = [(torch.randn(2, 3, n, 24, generator=gen).to(dtype), None) for n in (90, 70, 75)[:count]]
    sources = [(s, _index(70, s.shape[2], gen)) for s, _ in sources]
    sources[-1][1][5:9] = -1  # with the others' -1s: tokens no source reaches
    summed = TokenSum(shape, out_dtype, device)
    for source, index in sources[:-1]:
        summed.add(source.to(device), index.to(device))
    out = summed.finish(*(t.to(device) for t in sources[-1])).cpu()
    expected = torch.zeros(shape, dtype=torch.float64)
    for source, index in sources:
        seen = index >= 0
        expected[:, :, seen] += source[:, :, index[seen].long()].double()
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.double(), expected.to(out_dtype).double(), rtol=1e-3, atol=1e-3)


def test_no_source_is_zeros_and_a_finish_without_its_last_source_is_refused(device):
    summed = TokenSum((1, 1, 5, 8), torch.float32, device)
    assert torch.equal(summed.finish(), torch.zeros(1, 1, 5, 8, device=device))
    summed.add(torch.ones(1, 1, 5, 8, device=device), torch.arange(5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="last source"):
        summed.finish()
    with pytest.raises(ValueError, match="does not add to a sum"):
        TokenSum((1, 1, 5, 8), torch.float32, device).add(torch.ones(1, 2, 5, 8, device=device),
                                                          torch.arange(5, dtype=torch.int32, device=device))
