"""Import order on a machine without CUDA, each case in a fresh interpreter.

Triton fixes compiled or interpreted for each ``@triton.jit`` function when it is defined, its own library
functions (``tl.sum``, ``tl.cumsum``, ...) at ``import triton``. So mmsparse can turn the interpreter on only if
triton is not imported yet; otherwise ``import mmsparse`` must fail at once, with the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only switched on without CUDA")

# A small call checked against the float64 reference: proves the kernels really ran through the interpreter.
CHECK = """
import torch, mmsparse
q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float32) for _ in range(3))
topo, lens = [[1, 1], [0, 1]], (15, 25)
out = mmsparse.mbs_attention(q, k, v, topo, lens)
ref = mmsparse.reference_attention(q, k, v, mmsparse.reference_mask(topo, lens, 40))
assert (out.double() - ref).abs().max() < 1e-5
print("kernels ok")
"""


def run(code: str, interpret: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest set it for this process
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_mmsparse_first_turns_the_interpreter_on():
    proc = run("import mmsparse, triton\n" + CHECK)
    assert proc.returncode == 0 and "kernels ok" in proc.stdout, proc.stderr


def test_triton_first_fails_at_import_with_the_fix():
    proc = run("import triton\nimport mmsparse\n")
    assert proc.returncode != 0
    assert "ImportError: mmsparse: there is no CUDA device" in proc.stderr, proc.stderr
    assert "import mmsparse before transformers/triton" in proc.stderr
    assert "TRITON_INTERPRET=1 python your_script.py" in proc.stderr


def test_setting_the_variable_after_triton_is_too_late():
    proc = run("import os, triton\nos.environ['TRITON_INTERPRET'] = '1'\nimport mmsparse\n")
    assert proc.returncode != 0 and "setting the variable later is too late" in proc.stderr, proc.stderr


def test_variable_set_before_python_starts_works_in_any_order():
    proc = run("import triton\n" + CHECK, interpret="1")
    assert proc.returncode == 0 and "kernels ok" in proc.stdout, proc.stderr


def test_interpreter_turned_off_by_the_user_is_respected():
    code = """
    import triton, torch, mmsparse
    q = torch.randn(1, 1, 8, 16)
    try:
        mmsparse.mbs_attention(q, q, q, [[1]], (8,))
    except ValueError as e:
        assert "TRITON_INTERPRET" in str(e), e
        print("refused")
    """
    proc = run(code, interpret="0")
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr


def test_transformers_model_classes_then_mmsparse():
    """The Hugging Face path: importing a model class imports triton. mmsparse first works end to end; the other
    order works with the variable set before Python starts, and otherwise fails at import, not at the forward."""
    pytest.importorskip("transformers")
    model_first = """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mmsparse.integrations import hf
    hf.register()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="mmsparse")
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (1, 20))
    loss = model(ids, labels=ids, mm_topology=[[1, 1], [0, 1]], mm_seg_lens=(8, 12)).loss
    assert torch.isfinite(loss)
    print("forward ok")
    """
    mmsparse_first = "import mmsparse\n" + textwrap.dedent(model_first)
    proc = run(mmsparse_first)
    assert proc.returncode == 0 and "forward ok" in proc.stdout, proc.stderr
    proc = run(model_first, interpret="1")
    assert proc.returncode == 0 and "forward ok" in proc.stdout, proc.stderr
    proc = run(model_first)
    assert proc.returncode != 0 and "import mmsparse before transformers/triton" in proc.stderr, proc.stderr
