"""The stress tools: mmsparse under the conditions users run it, beyond the unit tests (README.md here).

    python -m tests.stress.fuzz --warmup --minutes 10 --seed 1   # random cases against the float32 reference
    python -m tests.stress.cold_runs --runs 200 --parallel 4     # fresh processes, the mask built inside the call
    python -m tests.stress.shared_gpu --procs 6 --seconds 60     # several processes on one GPU: failures, stalls
    python -m tests.stress.sanitize --tool all                   # compute-sanitizer over every kernel group
    python -m tests.stress.soak --steps 2000                     # memory, caches, compiled variants over training

Their records go to ``benchmarks/results/<gpu>/`` beside every other record. Their CPU smoke tests (the
``test_*.py`` here) carry the ``stress`` marker: ``pytest -m stress``.
"""
