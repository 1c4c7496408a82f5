"""The tl one-pass dK/dV kernel (``ONE_PASS``) compiles for sm_90 on any machine, with its dQ adds as relaxed vector
atomics and its matmuls on wgmma (the Gluon one-pass kernel: tests/kernels/test_gluon_compiles.py).

The interpreter runs the kernel's Python, not Triton's compiler: a construct the compiler rejects (a layout it
cannot convert, an atomic it cannot lower) would first show on a GPU. The variants compile in one child process
without TRITON_INTERPRET, at the CUDA tiles of the one-pass backward, over the three mask modes, TMA and pointer
loads, a padded head dim, a window and dropout. Run as a script,
``python tests/kernels/test_one_pass_compiles.py DIR`` writes each variant's PTX there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# name: (head_dim, mask, causal, use_tma, window, dropout)
VARIANTS = {
    "D128-bits-causal-tma": (128, "bits", True, True, False, False),
    "D64-codes-pointers": (64, "codes", False, False, False, False),
    "D128-dense-window-tma": (128, "dense", False, True, True, False),
    "D96-codes-dropout-tma": (96, "codes", True, True, False, True),
}
COMPILE_TIMEOUT_S = 900
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("one-pass-ptx")
    # this checkout's mmsparse in the child too, not an installed one
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # a cache of its own: a warm user cache would hand back PTX compiled earlier instead of compiling it here
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path, TRITON_CACHE_DIR=str(out / "cache"))
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=COMPILE_TIMEOUT_S)
    return out, proc


def test_one_pass_kernel_compiles_for_sm90(ptx_dir):
    _, proc = ptx_dir
    assert proc.returncode == 0, proc.stderr[-6000:]
    compiled = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith(" compiled")]
    assert compiled == list(VARIANTS), proc.stdout


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_pass_adds_dq_with_relaxed_float_atomics(ptx_dir, name):
    out, proc = ptx_dir
    path = out / f"{name}.ptx"
    assert path.exists(), f"{name} did not compile:\n{proc.stderr[-3000:]}"
    ptx = path.read_text()
    # red (3.9) or atom (3.6) with the returned value unused; relaxed: no fences around each add
    adds = re.findall(r"\b(?:red|atom)\.global\.gpu\.relaxed\.add(?:\.v\d)?\.f32\b", ptx)
    assert adds, f"{name}: no relaxed float32 atomic add in the PTX"
    ordering = re.findall(r"\b(?:red|atom)\.global\.[a-z.]*(?:acq_rel|release|acquire)[a-z0-9.]*", ptx)
    assert not ordering, f"{name}: {ordering}"
    assert "wgmma" in ptx, name  # the Hopper matmuls, not a fallback


# ---------------------------------------------------------------------------------------------------------------
# The child: compile, don't launch


def _compile(name: str, out: Path, kernel, args, kwargs) -> None:
    """What ``kernel[grid](*args, **kwargs)`` would compile, built for sm_90 instead of launched."""
    from tools.ptx_tl import compile_ptx  # this checkout's tools: the child runs with the repository on its path

    compile_ptx(name, out, kernel, args, kwargs)


def _main(out: Path) -> None:
    from dataclasses import replace

    import torch

    from mmsparse.attention import call, config
    from mmsparse.kernels.constants import DOT_NATIVE
    from mmsparse.mask.build import build_mask_info
    from mmsparse.mask.info import MaskInfo

    current = {}

    class Compile:
        def __init__(self, launcher) -> None:
            self.kernel = launcher.fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                assert kwargs["ONE_PASS"], current
                _compile(current["name"], out, self.kernel, args, kwargs)

            return launch

        def bind(self, grid, args, kwargs, boxes=()):  # as FastKernel.bind where launches go through Triton
            self[grid](*args, **kwargs)

    class Skip:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

        def bind(self, grid, args, kwargs, boxes=()):
            return None

    from mmsparse.attention import backward

    backward._DKDV, backward._DELTA = Compile(backward._DKDV), Skip()
    backward.dot_mode = lambda q: DOT_NATIVE  # the GPU's mode for bf16 (the CPU upcasts)
    seq = 384
    for name, (head_dim, mask, causal, use_tma, window, dropout) in VARIANTS.items():
        current["name"] = name
        w = 100 if window else None
        if mask == "dense":
            info = MaskInfo.from_dense(torch.rand(1, seq, seq) < 0.5, causal, w)
        else:
            topology = [[2, 1, 0], [0, 2, 1], [1, 0, 2]] if mask == "codes" else [[1, 1, 0], [0, 1, 1], [1, 0, 1]]
            info = build_mask_info(topology, [[150, 150, seq - 300]], seq, seq, causal, torch.device("cpu"),
                                   window=w)
        q = torch.randn(1, 4, seq, head_dim, dtype=torch.bfloat16)
        k = torch.randn(1, 2, seq, head_dim, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lse = torch.zeros(1, 4, seq)
        # the tl kernel's tile (on Hopper the one-pass runs it with dropout; the Gluon one is compiled in
        # test_gluon_compiles.py)
        cfg = replace(config.cuda_kernel_config(head_dim, torch.bfloat16, gluon=False), use_tma=use_tma)
        seed = torch.zeros(3, dtype=torch.int64) if dropout else None
        with config.use_tuning(cfg):
            call.mbs_attn_bwd(q.clone(), q, k, v, q.clone(), lse, info, 0.1, 0.1 if dropout else 0.0, seed,
                                  deterministic=False)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd() / "one-pass-ptx"
    target.mkdir(parents=True, exist_ok=True)
    _main(target)
