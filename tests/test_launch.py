"""The direct-launch key (mmsparse.ops.launch): what makes two launches share a compiled kernel. The launches
themselves need a GPU (tests/test_gpu.py); the key logic is plain Python and is checked here."""

from __future__ import annotations

import numpy as np
import torch

from mmsparse.ops import launch
from mmsparse.ops.backward import _delta_kernel


def test_tensor_key_follows_dtype_and_16_byte_alignment():
    buf = torch.zeros(64, dtype=torch.float32)
    aligned, misaligned, eight = buf[:16], buf[1:17], buf[2:18]  # byte offsets 0, 4, 8
    assert launch._arg_key(aligned) == launch._arg_key(buf[4:20])  # offset 16 bytes: still aligned
    assert launch._arg_key(aligned) != launch._arg_key(misaligned)
    assert launch._arg_key(aligned) != launch._arg_key(eight)
    assert launch._arg_key(aligned) != launch._arg_key(aligned.to(torch.float16))


def test_integer_key_separates_every_specialisation_triton_makes():
    keys = {v: launch._arg_key(v) for v in (1, 2, 3, 16, 32, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63)}
    assert keys[2] == keys[3]  # neither 1 nor a multiple of 16, both 32-bit
    assert keys[16] == keys[32]
    assert len({keys[1], keys[2], keys[16], keys[2**31], keys[2**63]}) == 5  # ==1, plain, %16, 64-bit, unsigned
    assert keys[2**31 - 1] != keys[2**31]  # the int32 boundary
    assert keys[-(2**31)] != keys[-(2**31) - 1]
    assert launch._arg_key(0.5) == launch._arg_key(3.0)  # floats are not specialised
    assert launch._arg_key(True) != launch._arg_key(False)


def test_unknown_argument_kinds_are_never_cached():
    assert launch._arg_key(np.int64(3)) is launch._MISS
    assert launch._arg_key("x") is launch._MISS


def test_constexpr_tail_is_in_parameter_order_whatever_the_keyword_order():
    kernel = launch.FastKernel(_delta_kernel)
    args = (torch.zeros(4), torch.zeros(4), torch.zeros(4), 4)
    tail = kernel._constexpr_tail(args, {"BR": 64, "HEAD_DIM_PAD": 32, "HEAD_DIM": 24, "num_warps": 4})
    assert tail == (24, 32, 64)  # HEAD_DIM, HEAD_DIM_PAD, BR; launch options are not parameters
