"""Benchmarks of mmsparse: shapes, baselines, timing harness, reports, and an A/B tool against a git ref.

    python -m benchmarks                      # mmsparse vs Flex / SDPA on every config (``benchmarks.run``)
    python -m benchmarks.ab --base REF        # the working tree against a git ref, interleaved, bit for bit
    python -m benchmarks.bench_build          # the block-metadata build for new lengths
    python -m benchmarks.tune_tiles           # tile sweeps of one pass
    python -m benchmarks.cp_local             # each context-parallel rank's local attention on one GPU
    torchrun --nproc-per-node N -m benchmarks.cp_nccl   # context parallelism over NCCL against one GPU
    torchrun --nproc-per-node 4 -m benchmarks.cp_fsdp   # context parallel x FSDP2 training against one GPU
    python -m benchmarks.profile_ncu          # Nsight Compute, per kernel, side by side

Importing the package imports nothing heavy: the A/B parent process never loads torch or mmsparse.
"""
