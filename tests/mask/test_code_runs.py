"""The runs of segment codes and their block summaries (mmsparse.mask.code_lists) against plain torch."""

from __future__ import annotations

import pytest
import torch

from mmsparse.mask.code_lists import block_summary, code_runs
from mmsparse.mask.segment_codes import SEG_BITS


def _reference_runs(row: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    run, starts, codes = [], [], []
    for t, c in enumerate(row.tolist()):
        if t == 0 or c != row[t - 1]:
            starts.append(t)
            codes.append(c)
        run.append(len(starts) - 1)
    return run, starts + [row.numel()], codes


@pytest.mark.parametrize("seq", [1, 5, 2500])
def test_runs_and_summaries(seq, device):
    """Rows longer than the kernel's chunk (runs cross chunk edges), single tokens, a row of one run, and
    strided (sliced) inputs; summaries at block sizes that do and do not divide the length."""
    gen = torch.Generator().manual_seed(seq)
    lengths = torch.randint(1, 40, (2, seq), generator=gen)
    docs = torch.randint(0, 3, (2, seq), generator=gen).cumsum(1)
    codes = torch.stack([torch.repeat_interleave((docs[b] << SEG_BITS) | (docs[b] % 5), lengths[b])[:seq]
                         for b in range(2)])
    codes[1] = 7 if seq > 1 else codes[1]  # one run
    wide = torch.zeros((2, seq + 3), dtype=torch.int32)
    wide[:, 3:] = codes
    codes = wide[:, 3:].to(device)  # row stride seq + 3
    if seq == 5:  # a column stride of 2
        codes = torch.stack([codes, codes], -1).flatten(1).to(device)[:, ::2]
    run, starts, run_codes = code_runs(codes)
    for b in range(2):
        want_run, want_starts, want_codes = _reference_runs(codes[b].cpu())
        n = len(want_codes)
        assert run[b].tolist() == want_run
        assert starts[b, : n + 1].tolist() == want_starts and run_codes[b, :n].tolist() == want_codes
    for block in (16, 64, 128):
        got = block_summary(codes, run, block).cpu()
        n = -(-seq // block)
        assert got.shape == (2, n, 4)
        for b in range(2):
            for i in range(n):
                part = slice(i * block, min(seq, (i + 1) * block))
                doc = codes[b, part].cpu() >> SEG_BITS
                want = [run[b, part.start].item(), run[b, part.stop - 1].item(), doc.min().item(), doc.max().item()]
                assert got[b, i].tolist() == want, (b, i, block)
