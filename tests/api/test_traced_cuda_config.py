"""A traced call reads the CUDA config as a constant, inside the autograd.Function, with no GPU needed to check it:
the lookup itself (which queries the device and finds Triton's Gluon with importlib) is refused by Dynamo there,
and a config object handed back as a traced constant cannot be read under torch 2.11 (it cannot guard on its
methods). A stand-in for the lookup does what Dynamo refuses, so that the test fails wherever the graph would
trace it."""

from __future__ import annotations

import importlib.util

import torch

from mmsparse.attention import config
from mmsparse.attention.plan import plan_call
from mmsparse.kernels.constants import MASK_BITS

CUDA = torch.device("cuda", 0)  # a device value only: nothing here touches a GPU


def _stand_in(head_dim_pad: int, dtype: torch.dtype, device_index: int) -> config.KernelConfig:
    importlib.util.find_spec("triton")  # as the real lookup's Gluon check does
    return config._INTERPRETER


class _Planned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seq: int) -> torch.Tensor:
        cfg = config.kernel_config(64, torch.bfloat16, CUDA)
        plan = plan_call(cfg, seq, seq, CUDA, None, False, False, MASK_BITS, False, None, 3)
        return x * plan.forward.block_m + cfg.one_pass(seq)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def test_the_cuda_config_is_a_traced_constant(monkeypatch):
    monkeypatch.setattr(config, "_cached_cuda_config", _stand_in)
    x = torch.randn(4, requires_grad=True)
    want = x * config._INTERPRETER.forward_tile(100, 100, None).block_m + config._INTERPRETER.one_pass(100)
    torch._dynamo.reset()
    got = torch.compile(lambda t: _Planned.apply(t, 100), fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
