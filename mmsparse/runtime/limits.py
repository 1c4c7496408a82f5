"""The largest problems the kernels take, and the check that turns a larger one into a clear error.

Every offset that can pass 2^31 is 64-bit (a 64-bit base per program, 32-bit offsets inside a tile), so tensor
sizes are bounded by memory alone. What stays bounded:
- batch * query heads: the launch grid puts it on CUDA's second grid axis, which holds at most 65,535 programs;
- sequence positions: token positions, q_start and block indices are int32.
"""

from __future__ import annotations

MAX_BATCH_HEADS = 65_535  # CUDA's limit on gridDim.y
MAX_SEQ_LEN = 2**31 - 1 - 256  # int32 positions, with room for one tile past the end


def check_problem_size(batch: int, num_heads: int, seq_q: int, seq_k: int) -> None:
    """Raise a ValueError when a call is past what the kernels can launch (see the module's docstring)."""
    if batch * num_heads > MAX_BATCH_HEADS:
        per_call = MAX_BATCH_HEADS // max(num_heads, 1)
        fix = (f"split the batch into calls of at most {per_call} sample{'' if per_call == 1 else 's'}" if per_call
               else f"use at most {MAX_BATCH_HEADS} query heads")
        raise ValueError(
            f"batch x query heads = {batch} x {num_heads} = {batch * num_heads} is more than the {MAX_BATCH_HEADS} "
            f"that one launch can take (CUDA's second grid axis): {fix}"
        )
    if max(seq_q, seq_k) > MAX_SEQ_LEN:
        raise ValueError(f"sequence length {max(seq_q, seq_k)} is more than the {MAX_SEQ_LEN} positions that int32 "
                         "token positions can address")
