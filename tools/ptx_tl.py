"""The tl attention kernels compiled for sm_90 on any machine, their PTX written to a folder (for tools/ptx_diff.py).

    TRITON_INTERPRET=0 PYTHONPATH=TREE python tools/ptx_tl.py OUT [SUBSTRING]

Each case runs mmsparse's own launchers (``attention.call.mbs_attn_fwd`` and ``mbs_attn_bwd``)
on CPU tensors with every kernel handle replaced: a tl kernel (forward, split combine, delta, dQ, dK/dV and its
one-pass variant) is compiled as its launch would compile it and written to ``OUT/<case>-<kernel>.ptx``; a Gluon
launch is skipped (tests/kernels/test_gluon_compiles.py compiles those). The tiles are the config tables' for an
H100/H200 (``config.cuda_kernel_config``), with the Gluon kernels where the table has them (the tl kernels then run
with dropout, or where a pass keeps its tl tile) or without them (other GPUs), so the kernels and constexprs are
those a GPU would launch. Only the launchers' long-standing entry points are used, so that one copy of this script
compiles the same cases from any tree (``PYTHONPATH``) and their PTX can be compared.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

TARGET = ("cuda", 90, 32)  # GPUTarget(backend, compute capability, warp size): an H100/H200


@dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    dtype: str  # "bfloat16", "float16", "float32"
    mask: str  # "bits", "codes", "dense"
    causal: bool = False
    window: bool = False
    group: int = 2  # query heads per KV head
    gluon: bool = True  # the table with the Gluon tiles (Hopper); False: another GPU's (no TMA before sm_90)
    use_tma: bool = True
    dropout: bool = False
    seq_q: int | None = None  # None: as many queries as keys
    deterministic: bool = True  # False: the one-pass backward (below one_pass_max_keys keys)


# Each case's tl kernels. On the Hopper table the tl forward, dQ and dK/dV run with dropout (at the Gluon tiles), the
# short-keys tiles without it; decoding splits the key list (the combine kernel); float32 and D=256 have no Gluon
# tile; the one pass runs the tl kernel with dropout and off Hopper.
CASES = [
    Case("bf16-D128-bits-causal-dropout", 128, "bfloat16", "bits", causal=True, dropout=True),
    Case("bf16-D64-codes-window-dropout", 64, "bfloat16", "codes", window=True, dropout=True, group=1),
    Case("bf16-D64-codes-causal-short", 64, "bfloat16", "codes", causal=True),
    Case("bf16-D64-bits-short", 64, "bfloat16", "bits"),  # the seed's: its tl dQ pass computes P as Gluon's dK/dV
    Case("bf16-D128-dense-decode", 128, "bfloat16", "dense", seq_q=8, group=4),
    Case("fp32-D128-bits", 128, "float32", "bits", group=1),
    Case("fp16-D96-codes-pointers", 96, "float16", "codes", causal=True, gluon=False, use_tma=False),
    Case("bf16-D256-bits-causal", 256, "bfloat16", "bits", causal=True),
    Case("bf16-D128-codes-one-pass-dropout", 128, "bfloat16", "codes", dropout=True, deterministic=False),
    Case("fp16-D64-bits-window-one-pass", 64, "float16", "bits", window=True, gluon=False, deterministic=False),
    Case("bf16-D64-dense-one-pass-pointers", 64, "bfloat16", "dense", causal=True, gluon=False, use_tma=False,
         deterministic=False, group=1),
]
SEQ = 384
KERNELS = ("fwd", "combine", "delta", "dq", "dkdv")  # the names' last part


def compile_ptx(name: str, out: Path, jit_fn, args: tuple, kwargs: dict) -> None:
    """What ``jit_fn[grid](*args, **kwargs)`` would compile, built for sm_90 instead of launched."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from mmsparse.runtime import launch

    kwargs = {**getattr(launch, "PINNED_OPTIONS", {}), **kwargs}  # as the tree's FastKernel launches it
    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
    print(name, "compiled", flush=True)


class _Compile:
    """Stands in for a ``FastKernel``: each launch (``kernel[grid](...)`` or ``bind``) compiles instead, once per
    name, if the name contains the wanted substring."""

    def __init__(self, launcher, kernel: str, out: Path, current: dict, only: str) -> None:
        self.fn, self.kernel, self.out, self.current, self.only = launcher.fn, kernel, out, current, only

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.bind(grid, args, kwargs)

    def bind(self, grid, args, kwargs, boxes=()):
        name = f"{self.current['case']}-{self.kernel}"
        if self.only in name and not (self.out / f"{name}.ptx").exists():
            compile_ptx(name, self.out, self.fn, args, kwargs)
        return None  # no relaunch: every launch comes back here


class _Skip:
    """Stands in for a Gluon kernel's ``FastKernel``: nothing is compiled or launched."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

    def bind(self, grid, args, kwargs, boxes=()):
        return None


def _mask(case: Case):
    import torch

    from mmsparse.mask.info import MaskInfo

    try:
        from mmsparse.mask.build import build_mask_info
    except ImportError:  # a tree from before the mask's builder had a module of its own
        from mmsparse.functional import build_mask_info

    window = 100 if case.window else None
    seq_q = case.seq_q or SEQ
    if case.mask == "dense":
        dense = torch.rand(1, seq_q, SEQ, generator=torch.Generator().manual_seed(0)) < 0.5
        return MaskInfo.from_dense(dense, case.causal, window)
    # pair type 2 (causal within a pair) makes the segment-code mask; a 0/1 topology the bit mask
    topology = [[2, 1, 0], [0, 2, 1], [1, 0, 2]] if case.mask == "codes" else [[1, 1, 0], [0, 1, 1], [1, 0, 1]]
    return build_mask_info(topology, [[150, 150, SEQ - 300]], seq_q, SEQ, case.causal, torch.device("cpu"),
                           window=window)


def _run(case: Case) -> None:
    """The case's forward and backward through mmsparse's launchers (every kernel handle replaced)."""
    from dataclasses import replace

    import torch

    from mmsparse.attention import config

    try:
        from mmsparse.attention.call import mbs_attn_bwd, mbs_attn_fwd
    except ImportError:  # a tree from before calls were planned once
        from mmsparse.attention.backward import mbs_attn_bwd
        from mmsparse.attention.forward import mbs_attn_fwd

    dtype = getattr(torch, case.dtype)
    cfg = replace(config.cuda_kernel_config(case.head_dim, dtype, gluon=case.gluon), use_tma=case.use_tma)
    info = _mask(case)
    gen = torch.Generator().manual_seed(1)
    seq_q, heads = case.seq_q or SEQ, 4
    q = torch.randn(1, heads, seq_q, case.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, heads // case.group, SEQ, case.head_dim, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    seed = torch.zeros(3, dtype=torch.int64) if case.dropout else None
    p = 0.1 if case.dropout else 0.0
    use_tuning = getattr(config, "use_tuning", None) or config.use_config  # a tree from before use_tuning
    with use_tuning(cfg):
        mbs_attn_fwd(q, k, v, info, 0.1, p, seed, cfg)
        lse = torch.zeros(1, heads, seq_q)
        mbs_attn_bwd(q.clone(), q, k, v, q.clone(), lse, info, 0.1, p, seed, deterministic=case.deterministic,
                     config=cfg)


def main(out: Path, only: str = "") -> None:
    from mmsparse.attention import backward, forward, gluon_launch
    from mmsparse.kernels.constants import DOT_NATIVE, DOT_TF32X3

    current: dict = {}
    out.mkdir(parents=True, exist_ok=True)
    forward._FWD = _Compile(forward._FWD, "fwd", out, current, only)
    forward._COMBINE = _Compile(forward._COMBINE, "combine", out, current, only)
    backward._DELTA = _Compile(backward._DELTA, "delta", out, current, only)
    backward._DQ = _Compile(backward._DQ, "dq", out, current, only)
    backward._DKDV = _Compile(backward._DKDV, "dkdv", out, current, only)
    gluon_launch._FWD = gluon_launch._DQ = gluon_launch._DKDV = _Skip()
    if hasattr(gluon_launch, "_DKDV_D256"):  # a tree with the D=256 dK/dV kernel
        gluon_launch._DKDV_D256 = _Skip()

    def gpu_dot_mode(q):  # the GPU's modes (the CPU upcasts bf16)
        return DOT_TF32X3 if q.dtype.itemsize == 4 else DOT_NATIVE

    forward.dot_mode = backward.dot_mode = gpu_dot_mode
    for case in CASES:
        if any(only in f"{case.name}-{kernel}" for kernel in KERNELS):
            current["case"] = case.name
            _run(case)


if __name__ == "__main__":
    sys.path.pop(0)  # this script's folder: mmsparse comes from PYTHONPATH (the tree being compiled)
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
