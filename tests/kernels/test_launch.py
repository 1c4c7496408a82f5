"""The direct-launch key (mmsparse.runtime.launch): what makes two launches share a compiled kernel. The launches
themselves need a GPU (tests/kernels/test_gpu.py); the key logic is plain Python and is checked here."""

from __future__ import annotations

import numpy as np
import torch

from mmsparse.kernels.tl.backward import attention_delta_tl
from mmsparse.runtime import launch


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
    kernel = launch.FastKernel(attention_delta_tl)
    args = (torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), 4, 0, 12, 3, 0, 12, 3)
    tail = kernel._constexpr_tail(args, {"BR": 64, "HEAD_DIM_PAD": 32, "HEAD_DIM": 24, "NUM_HEADS": 1,
                                         "num_warps": 4})
    assert tail == (1, 24, 32, 64, False)  # NUM_HEADS, HEAD_DIM, HEAD_DIM_PAD, BR, ZERO_DQ (its default); no options


def _descriptor_variants():
    """Host-side TMA descriptors that differ in one thing each: the tensor (address, shape, strides), dtype, box."""
    from mmsparse.attention.host_tma import box_descriptor

    bf16 = torch.empty(2, 3, 100, 64, dtype=torch.bfloat16)
    return {
        "base": box_descriptor(bf16, 64, 64),
        "other tensor and shape": box_descriptor(torch.empty(1, 5, 37, 64, dtype=torch.bfloat16), 64, 64),
        "transposed storage": box_descriptor(torch.empty(2, 100, 3, 64, dtype=torch.bfloat16).transpose(1, 2), 64, 64),
        "fp16": box_descriptor(bf16.to(torch.float16), 64, 64),
        "rows": box_descriptor(bf16, 128, 64),
        "head dim 40 in the same box": box_descriptor(torch.empty(2, 3, 100, 40, dtype=torch.bfloat16), 64, 64),
        "width": box_descriptor(bf16, 64, 128),
    }


def test_descriptor_key_separates_exactly_what_triton_specialises():
    """Two launches share a compiled kernel when their descriptors' keys are equal: that must hold exactly when
    Triton's own specialisation of them is equal (dtype, box, layout; not the tensor's address, sizes or strides)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    descs = _descriptor_variants()
    keys = {name: launch._arg_key(d) for name, d in descs.items()}
    specs = {name: native_specialize_impl(BaseBackend, d, False, True, True)[0] for name, d in descs.items()}
    assert launch._MISS not in keys.values()
    for a in descs:
        for b in descs:
            assert (keys[a] == keys[b]) == (specs[a] == specs[b]), (a, b)
    same = ("base", "other tensor and shape", "transposed storage", "head dim 40 in the same box")
    assert len({keys[n] for n in same}) == 1
    assert len({keys[n] for n in ("base", "fp16", "rows", "width")}) == 4


def test_the_launch_device_comes_from_a_tensor_or_a_descriptor_base():
    """FastKernel launches on the device of its first argument, a tensor or a descriptor (its base tensor)."""
    desc = _descriptor_variants()["base"]
    assert launch._launch_device(desc) == launch._launch_device(desc.base) == -1  # CPU: -1, never a CUDA index
    if torch.cuda.is_available():
        on_gpu = torch.empty(4, device="cuda")
        assert launch._launch_device(on_gpu) == on_gpu.device.index


def test_every_launch_asks_for_fp_fusion(monkeypatch):
    """FP fusion is asked for at every launch (Triton 3.10 turns its default off; 3.9 warns), on a cache miss and
    when the interpreter runs the kernel alike, unless a launch asks otherwise."""
    kernel = launch.FastKernel(attention_delta_tl)
    seen: list[dict] = []
    monkeypatch.setattr(kernel.fn, "run", lambda *args, **kwargs: seen.append(kwargs))
    first = torch.zeros(8, device="cuda" if torch.cuda.is_available() else "cpu")
    kernel[(1,)](first, 2, NUM_HEADS=1)
    kernel[(1,)](first, 2, NUM_HEADS=1, enable_fp_fusion=False)
    assert [kw.get("enable_fp_fusion") for kw in seen] == [True, False]
