"""Dropout with pair types over the process group: the ranks together draw the single-GPU dropout mask, bit for bit.

A five-segment topology with NONE, FULL and CAUSAL pairs (:data:`benchmarks.cp_cases.PAIRS5`) and dropout 0.1.
Two checks against ``mbs_attention`` on the whole sequence with the same seed (rank 0's, broadcast by
``ContextParallel``; every other rank starts from another generator state on purpose):

- **the mask, exactly**, by probes: with q = 0 every visible key of a row gets the same weight, so with v one-hot
  (key j carries the unit vector of column j - bD, for the keys of block b of D keys, the other keys 0) the output's
  column j - bD is nonzero exactly when key j is visible and kept. One forward per block of D keys, on the ranks
  and on one GPU; the two zero patterns must be equal on every (batch, head, query, key), and the first block's
  pattern under another seed must differ (the probes can see a wrong mask);
- **the values**: out, dq, dk, dv on random inputs, relative L2 against the single-GPU run.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mmsparse import mbs_attention
from mmsparse.distributed import ContextParallel

from .configs import live_pairs
from .cp_cases import CPCase
from .cp_dist import reduce_value, sharded_error, shared_randn

SEED = 1234


def _cp_forward(cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    torch.manual_seed(SEED + 1 + dist.get_rank())  # other states on other ranks: rank 0's seed must reach them all
    return cp.attention(q, k, v, dropout_p=p)


def _single_forward(case: CPCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int = SEED + 1
                    ) -> torch.Tensor:
    torch.manual_seed(seed)  # by default rank 0's state: the seed the ranks used
    return mbs_attention(q, k, v, case.topology, case.seg_lens, causal=case.causal, dropout_p=case.dropout_p)


def check(case: CPCase, device: torch.device, dtype: torch.dtype, tolerance: float) -> dict:
    """The dropout check's row: mask mismatches (must be 0), the fraction of visible pairs kept, the relative L2
    errors of out, dq, dk, dv, and ``ok``."""
    cp = ContextParallel(case.topology, case.seg_lens, causal=case.causal)
    index = cp.token_index.to(device)
    b, hq, hkv, d, s = case.batch, case.heads_q, case.heads_kv, case.head_dim, case.seq_len
    q, k, v, dout = shared_randn([(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d)], dtype, device, SEED)

    leaves = [t.index_select(2, index).requires_grad_() for t in (q, k, v)]
    out_l = _cp_forward(cp, *leaves, case.dropout_p)
    out_l.backward(dout.index_select(2, index))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _single_forward(case, *full)
    ref.backward(dout)
    errors = {name: sharded_error(got, want.index_select(2, index), device)
              for name, got, want in (("out", out_l.detach(), ref.detach()),
                                      *((n, t.grad, f.grad) for n, t, f in zip(("dq", "dk", "dv"), leaves, full)))}
    del leaves, full, out_l, ref

    mismatches = kept = other_seed = 0
    q0 = torch.zeros_like(q)
    with torch.no_grad():
        for block in range(math.ceil(s / d)):
            keys = torch.arange(block * d, min(s, (block + 1) * d), device=device)
            probe = torch.zeros_like(v)
            probe[:, :, keys, keys - block * d] = 1
            got = _cp_forward(cp, q0.index_select(2, index), k.index_select(2, index), probe.index_select(2, index),
                              case.dropout_p) != 0
            want = _single_forward(case, q0, k, probe).index_select(2, index) != 0
            mismatches += int((got ^ want).sum())
            kept += int(got.sum())
            if block == 0:  # the probes can tell masks apart: another seed's mask differs
                other = _single_forward(case, q0, k, probe, seed=SEED + 2).index_select(2, index) != 0
                other_seed = int((got ^ other).sum())
    mismatches = int(reduce_value(mismatches, device))
    other_seed = int(reduce_value(other_seed, device))
    kept_fraction = reduce_value(kept, device) / (b * hq * live_pairs(case.topology, case.seg_lens, None, case.causal))
    ok = mismatches == 0 and other_seed > 0 and all(e["rel_l2"] <= tolerance for e in errors.values())
    return {"config": case.name, "layout": case.layout, "dropout_p": case.dropout_p, "mask_mismatches": mismatches,
            "other_seed_mismatches": other_seed, "kept_fraction": kept_fraction, "probes": math.ceil(s / d),
            **{f"{n}_rel_l2": e["rel_l2"] for n, e in errors.items()}, "tolerance": tolerance, "ok": ok}
