"""Host TMA descriptors encoded once per value (mmsparse.runtime.tma_args), against the installed Triton's own launcher
wrapper: Triton's ``CudaLauncher.__call__`` and ``wrap_handle_tensordesc`` run as they are, around a C launcher and a
driver encode function that only record what they are given. No GPU needed."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import triton

from mmsparse.runtime import tma_args
from mmsparse.runtime.tma_args import DescriptorLaunch

nvidia_driver = pytest.importorskip("triton.backends.nvidia.driver")

SIGNATURE = {"X": "*fp32", "QD": "tensordesc<bf16[1, 1, 64, 64]>", "n": "i32",
             "OD": "tensordesc<fp32[1, 64, 32]>", "scale": "fp32", "BM": "constexpr"}
METAS = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 1, 64, 64], fp4_padded=False),
         dict(swizzle=2, elem_size=4, elem_type=7, block_size=[1, 64, 32], fp4_padded=False)]


class _Encoder:
    """The driver's utilities, recording each encode: a map is the tuple of what it was made from."""

    def __init__(self) -> None:
        self.calls = 0

    def _fill(self, *values):
        self.calls += 1
        return ("map", *[tuple(v) if isinstance(v, (list, tuple, torch.Size)) else v for v in values])

    fill_tma_descriptor = fill_tma_descriptor_tiled = _fill


class _Driver:
    def __init__(self) -> None:
        self.utils = _Encoder()


class _Metadata:
    tensordesc_meta = METAS


class _Source:
    signature = SIGNATURE


class _Compiled:
    """What DescriptorLaunch reads of a CompiledKernel, with the installed Triton's launcher object."""

    def __init__(self, recorded: list) -> None:
        def c_launch(*args):  # Triton's C launcher: record its arguments, sequences as lists
            recorded.append([list(a) if isinstance(a, (list, tuple)) else a for a in args])

        run = object.__new__(nvidia_driver.CudaLauncher)  # its __call__ as Triton has it, no C module built
        run.launch = nvidia_driver.wrap_handle_tensordesc(c_launch, SIGNATURE, METAS)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl, run.gsan_enabled = 1, False, False, False
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.arg_annotations, run.kernel_signature = "annotations", "kernel signature"
        self.run, self.src, self.metadata = run, _Source(), _Metadata()
        self.function, self.packed_metadata = 1234, ("packed",)


@pytest.fixture
def encoder(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)  # put back after the test, whatever it was
    return driver.utils


def _descriptors(q: torch.Tensor, o: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor  # the fields the launcher reads are the same

    qd = object.__new__(TensorDescriptor)
    qd.base, qd.shape, qd.strides, qd.block_shape, qd.padding = q, q.shape, q.stride(), [1, 1, 64, 64], "zero"
    od = object.__new__(TensorDescriptor)
    od.base, od.shape, od.strides, od.block_shape, od.padding = o, (6, 100, 32), o.stride()[1:], [1, 64, 32], "zero"
    return qd, od


def _args(q: torch.Tensor, o: torch.Tensor, x: torch.Tensor) -> tuple:
    qd, od = _descriptors(q, o)
    return (x, qd, 77, od, 0.5)


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, q, o): a plain pointer argument, and the tensors of the two descriptor positions."""
    return torch.randn(4), torch.randn(2, 3, 100, 64).to(torch.bfloat16), torch.randn(2, 3, 100, 32)


def _tritons_launch(recorded: list, q: torch.Tensor, o: torch.Tensor, x: torch.Tensor) -> None:
    """A launch through Triton's own wrapper, its C launcher's arguments recorded."""
    _Compiled(recorded).run(2, 6, 1, 99, 1234, ("packed",), None, None, None, *_args(q, o, x), 64)


def test_the_launcher_gets_what_tritons_wrapper_would_give_it(encoder):
    """Every launcher argument, the encoded maps among them, equals what Triton's own wrapper passes."""
    x, q, o = _tensors()
    tritons, ours = [], []
    _tritons_launch(tritons, q, o, x)
    compiled = _Compiled(ours)
    launch = DescriptorLaunch.of(compiled)
    assert launch is not None
    launch(compiled, (2, 6, 1), 99, _args(q, o, x), (64,))
    assert ours == tritons
    flat = str(ours)
    assert str(q.data_ptr()) in flat and str(o.data_ptr()) in flat  # the maps hold the live bases


def test_equal_descriptors_are_encoded_once_and_new_values_again(encoder):
    x, q, o = _tensors()
    recorded = []
    compiled = _Compiled(recorded)
    launch = DescriptorLaunch.of(compiled)
    before = tma_args.encodings
    for _ in range(3):
        launch(compiled, (2, 6, 1), 99, _args(q, o, x), (64,))
    assert encoder.calls == 2 and tma_args.encodings - before == 2
    assert recorded[0] == recorded[1] == recorded[2]
    q2 = q.clone()  # another base address: its own map
    launch(compiled, (2, 6, 1), 99, _args(q2, o, x), (64,))
    assert encoder.calls == 3
    assert recorded[3] != recorded[0]
    strided = torch.randn(2, 100, 3, 64).to(torch.bfloat16).transpose(1, 2)  # same shape, other strides
    launch(compiled, (2, 6, 1), 99, _args(strided, o, x), (64,))
    assert encoder.calls == 4
    tritons = []
    for q_now in (q2, strided):
        _tritons_launch(tritons, q_now, o, x)
    assert recorded[3:] == tritons


def test_a_full_position_starts_again(encoder, monkeypatch):
    monkeypatch.setattr(tma_args, "MAX_ENCODED_PER_ARGUMENT", 2)
    x, o = torch.randn(4), torch.randn(2, 3, 100, 32)
    qs = [torch.randn(2, 3, 100, 64).to(torch.bfloat16) for _ in range(3)]
    compiled = _Compiled([])
    launch = DescriptorLaunch.of(compiled)
    for q in qs:
        launch(compiled, (2, 6, 1), 99, _args(q, o, x), (64,))
    assert [len(cache) for cache in launch._encoded] == [1, 1]  # the third q found the position full and cleared it


def test_kernels_it_does_not_know_keep_tritons_path():
    compiled = _Compiled([])
    compiled.run.launch = lambda *args: None  # no wrapper: a kernel without descriptors
    assert DescriptorLaunch.of(compiled) is None
    compiled = _Compiled([])
    compiled.metadata = type("M", (), {"tensordesc_meta": None})()  # descriptors the kernel decomposes itself
    assert DescriptorLaunch.of(compiled) is None
    compiled = _Compiled([])
    compiled.metadata = type("M", (), {"tensordesc_meta": [dict(METAS[0], is_im2col=True), METAS[1]]})()
    assert DescriptorLaunch.of(compiled) is None


class _TestBox(NamedTuple):
    """A box as the launchers pass them (``runtime.tma_args.Box``): q's as it is stored, o's seen as [B * H, S, D]."""

    of: str

    def describe(self, t: torch.Tensor):
        return _descriptors(t, t)[0 if self.of == "q" else 1]


BOXES = ((1, _TestBox("q")), (3, _TestBox("o")))


def test_tensors_with_boxes_launch_as_their_descriptors_do(encoder):
    """Tensors at the descriptor positions with their boxes: the launcher gets what Triton's wrapper gives it for
    the descriptors, each value is encoded once, and a new address, shape or strides is encoded again."""
    x, q, o = _tensors()
    tritons, ours = [], []
    _tritons_launch(tritons, q, o, x)
    compiled = _Compiled(ours)
    launch = DescriptorLaunch.of(compiled)
    before = encoder.calls
    for _ in range(3):
        launch(compiled, (2, 6, 1), 99, (x, q, 77, o, 0.5), (64,), BOXES)
    assert ours == tritons * 3 and encoder.calls - before == 2
    strided = torch.randn(2, 100, 3, 64).to(torch.bfloat16).transpose(1, 2)  # same shape, other strides
    for q_now in (q.clone(), strided):
        _tritons_launch(tritons, q_now, o, x)
        before = encoder.calls
        launch(compiled, (2, 6, 1), 99, (x, q_now, 77, o, 0.5), (64,), BOXES)
        assert encoder.calls - before == 1  # q's map only
    assert ours[3:] == tritons[1:]


def test_boxes_at_other_positions_than_the_kernels_descriptors_are_refused(encoder):
    x, q, o = _tensors()
    compiled = _Compiled([])
    launch = DescriptorLaunch.of(compiled)
    for boxes in (BOXES[:1], ((0, BOXES[0][1]), BOXES[1]), (*BOXES, (4, BOXES[1][1]))):
        with pytest.raises(ValueError, match=r"descriptors at \[1, 3\]"):
            launch(compiled, (2, 6, 1), 99, (x, q, 77, o, 0.5), (64,), boxes)
