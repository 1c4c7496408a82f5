"""One multimodal sequence over several processes with context parallelism, checked against one process.

    torchrun --nproc-per-node 2 examples/context_parallel.py            # GPUs: NCCL; CPUs: gloo + interpreter
    torchrun --nproc-per-node 4 examples/context_parallel.py --causal

Every rank draws the same full inputs, keeps its shard (``cp.shard``), runs ``cp.attention`` forward and
backward on its tokens, and the result is put back together (``cp.unshard``) and compared with the single-process
``mbs_attention`` on the whole sequence. Rank 0 prints the plan's summary and the errors; the exit status is 1
if an error exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import mmsparse  # before anything imports triton: without CUDA it turns on Triton's interpreter
from mmsparse.distributed import ContextParallel

TOPOLOGY = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]  # text, vision, audio: text sees all, the others themselves and text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N examples/context_parallel.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--causal", action="store_true", help="causal over the whole sequence")
    parser.add_argument("--seg-lens", default=None, help="text,vision,audio lengths (default: small on CPU)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    seg_lens = tuple(int(x) for x in args.seg_lens.split(",")) if args.seg_lens else (
        (2048, 12288, 4096) if cuda else (40, 100, 60))
    batch, heads, kv_heads, head_dim = (1, 16, 4, 128) if cuda else (1, 2, 1, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    seq = sum(seg_lens)

    gen = torch.Generator(device="cpu").manual_seed(0)  # the same full inputs on every rank
    q, do = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(device, dtype) for _ in "qo")
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=gen).to(device, dtype) for _ in "kv")

    cp = ContextParallel(TOPOLOGY, seg_lens, causal=args.causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    q_l, k_l, v_l = (cp.shard(t) for t in leaves)
    out_l = cp.attention(q_l, k_l, v_l)
    out_l.backward(cp.shard(do))
    out = cp.unshard(out_l.detach())
    grads = [t.grad for t in leaves]
    for g in grads:  # each token's gradient is on the rank that holds it
        dist.all_reduce(g)

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mmsparse.mbs_attention(*ref_leaves, TOPOLOGY, seg_lens, causal=args.causal)
    ref.backward(do)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    worst = 0.0
    if dist.get_rank() == 0:
        summary = cp.plan.summary(kv_bytes_per_token=2 * kv_heads * head_dim * q.element_size())
        print(f"{cp.world_size} ranks, chunks of {cp.plan.chunk} tokens; live pairs per rank {summary['live_pairs']} "
              f"(max/mean {summary['imbalance']:.3f}); K/V bytes received {summary['recv_bytes']} "
              f"(an all-gather: {summary['all_gather_bytes']})")
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *(t.grad for t in ref_leaves))):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
        worst = max(worst, err)
        if dist.get_rank() == 0:
            print(f"{name}: relative L2 error against one process {err:.2e}")
    ok = worst <= tol
    if dist.get_rank() == 0:
        print(f"{'ok' if ok else 'FAILED'}: tolerance {tol:.0e}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
