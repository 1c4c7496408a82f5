"""Past 2^31 elements: every index product that can pass 2^31 must not wrap (GPU only, ``-m large``).

Each case runs a problem whose tensors (or one sample's, or one dense mask's) pass 2^31 elements, and checks it
two ways:
- the last sample (or head) of the big run against the same slice run alone: bit for bit, since both run the same
  tiles in the same order (split-KV decode may differ by rounding: it splits a different grid);
- a float32 reference on query rows sampled just past every 2^31 element boundary and at random (out, dq) and on
  key rows likewise (dk, dv), computed a chunk of rows at a time (``reference_group_rows``).
Both dialects run: the Gluon kernels (where the GPU has them) and the tl kernels (``MMSPARSE_GLUON=0``).
"""

from __future__ import annotations

import pytest
import torch

from mmsparse import mbs_attention
from mmsparse.attention import config, dispatch
from mmsparse.attention.dropout import dropout_keep_rows, new_dropout_seed
from mmsparse.mask.topology import Topology, segment_ids
from mmsparse.reference import reference_group_rows
from tests.helpers import CYCLIC, HUB, ordered_config

pytestmark = [pytest.mark.gpu, pytest.mark.large]

TWO31 = 2**31
# bf16 inputs, float32 reference: relative L2 over the sampled rows, and max abs over the reference's max.
REL_TOL, ABS_TOL = 1.5e-2, 6e-2


@pytest.fixture(params=["gluon", "tl"])
def dialect(request, monkeypatch):
    """Run the case with the Gluon kernels (skipped where the GPU has none) and with the tl kernels."""
    monkeypatch.setenv("MMSPARSE_GLUON", "1" if request.param == "gluon" else "0")
    config._cached_cuda_config.cache_clear()
    if request.param == "gluon" and not dispatch.hopper_gluon_available(torch.cuda.current_device()):
        pytest.skip("no Gluon kernels on this GPU")
    yield request.param
    config._cached_cuda_config.cache_clear()


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def _rows_past_boundaries(t: torch.Tensor, count: int, gen: torch.Generator) -> dict[tuple[int, int], list[int]]:
    """{(b, h): [rows]} of a 4-D ``[B, H, S, D]`` tensor or view: the rows that hold, or sit next to, each 2^31-th
    element in memory (rows are ordered in memory by their strides, e.g. [B, S, H, D] for a transposed view), the
    last row, and ``count`` random rows."""
    dim = t.shape[3]
    order = sorted(range(3), key=lambda i: -t.stride(i))  # the dims of b, h, s from outer to inner in memory
    sizes = [t.shape[i] for i in order]
    total = sizes[0] * sizes[1] * sizes[2]
    picks: dict[tuple[int, int], set[int]] = {}

    def add(flat_row: int) -> None:
        index = [0, 0, 0]
        for i, size in zip(reversed(order), reversed(sizes)):
            flat_row, index[i] = divmod(flat_row, size)
        picks.setdefault((index[0], index[1]), set()).add(index[2])

    for n in range(1, total * dim // TWO31 + 1):
        first = -(-n * TWO31 // dim)  # the first whole row at or past the boundary
        for r in range(first - 1, first + 2):
            if 0 <= r < total:
                add(r)
    add(total - 1)
    for r in torch.randint(0, total, (count,), generator=gen, device="cuda").tolist():
        add(r)
    return {key: sorted(rows) for key, rows in picks.items()}


def _topology_rows(topology, lens_row, seq_k: int, seq_q: int, causal: bool):
    """allowed(rows) for one sample from its topology of pair types (0 none, 1 full, 2 causal: the keys of that
    segment at or before the query) and lengths (an independent token lookup)."""
    k = Topology(topology).num_segments
    types = torch.zeros(k + 1, k + 1, dtype=torch.int8, device="cuda")
    types[:k, :k] = torch.as_tensor(topology, dtype=torch.int8)
    seg = segment_ids(torch.as_tensor([lens_row]), seq_k)[0].cuda()
    past = seq_k - seq_q
    key_pos = torch.arange(seq_k, device="cuda")

    def allowed(rows: torch.Tensor) -> torch.Tensor:
        pair = types[seg[past + rows][:, None], seg[None, :]]
        before = key_pos[None, :] <= (past + rows)[:, None]
        m = (pair == 1) | ((pair == 2) & before)
        return m & before if causal else m

    return allowed


def _check(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    got, ref = got.float(), ref.float()
    assert not torch.isnan(got).any(), f"{name}: NaN"
    rel = ((got - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    max_abs = (got - ref).abs().max().item()
    scale = max(ref.abs().max().item(), 1.0)
    assert rel <= REL_TOL and max_abs <= ABS_TOL * scale, f"{name}: rel L2 {rel:.3e}, max abs {max_abs:.3e}"


def _check_sampled(q, k, v, do, out, grads, allowed_for, gen, keep_for=None, dropout_p=0.0, key_groups=2):
    """out and dq on rows past every boundary of q; dk and dv on rows past every boundary of k, for at most
    ``key_groups`` (sample, kv head) pairs (each walks the whole sequence)."""
    dq, dk, dv = grads
    group = q.shape[1] // k.shape[1]
    for (b, h), rows in _rows_past_boundaries(q, 4, gen).items():
        rows_t = torch.tensor(rows, device="cuda")
        keep = None if keep_for is None else (lambda g, idx, b=b, h=h: keep_for(b, h, idx))
        ref = reference_group_rows(q[b, h:h + 1], k[b, h // group], v[b, h // group], do[b, h:h + 1],
                                   allowed_for(b), rows_t, rows_t[:0], keep=keep, dropout_p=dropout_p)
        _check(f"out[{b},{h}]", out[b, h, rows_t], ref[0][0])
        _check(f"dq[{b},{h}]", dq[b, h, rows_t], ref[1][0])
    key_picks = list(_rows_past_boundaries(k, 4, gen).items())
    for (b, hk), cols in key_picks[:1] + key_picks[1:][-(key_groups - 1):] if key_groups > 1 else key_picks[:1]:
        cols_t = torch.tensor(cols, device="cuda")
        heads = slice(hk * group, (hk + 1) * group)
        keep = None if keep_for is None else (lambda g, idx, b=b, hk=hk: keep_for(b, hk * group + g, idx))
        ref = reference_group_rows(q[b, heads], k[b, hk], v[b, hk], do[b, heads], allowed_for(b),
                                   cols_t[:1], cols_t, chunk=1024, keep=keep, dropout_p=dropout_p)
        _check(f"dk[{b},{hk}]", dk[b, hk, cols_t], ref[2])
        _check(f"dv[{b},{hk}]", dv[b, hk, cols_t], ref[3])


def _run(q, k, v, do, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = mbs_attention(q, k, v, **kw)
    out.backward(do)
    return out.detach(), (q.grad, k.grad, v.grad)


def _assert_bit_equal(name, big, alone):
    assert torch.equal(big, alone), f"{name}: the batch's slice differs from the slice run alone " \
        f"(max abs {(big.float() - alone.float()).abs().max().item():.3e})"


@pytest.mark.parametrize("per_sample", [False, True], ids=["shared-lens", "per-sample-lens"])
def test_batch_past_2_31(dialect, per_sample):
    """The reported case: B * Hq * S * D = 2.36e9 (the int32 delta offset wrapped: dq off by 5.5%)."""
    gen = torch.Generator(device="cuda").manual_seed(18)
    seg = (4096, 120000, 20000)
    seq = sum(seg)
    lens = [seg, seg, (2000, 100000, 30000), (4096, 119000, 21000)] if per_sample else seg
    q, do = (_randn(4, 32, seq, 128, gen=gen) for _ in "qo")
    k, v = (_randn(4, 8, seq, 128, gen=gen) for _ in "kv")
    out, grads = _run(q, k, v, do, topology=CYCLIC, seg_lens=lens)
    last = [lens[-1]] if per_sample else lens
    out1, grads1 = _run(q[-1:], k[-1:], v[-1:], do[-1:], topology=CYCLIC, seg_lens=last)
    _assert_bit_equal("out", out[-1:], out1)
    for name, g, g1 in zip(("dq", "dk", "dv"), grads, grads1):
        _assert_bit_equal(name, g[-1:], g1)
    rows = lens if per_sample else [lens] * 4
    _check_sampled(q, k, v, do, out, grads, lambda b: _topology_rows(CYCLIC, rows[b], seq, seq, False), gen)


# A Gemma-3-like sample: text causal over everything before it, each image whole and seeing everything before it
GEMMA_LIKE = [[2, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 2, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 2]]


def test_head_dim_256_batch_past_2_31(dialect):
    """Gemma's head dim (the Gluon forward, dQ and dK/dV kernels of head dims 129-256): B * H * S * D = 2.23e9 for q,
    k and v alike (MHA), per-sample lengths, as [B, S, H, D] views (row * stride_row wraps)."""
    gen = torch.Generator(device="cuda").manual_seed(20)
    lens = [(9000, 4096, 12000, 4096, 4808)] * 31 + [(6000, 4096, 9000, 8192, 6712)]
    seq, batch, heads = sum(lens[0]), len(lens), 8

    def make():
        return _randn(batch, seq, heads, 256, gen=gen).transpose(1, 2)

    q, k, v = make(), make(), make()
    do = _randn(batch, heads, seq, 256, gen=gen)
    assert q.numel() > TWO31 and k.numel() > TWO31
    out, grads = _run(q, k, v, do, topology=GEMMA_LIKE, seg_lens=lens)
    out1, grads1 = _run(q[-1:], k[-1:], v[-1:], do[-1:], topology=GEMMA_LIKE, seg_lens=lens[-1:])
    _assert_bit_equal("out", out[-1:], out1)
    for name, g, g1 in zip(("dq", "dk", "dv"), grads, grads1):
        _assert_bit_equal(name, g[-1:], g1)
    _check_sampled(q, k, v, do, out, grads, lambda b: _topology_rows(GEMMA_LIKE, lens[b], seq, seq, False), gen)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_one_sample_past_2_31(dialect, layout):
    """One sample with H * S * D = 2.46e9, contiguous (h * stride_h wraps) and as a [B, S, H, D] view (row *
    stride_row wraps), MHA so that k and v pass 2^31 too."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    seg = (4096, 560000, 36000)
    seq, heads = sum(seg), 32

    def make():
        t = _randn(1, seq, heads, 128, gen=gen) if layout == "BSHD" else _randn(1, heads, seq, 128, gen=gen)
        return t.transpose(1, 2) if layout == "BSHD" else t

    q, k, v = make(), make(), make()
    do = _randn(1, heads, seq, 128, gen=gen)
    out, grads = _run(q, k, v, do, topology=CYCLIC, seg_lens=seg, causal=True)
    out1, grads1 = _run(q[:, -1:], k[:, -1:], v[:, -1:], do[:, -1:], topology=CYCLIC, seg_lens=seg, causal=True)
    _assert_bit_equal("out", out[:, -1:], out1)
    for name, g, g1 in zip(("dq", "dk", "dv"), grads, grads1):
        _assert_bit_equal(name, g[:, -1:], g1)
    _check_sampled(q, k, v, do, out, grads, lambda b: _topology_rows(CYCLIC, seg, seq, seq, True), gen)


def test_dense_mask_past_2_31(dialect):
    """A dense mask of one sample with Sq * S = 2.3e9 (offs_q * stride_mask_q wraps): the topology path's result,
    and the float32 reference on rows past the boundary."""
    gen = torch.Generator(device="cuda").manual_seed(20)
    seg = (6000, 30000, 12000)
    seq = sum(seg)
    allowed = _topology_rows(HUB, seg, seq, seq, True)
    mask = torch.cat([allowed(rows) for rows in torch.arange(seq, device="cuda").split(4096)])  # [S, S] bool
    q, do = (_randn(2, 4, seq, 64, gen=gen) for _ in "qo")
    k, v = (_randn(2, 2, seq, 64, gen=gen) for _ in "kv")
    out, grads = _run(q, k, v, do, topology=None, seg_lens=None, attn_mask=mask)
    out_t, grads_t = _run(q, k, v, do, topology=HUB, seg_lens=seg, causal=True)
    # The same mask as a topology: compiled, the two kernel variants may reduce rows in another order (the loaded
    # mask tile changes Triton's layouts), so they agree to rounding (bit for bit through the interpreter).
    _check("out vs topology", out, out_t)
    for name, g, g1 in zip(("dq", "dk", "dv"), grads, grads_t):
        _check(f"{name} vs topology", g, g1)
    rows = torch.tensor([TWO31 // seq - 1, TWO31 // seq, TWO31 // seq + 1, seq - 1], device="cuda")
    for b, h in ((0, 0), (1, 3)):
        ref = reference_group_rows(q[b, h:h + 1], k[b, h // 2], v[b, h // 2], do[b, h:h + 1], lambda idx: mask[idx],
                                   rows, rows[:0])
        _check(f"out[{b},{h}]", out[b, h, rows], ref[0][0])
        _check(f"dq[{b},{h}]", grads[0][b, h, rows], ref[1][0])


def test_split_kv_decode_past_2_31(dialect):
    """16 queries over a cache of B * Hkv * S * D = 2.5e9 elements: split key lists and their combine."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    seg = (2048, 250000, 48000)
    seq = sum(seg)
    q, do = (_randn(8, 32, 16, 128, gen=gen) for _ in "qo")
    k, v = (_randn(8, 8, seq, 128, gen=gen) for _ in "kv")
    out, grads = _run(q, k, v, do, topology=HUB, seg_lens=seg, causal=True)
    out1, _ = _run(q[-1:], k[-1:], v[-1:], do[-1:], topology=HUB, seg_lens=seg, causal=True)
    _check("out alone", out[-1:], out1)  # a different grid splits differently: equal up to rounding
    allowed = _topology_rows(HUB, seg, seq, 16, True)
    all_rows = torch.arange(16, device="cuda")
    for b, hk in ((0, 0), (7, 7)):
        heads = slice(hk * 4, hk * 4 + 4)
        cols = torch.tensor([0, seq // 2, seq - 2, seq - 1], device="cuda")
        ref = reference_group_rows(q[b, heads], k[b, hk], v[b, hk], do[b, heads], lambda idx: allowed(idx),
                                   all_rows, cols)
        _check(f"out[{b}]", out[b, heads], ref[0])
        _check(f"dq[{b}]", grads[0][b, heads], ref[1])
        _check(f"dk[{b},{hk}]", grads[1][b, hk, cols], ref[2])
        _check(f"dv[{b},{hk}]", grads[2][b, hk, cols], ref[3])


def test_dropout_past_2_31():
    """Dropout over B * Hq * S * D = 2.4e9 (the tl kernels: the Gluon ones take no dropout): the kernels' bits at
    the sampled rows, regenerated by position, give the float32 reference."""
    gen = torch.Generator(device="cuda").manual_seed(22)
    seg = (4096, 120000, 20000)
    seq, p = sum(seg), 0.1
    q, do = (_randn(4, 32, seq, 128, gen=gen) for _ in "qo")
    k, v = (_randn(4, 8, seq, 128, gen=gen) for _ in "kv")
    torch.manual_seed(5)
    out, grads = _run(q, k, v, do, topology=CYCLIC, seg_lens=seg, dropout_p=p)
    torch.manual_seed(5)
    seed = new_dropout_seed(q.device)
    past = torch.zeros(4, dtype=torch.int32, device="cuda")

    def keep_for(b: int, h: int, idx: torch.Tensor) -> torch.Tensor:
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        if hi - lo == idx.numel():  # a run of rows: one launch
            return dropout_keep_rows(seed, b * 32 + h, 1, 32, lo, hi - lo, seq, p, past)[0]
        return torch.cat([dropout_keep_rows(seed, b * 32 + h, 1, 32, r, 1, seq, p, past)[0] for r in idx.tolist()])

    _check_sampled(q, k, v, do, out, grads, lambda b: _topology_rows(CYCLIC, seg, seq, seq, False), gen,
                   keep_for=keep_for, dropout_p=p, key_groups=1)


@pytest.mark.parametrize("layout,head_dim,ordered", [("BHSD", 128, False), ("BSHD", 128, False), ("BSHD", 64, False),
                                                     ("BSHD", 128, True)])
def test_one_pass_past_2_31(layout, head_dim, ordered):
    """The one-pass backward (deterministic=False: on Hopper the dQ-writer kernel at D=64 and 128, its default at
    every length; the tl one elsewhere, forced past its threshold; ``ordered``: the dQ writer with its adds in order,
    deterministic=True, on Hopper): its float32 dQ accumulator has B * Hq * S * D = 2.36e9 elements, and q as a
    [B, S, H, D] view puts row * stride_row past 2^31. Unordered atomic adds run in any order, so the check is the
    float32 reference on the sampled rows and the two-pass result."""
    if ordered and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the ordered dQ writer is a Hopper kernel")
    gen = torch.Generator(device="cuda").manual_seed(23)
    seg = (4096, 120000, 20000)
    seq = sum(seg)
    heads = 32 * 128 // head_dim
    q = (_randn(4, seq, heads, head_dim, gen=gen).transpose(1, 2) if layout == "BSHD"
         else _randn(4, heads, seq, head_dim, gen=gen))
    do = _randn(4, heads, seq, head_dim, gen=gen)
    k, v = (_randn(4, heads // 4, seq, head_dim, gen=gen) for _ in "kv")
    # the one-pass kernel at this length (not by default)
    with config.use_tuning(ordered_config(head_dim) if ordered else None, one_pass_max_keys=1 << 62):
        out, grads = _run(q, k, v, do, topology=HUB, seg_lens=seg, causal=True, deterministic=ordered)
    _check_sampled(q, k, v, do, out, grads, lambda b: _topology_rows(HUB, seg, seq, seq, True), gen)
    del out
    _, grads2 = _run(q, k, v, do, topology=HUB, seg_lens=seg, causal=True)
    for name, g, g2 in zip(("dq", "dk", "dv"), grads, grads2):
        _check(f"{name} one pass vs two, last sample", g[-1], g2[-1])  # a slice: float32 copies of all would not fit


def _tile_maps(lists, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, partial) bool ``[rows, cols]`` maps of one sample's lists, read through their starts."""
    counts = lists.counts[0].long()
    used = counts[:, 0] + counts[:, 1]
    row = torch.repeat_interleave(torch.arange(rows, device=used.device), used)
    slot = torch.arange(row.numel(), device=used.device) - (used.cumsum(0) - used)[row]
    ids = lists.indices[0].long()[counts[row, 2] + slot]
    is_full = slot < counts[row, 0]
    full = torch.zeros(rows, cols, dtype=torch.bool, device=used.device)
    partial = torch.zeros_like(full)
    full[row[is_full], ids[is_full]] = True
    partial[row[~is_full], ids[~is_full]] = True
    return full, partial


def test_metadata_of_1m_tokens_is_compact():
    """1M tokens (text, vision, audio; hub, causal): the block lists of all three kernels are packed, hold exactly
    the live tiles of the torch classification, and with the token bits and summaries stay under 5% of q/k/v
    (16 query heads, 4 key/value heads, D=128, bf16)."""
    from mmsparse.attention.kernel_args import list_tiles, prepare
    from mmsparse.mask.blocks import classify_blocks_from_bits
    from mmsparse.mask.info import MaskInfo

    seg = (8192, 786432, 253952)
    seq = sum(seg)
    info = MaskInfo.from_topology(Topology(HUB), torch.tensor([seg], device="cuda"), seq, seq, True)
    tiles = config.kernel_config(128, torch.bfloat16, torch.device("cuda"))
    prepare(info, tiles)
    held = [info.q_bits, info.k_bits, *info._summaries.values()]
    for block_m, block_n, by_key in list_tiles(tiles, seq, seq):
        lists = info.lists(block_m, block_n, by_key)
        held += [lists.counts, lists.indices]
        live, full = classify_blocks_from_bits(info.q_bits, info.k_bits, 3, block_m, block_n, True, info.q_start)
        if by_key:
            live, full = live.transpose(1, 2), full.transpose(1, 2)
        got_full, got_partial = _tile_maps(lists, *live.shape[1:])
        assert torch.equal(got_full, full[0]) and torch.equal(got_partial, (live & ~full)[0])
        assert lists.indices.numel() == int(live.sum())  # packed: live tiles only
        del live, full, got_full, got_partial
    metadata = sum(t.numel() * t.element_size() for t in {id(t): t for t in held}.values())
    qkv = seq * 16 * 128 * 2 + 2 * seq * 4 * 128 * 2
    assert metadata <= 0.05 * qkv, f"metadata {metadata / 2**20:.0f} MiB is {metadata / qkv:.1%} of q/k/v"
    print(f"metadata {metadata / 2**20:.1f} MiB = {metadata / qkv:.2%} of q/k/v")
