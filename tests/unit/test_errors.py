"""Bad input gets a ValueError/TypeError that names the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import CYCLIC

from mmsparse import Topology, TritonMBSAttnKernel, generate_interlaced_mask, mbs_attention


def qkv(device, b=1, hq=2, hk=2, sq=20, sk=20, d=16, dtype=torch.float32):
    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    return rnd(b, hq, sq, d), rnd(b, hk, sk, d), rnd(b, hk, sk, d)


@pytest.mark.parametrize(
    "topology, match",
    [
        ([[1, 0], [1]], "square|matrix"),
        ([[1, 0, 1], [0, 1, 1]], "square"),
        ([[3, 0], [0, 1]], "0 \\(none\\), 1 \\(full\\) or 2 \\(causal\\)"),
        ([[0.5]], "0 \\(none\\), 1 \\(full\\) or 2 \\(causal\\)"),
        ([], "square"),
        (np.ones((4096, 4096)), "at most 4095"),
        ("abc", "matrix"),
    ],
    ids=["ragged", "not-square", "entry-3", "entry-half", "empty", "too-many-segments", "string"],
)
def test_bad_topology(topology, match):
    with pytest.raises(ValueError, match=match):
        Topology(topology)


def test_topology_accepts_all_containers():
    ref = Topology(CYCLIC)
    for form in (tuple(map(tuple, CYCLIC)), np.array(CYCLIC), torch.tensor(CYCLIC), torch.tensor(CYCLIC).bool()):
        assert Topology(form) == ref
    with pytest.raises(ValueError, match="names"):
        Topology(CYCLIC, names=("text", "vision"))


@pytest.mark.parametrize(
    "seg_lens, exc, match",
    [
        ((5, 5), ValueError, "3 segments"),
        ((5, -1, 16), ValueError, "negative"),
        ((5, 5, 5), ValueError, "sum"),
        ((5.0, 5, 10), TypeError, "int"),
        ([(5, 5, 10), (5, 5)], ValueError, "3 segments"),
        ([(5, 5, 10), (5, 5, 11)], ValueError, "more than"),
        (torch.tensor([[5, 5, 10], [1, 1, 1]]), ValueError, "rows"),
        (torch.tensor([[5, -1, 16]]), ValueError, r"seg_lens\[0\].*negative"),
        (torch.tensor([[5, 5, 11]]), ValueError, "more than"),
        (None, ValueError, "required"),
        ([], ValueError, "3 segments"),
    ],
    ids=["count", "negative", "sum", "float", "ragged-per-sample", "per-sample-too-long", "batch-mismatch",
         "tensor-negative", "tensor-too-long", "none", "empty"],
)
def test_bad_seg_lens(seg_lens, exc, match, device):
    q, k, v = qkv(device)
    with pytest.raises(exc, match=match):
        mbs_attention(q, k, v, CYCLIC, seg_lens)


def test_bad_tensors(device):
    q, k, v = qkv(device)
    with pytest.raises(ValueError, match="4-D"):
        mbs_attention(q[0], k, v, CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match="share one dtype"):
        mbs_attention(q.half(), k, v, CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match="dtype"):
        mbs_attention(q.double(), k.double(), v.double(), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        mbs_attention(*qkv(device, hq=3, hk=2), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="head dim"):
        mbs_attention(*qkv(device, d=12), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="head dim"):
        mbs_attention(*qkv(device, d=264), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="same shape"):
        mbs_attention(q, k, v[:, :, :10], CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="last q_len"):
        mbs_attention(*qkv(device, sq=30), CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="batch"):
        mbs_attention(q, *qkv(device, b=2)[1:], CYCLIC, (5, 5, 10))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mbs_attention(q.tolist(), k, v, CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="dropout_p"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10), dropout_p=1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10), softmax_scale=-1.0)


def test_bad_attn_mask(device):
    q, k, v = qkv(device)
    with pytest.raises(TypeError, match="bool"):
        mbs_attention(q, k, v, None, None, attn_mask=torch.ones(20, 20, device=device))
    with pytest.raises(ValueError, match="shape"):
        mbs_attention(q, k, v, None, None, attn_mask=torch.ones(19, 20, dtype=torch.bool, device=device))


def test_mixed_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device next to the CPU")
    q, k, v = qkv(torch.device("cpu"))
    with pytest.raises(ValueError, match="one device"):
        mbs_attention(q.cuda(), k, v, CYCLIC, (5, 5, 10))


def test_cpu_tensors_without_interpreter(monkeypatch):
    import mmsparse.functional as F

    # The interpreter is fixed when triton is imported (on for the session): faking it off is the only way here.
    monkeypatch.setattr(F, "interpreter_active", lambda: False)
    q, k, v = qkv(torch.device("cpu"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        mbs_attention(q, k, v, CYCLIC, (5, 5, 10))


def test_module_checks(device):
    with pytest.raises(ValueError, match="dropout"):
        TritonMBSAttnKernel(CYCLIC, (5, 5, 10), dropout=1.5)
    attn = TritonMBSAttnKernel(CYCLIC, (5, 5, 10))
    with pytest.raises(ValueError, match="sum to 20"):
        attn(*qkv(device, sq=21, sk=21))
    assert "seg_lens=(5, 5, 10)" in repr(attn)


def test_interlaced_mask_matches_segment_loop():
    """generate_interlaced_mask against a direct loop over the topology's blocks."""
    topo, lens = [[1, 0, 1], [0, 0, 1], [1, 1, 0]], (3, 0, 5)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    starts = [0, 3, 3]
    for r in range(3):
        for c in range(3):
            if topo[r][c]:
                expected[starts[r]:starts[r] + lens[r], starts[c]:starts[c] + lens[c]] = True
    assert torch.equal(generate_interlaced_mask(topo, lens), expected)
