"""Triton helpers shared by the forward and backward kernels: the exact tile mask, dropout, tile loads."""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import DOT_TF32X3, DOT_UPCAST, MASK_DENSE
from ..lists import WORDS_PER_ROW
from ..rules import allowed_pairs

_MASK_DENSE = tl.constexpr(MASK_DENSE)
_DOT_UPCAST = tl.constexpr(DOT_UPCAST)
_DOT_TF32X3 = tl.constexpr(DOT_TF32X3)


@triton.jit
def dot(a, b, DOT_MODE: tl.constexpr, acc=None):
    """a @ b with fp32 accumulation, in the precision mode chosen by the launcher (``constants.DOT_*``). ``acc``: an
    initial value the matmul accumulates onto (acc + a @ b, as a Hopper wgmma starts from it, not a sum added
    after it)."""
    if DOT_MODE == _DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    elif DOT_MODE == _DOT_TF32X3:
        return tl.dot(a, b, acc=acc, input_precision="tf32x3")
    else:
        return tl.dot(a, b, acc=acc)


@triton.jit
def element_strides(stride_b8, stride_h8, stride_row8):
    """A tensor's batch, head and row strides, passed in units of 8 elements (``attention.layouts.in_eights``; the
    launchers guarantee multiples of 8: head dims are), in elements, 64-bit (a batch stride passes 2^31). Multiplied
    by a constant here, Triton knows them to be multiples of 8 and vectorises the loads and stores at them in every
    version, though they are not specialised on (a new length must not recompile); a ``tl.multiple_of`` hint on a
    runtime stride is lost (Triton 3.6 and 3.9 load such a tile one element at a time)."""
    return stride_b8.to(tl.int64) * 8, stride_h8.to(tl.int64) * 8, stride_row8.to(tl.int64) * 8


@triton.jit
def pair_mask(
    offs_q,
    offs_k,
    q_bits_ptr,
    k_bits_ptr,
    mask_ptr,
    stride_mask_q,
    seq_q,
    seq_k,
    q_start,
    window,
    MASK_MODE: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """:func:`mmsparse.kernels.rules.allowed_pairs` of a tile, with the rows' and columns' bits or codes loaded
    here from pointers already at the (batch) row; offs_q/offs_k are broadcastable 2-D index tiles ([BM, 1] x
    [1, BN] in the forward, [1, BM] x [BN, 1] in the dK/dV pass)."""
    q_val = offs_q
    k_val = offs_k
    if MASK_MODE != _MASK_DENSE:  # a dense mask reads neither
        q_val = tl.load(q_bits_ptr + offs_q, mask=offs_q < seq_q, other=0)
        k_val = tl.load(k_bits_ptr + offs_k, mask=offs_k < seq_k, other=0)
    return allowed_pairs(offs_q, offs_k, q_val, k_val, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window,
                         MASK_MODE, IS_CAUSAL, HAS_WINDOW)


@triton.jit
def dropout_keep(seed, bh, pos_q, pos_k, dropout_p):
    """Bernoulli keep mask of one tile, a pure function of (64-bit seed, batch*head, query position, key position):
    the forward and both backward passes regenerate exactly the same bits, in any tile shape or orientation, and
    a call over a shard or an offset query range (``q_start``) draws the bits of the same absolute positions.
    ``seed`` is ``(Philox key, query offset, key offset)`` (:func:`load_seed`): the offsets move a call's positions
    to where its rows and keys sit in a longer sequence (a context-parallel piece). Positions are below 2^31 and
    batch*head below 2^32, so each Philox counter word holds one of them exactly."""
    key, q_offset, k_offset = seed
    zero = (pos_q * 0 + pos_k * 0).to(tl.uint32)
    c0 = (pos_k + k_offset).to(tl.uint32) + zero
    c1 = (pos_q + q_offset).to(tl.uint32) + zero
    c2 = zero + bh.to(tl.uint32)
    r, _, _, _ = tl.philox(key, c0, c1, c2, zero)
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def load_seed(SEED):
    """The int64 ``[3]`` dropout seed: (Philox key, query position offset, key position offset)."""
    return tl.load(SEED), tl.load(SEED + 1), tl.load(SEED + 2)


@triton.jit
def load_rows(ptr, offs_row, stride_row, offs_d, n_rows, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a [rows, HEAD_DIM_PAD] tile; masks rows past n_rows only when CHECK_ROWS, columns past HEAD_DIM
    only when the head dim is not a power of two."""
    ptrs = ptr + offs_row[:, None] * stride_row + offs_d[None, :]
    if CHECK_ROWS:
        if HEAD_DIM == offs_d.shape[0]:
            return tl.load(ptrs, mask=(offs_row < n_rows)[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=(offs_row < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        if HEAD_DIM == offs_d.shape[0]:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def store_rows(ptr, value, offs_row, stride_row, offs_d, n_rows, HEAD_DIM: tl.constexpr):
    ptrs = ptr + offs_row[:, None] * stride_row + offs_d[None, :]
    tl.store(ptrs, value, mask=(offs_row < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def program_setup(b, row, COUNTS, INDICES, Q_BITS, K_BITS, MASK, SEED, Q_START, stride_cnt_b, stride_idx_b,
                  stride_qbits_b, stride_kbits_b, stride_mask_b, stride_qstart_b,
                  HAS_DROPOUT: tl.constexpr):
    """What every kernel reads first for batch b and its own row block: (number of full blocks, number of
    partial blocks, pointer to its block list, its mask pointers, the dropout seed, the position of the
    sample's first query)."""
    b64 = b.to(tl.int64)  # B samples' lists of up to 2^31 entries each
    cnt_ptr = COUNTS + b64 * stride_cnt_b + row * WORDS_PER_ROW
    n_full = tl.load(cnt_ptr)
    n_part = tl.load(cnt_ptr + 1)
    idx_ptr = INDICES + b64 * stride_idx_b + tl.load(cnt_ptr + 2)  # the row's list starts at counts' third word
    seed = (0, 0, 0)
    if HAS_DROPOUT:
        seed = load_seed(SEED)
    return (n_full, n_part, idx_ptr, Q_BITS + b64 * stride_qbits_b, K_BITS + b64 * stride_kbits_b,
            MASK + b64 * stride_mask_b, seed, tl.load(Q_START + b * stride_qstart_b))


@triton.jit
def make_source(ptr, n_rows, stride_row, BR: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Where [BR, HEAD_DIM_PAD] tiles of one (batch, head) matrix come from: a TMA tensor descriptor (rows past
    n_rows and columns past HEAD_DIM read as 0, writes there are dropped), or the plain pointer."""
    if USE_TMA:
        return tl.make_tensor_descriptor(ptr, [n_rows, HEAD_DIM], [stride_row, 1], [BR, HEAD_DIM_PAD])
    else:
        return ptr


@triton.jit
def load_block(src, row0, offs_row, stride_row, offs_d, n_rows, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows row0 .. row0 + BR - 1 of a source made by make_source (offs_row = row0 + arange(BR)). Pointer loads
    start from a 64-bit row base and keep 32-bit offsets inside the tile: row * stride passes 2^31 in a
    ``[B, S, H, D]`` view long before the tile's own offsets could."""
    if USE_TMA:
        return src.load([row0, 0])
    else:
        base = src + row0.to(tl.int64) * stride_row
        return load_rows(base, offs_row - row0, stride_row, offs_d, n_rows - row0, HEAD_DIM, CHECK_ROWS)


@triton.jit
def store_block(dst, row0, value, offs_row, stride_row, offs_d, n_rows, HEAD_DIM: tl.constexpr,
                USE_TMA: tl.constexpr):
    if USE_TMA:
        dst.store([row0, 0], value)
    else:
        base = dst + row0.to(tl.int64) * stride_row  # as in load_block
        store_rows(base, value, offs_row - row0, stride_row, offs_d, n_rows - row0, HEAD_DIM)
