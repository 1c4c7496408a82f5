"""GPU runs at production tiles and large shapes (skipped without CUDA)."""

from __future__ import annotations

import threading

import pytest
import torch

from mmsparse import mbs_attention
from mmsparse.attention import backward
from mmsparse.attention.config import SHORT_KEYS, kernel_config
from mmsparse.attention.plan import plan_attention
from mmsparse.kernels.tl.backward import attention_delta_tl, attention_dkdv_tl, attention_dq_tl
from mmsparse.kernels.tl.bit_lists import block_lists_kernel, block_summary_kernel
from mmsparse.kernels.tl.forward import attention_combine_tl, attention_fwd_tl
from mmsparse.kernels.tl.token_bits import token_bits_kernel
from mmsparse.runtime.launch import compiled_variants
from tests.helpers import CYCLIC, FOUR, HUB, check_against_reference, make_qkv

pytestmark = pytest.mark.gpu


LARGE = [
    # (topology, seg_lens, causal, heads, kv_heads, seq_q or None, head_dim, dtype)
    (CYCLIC, (1024, 8192, 6784), False, 1, 1, None, 128, torch.bfloat16),
    (HUB, (1024, 8192, 6784), True, 2, 1, None, 64, torch.bfloat16),
    (HUB, (777, 5000, 2501), False, 4, 2, None, 96, torch.float16),
    (CYCLIC, (300, 4000, 3001), True, 2, 2, 129, 128, torch.bfloat16),
    (FOUR, (999, 1, 2000, 3100), False, 2, 1, None, 40, torch.float16),
    (HUB, (513, 2049, 1031), True, 2, 2, None, 256, torch.bfloat16),
    (HUB, (513, 2049, 1031), False, 2, 2, None, 80, torch.float32),
]


def _id(case) -> str:
    topo, lens, causal, h, hk, sq, d, dtype = case
    return f"k{len(topo)}-S{sum(lens)}-Sq{sq or sum(lens)}-H{h}x{hk}-D{d}-{str(dtype)[6:]}{'-causal' if causal else ''}"


@pytest.mark.parametrize("case", LARGE, ids=_id)
def test_large_against_float64(case):
    topo, lens, causal, heads, kv_heads, seq_q, head_dim, dtype = case
    seq_k = sum(lens)
    q, k, v = make_qkv(1, heads, kv_heads, seq_q or seq_k, seq_k, head_dim, dtype, torch.device("cuda"))
    check_against_reference(q, k, v, topo, lens, causal=causal)


def test_new_lengths_do_not_recompile():
    """After a warm-up of each forward variant, new sequence and segment lengths reuse the compiled kernels, the
    metadata builders' included."""
    dev = torch.device("cuda")

    def step(lens):
        s = sum(lens)
        q, k, v = make_qkv(2, 4, 2, s, s, 64, torch.bfloat16, dev)
        mbs_attention(q, k, v, CYCLIC, lens, causal=True).sum().backward()

    # Warm-up of the forward's variants: long query tiles writing the output (a grid that fills the GPU) or
    # fp32 partials (a small grid splits its key lists), and the short-query (decode) tile with the GQA group
    # packed into it, in the power-of-two row buckets these lengths reach (2 x 9 -> 32 rows, 2 x 4 -> 16).
    # On Hopper, 2048 keys and more take the Gluon tile: the Gluon forward, or the tl one splitting a small grid.
    step((640, 4096, 2048))
    step((300, 1000, 800))
    step((100, 1000, 500))
    step((2, 3, 4))
    step((1, 2, 1))
    kernels = [attention_fwd_tl, attention_combine_tl, attention_dkdv_tl, attention_dq_tl, token_bits_kernel,
               block_summary_kernel, block_lists_kernel]
    cfg = kernel_config(64, torch.bfloat16, dev)
    if cfg.fwd.gluon:  # the Hopper forward runs the first length
        from mmsparse.kernels.gluon.forward import attention_fwd_gluon

        kernels.append(attention_fwd_gluon)
    if cfg.bwd_dkdv.gluon:
        from mmsparse.kernels.gluon.dkdv import attention_dkdv_gluon

        kernels.append(attention_dkdv_gluon)
    if cfg.bwd_dq.gluon:
        from mmsparse.kernels.gluon.dq import attention_dq_gluon

        kernels.append(attention_dq_gluon)
    before = [compiled_variants(kern) for kern in kernels]
    for lens in [(33, 2017, 1001), (1, 1, 1), (640, 4096, 2048), (0, 777, 5)]:
        step(lens)
    after = [compiled_variants(kern) for kern in kernels]
    assert after == before, f"compiled variants grew from {before} to {after}"


@pytest.mark.parametrize("q_len", [1, 16])
def test_decode_over_a_long_cache_against_float64(q_len):
    """Few queries over an 8k cache: short query tiles with the key lists split over programs and merged."""
    from mmsparse.attention.config import kernel_config
    from mmsparse.attention.plan import num_splits

    lens = (6000, 1680, 512)  # vision, audio, text (the queries are the last text tokens)
    topo = [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    q, k, v = make_qkv(2, 8, 2, q_len, sum(lens), 128, torch.bfloat16, torch.device("cuda"))
    tile = kernel_config(128, q.dtype, q.device).forward_tile(q_len, sum(lens))
    assert num_splits(2 * 8, -(-sum(lens) // tile.block_n), q.device) > 1
    check_against_reference(q, k, v, topo, lens, causal=True)


def test_fast_launch_keys_on_alignment():
    """The direct launch (mmsparse.runtime.launch) must pick the kernel Triton would: a 16-byte aligned pointer and a
    misaligned one are different specialisations (vector loads), so they must not share a cache entry."""
    from mmsparse.runtime import launch

    delta_launch = launch.FastKernel(attention_delta_tl)  # a fresh cache, independent of the other tests
    rows, d = 100, 16
    dev = torch.device("cuda")
    o_buf, do_buf = torch.randn(rows * d + 4, device=dev), torch.randn(rows * d + 4, device=dev)
    variants = compiled_variants(attention_delta_tl)
    fast = []
    for offset in (0, 0, 1, 1, 0):  # float32: an offset of 1 moves the pointer off 16-byte alignment
        o, do = o_buf[offset : offset + rows * d], do_buf[offset : offset + rows * d]
        delta = torch.full((rows,), float("nan"), device=dev)
        before = launch.fast_launches
        delta_launch[(2, 1)](o, do, delta, delta, rows, 0, 0, d // 8, 0, 0, d // 8, NUM_HEADS=1, HEAD_DIM=d,
                             HEAD_DIM_PAD=d, BR=64)  # one (batch, head) of 100 rows; strides in 8s
        fast.append(launch.fast_launches - before)
        torch.testing.assert_close(delta, (o.view(rows, d).double() * do.view(rows, d).double()).sum(1).float())
    assert fast == [0, 1, 0, 1, 1]
    assert compiled_variants(attention_delta_tl) - variants <= 2  # at most the aligned and the misaligned kernel


def test_backward_on_a_user_stream_is_ordered_and_bit_equal(monkeypatch):
    """The dQ pass runs on a side stream; work the caller queues on its own stream right after the backward must
    see the finished gradients, equal bit for bit to a backward on one stream."""
    dev = torch.device("cuda")
    lens = (300, 2000, 1100)
    q, k, v = make_qkv(2, 8, 2, 3400, 3400, 128, torch.bfloat16, dev)
    grad_out = torch.randn(2, 8, 3400, 128, device=dev, dtype=torch.bfloat16)
    with monkeypatch.context() as patch:  # one stream: the side stream is not the caller's to switch off
        patch.setattr(backward, "_streams", lambda device: (None, None))
        mbs_attention(q, k, v, CYCLIC, lens).backward(grad_out)
    expected = [t.grad.clone() for t in (q, k, v)]
    # the dQ pass on the side stream again
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        for t in (q, k, v):
            t.grad = None
        mbs_attention(q, k, v, CYCLIC, lens).backward(grad_out)
        copies = [t.grad.clone() for t in (q, k, v)]  # queued on the user stream, right behind the backward
    user.synchronize()
    for name, got, want in zip(("dq", "dk", "dv"), copies, expected):
        assert torch.equal(got, want), f"{name} differs when read on the caller's stream"


def test_side_stream_only_over_long_key_lists():
    """A call over few keys is bound by host work, which switching streams adds to: it stays on the caller's
    stream."""
    dev = torch.device("cuda")
    cfg = kernel_config(64, torch.float16, dev)
    assert not plan_attention(cfg, 1, 4, 4, SHORT_KEYS - 1, SHORT_KEYS - 1, dev).side_stream
    assert plan_attention(cfg, 1, 4, 4, SHORT_KEYS, SHORT_KEYS, dev).side_stream
    assert not plan_attention(cfg, 1, 4, 4, SHORT_KEYS, SHORT_KEYS, torch.device("cpu")).side_stream
    main, side = backward._streams(dev)
    assert main == torch.cuda.current_stream() and side is not None and side != main


@pytest.mark.parametrize("head_dim", [128, 256])
def test_a_launch_made_in_one_thread_runs_in_another(head_dim):
    """A forward launch is kept on its mask, but Triton's allocator for device-side tensor descriptors is per
    thread: a second thread reusing the launch (autograd's engine runs the backward and checkpoint recomputes in
    its own) must still get scratch memory, and give the same output."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(1, 2, 2, 4096, 4096, head_dim, torch.bfloat16, torch.device("cuda"), gen)
    lens = (1024, 2048, 1024)
    first = mbs_attention(q, k, v, HUB, lens).detach()
    got, errors = [], []

    def run() -> None:
        try:
            got.append(mbs_attention(q, k, v, HUB, lens).detach())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.testing.assert_close(got[0], first, rtol=0, atol=0)
