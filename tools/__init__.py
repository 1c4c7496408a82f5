"""Developer tools of mmsparse (tools/README.md): A/B timing against a git ref, Nsight Compute tables, tile sweeps,
and the context-parallel plan, model and per-rank timings. They use the benchmark's harness (``benchmarks``) and
write their records to ``benchmarks/results/<gpu>/``.

    python -m tools.ab --base REF        # this working tree against a git ref, interleaved, bit for bit
    python -m tools.profile_ncu          # Nsight Compute, per kernel, side by side
    python -m tools.tune_tiles           # tile sweeps of one pass
    python -m tools.ptx_diff diff A B    # the kernels' sm_90 PTX of two trees, compiled on a CPU (compile REF DIR)
    python -m tools.cp_plan              # the context-parallel plan's balance and volume
    python -m tools.cp_model             # the context-parallel strong-scaling model
    python -m tools.cp_local             # each context-parallel rank's local attention on one GPU

Importing the package imports nothing heavy: the A/B parent process never loads torch or mmsparse.
"""
