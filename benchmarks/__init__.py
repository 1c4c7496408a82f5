"""The performance benchmark of mmsparse: shapes, baselines, timing harness, reports (benchmarks/README.md).

    python -m benchmarks                      # mmsparse vs Flex / SDPA on every config (``benchmarks.run``)
    python -m benchmarks.bench_build          # the block-metadata build for new lengths
    torchrun --nproc-per-node N -m benchmarks.cp_nccl   # context parallelism over NCCL against one GPU
    torchrun --nproc-per-node 4 -m benchmarks.cp_fsdp   # context parallel x FSDP2 training against one GPU
    python -m benchmarks.cp_record RUN_A/cp_nccl.json RUN_B/cp_nccl.json --out DIR   # cp_nccl records merged

The developer tools (A/B, ncu, tile sweeps, the context-parallel model) are in ``tools/``, the stress tools in
``tests/stress/``; all of them write their records to ``benchmarks/results/<gpu>/``. Importing the package
imports nothing heavy: the A/B parent process never loads torch or mmsparse.
"""
