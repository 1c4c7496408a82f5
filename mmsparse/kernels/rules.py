"""The rules both kernel dialects follow, written once: which (query, key) pairs of a tile are allowed (in operators
and builtins that both share: a Gluon kernel that calls these ``triton.jit`` functions compiles them with Gluon's
semantics, so the tensors keep the caller's layouts), and how the backward passes compute P."""

from __future__ import annotations

import triton
import triton.language as tl

from .constants import CAUSAL, FULL, MASK_BITS, MASK_SEGMENTS, SEG_BITS

_SEG_BITS = tl.constexpr(SEG_BITS)
_SEG_MASK = tl.constexpr((1 << SEG_BITS) - 1)
_FULL = tl.constexpr(FULL)
_CAUSAL = tl.constexpr(CAUSAL)
_MASK_BITS = tl.constexpr(MASK_BITS)
_MASK_SEGMENTS = tl.constexpr(MASK_SEGMENTS)


@triton.jit
def allowed_pairs(offs_q, offs_k, q_val, k_val, mask_ptr, stride_mask_q, seq_q, seq_k, q_start, window,
                  MASK_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Allowed pairs of one tile. ``offs_q``/``offs_k`` are broadcastable 2-D row and column indices ([M, 1] x
    [1, N], or [1, M] x [N, 1] for a transposed tile), and ``q_val``/``k_val`` the rows' and columns' bits or
    segment codes, broadcast alike and loaded as 0 past the ends (a dense mask reads neither). ``mask_ptr`` is
    the batch row of the dense mask (row stride ``stride_mask_q``), or the pair table with codes (its row stride
    in ``stride_mask_q``). Query positions are ``q_start + offs_q``; key positions are ``offs_k``.
    With HAS_WINDOW a key is also kept only when its position is past the query's minus ``window`` (a sliding
    window over the past; keys after the query are left to the rest of the rule).

    - bits: some segment is seen by the row and holds the column (bits past the ends are 0);
    - codes (:mod:`mmsparse.mask.segment_codes`): same doc, and the pair table says FULL, or CAUSAL with the key at or
      before the query;
    - dense: the mask's element.
    """
    if MASK_MODE == _MASK_BITS:
        allowed = (q_val & k_val) != 0
    elif MASK_MODE == _MASK_SEGMENTS:
        kind = tl.load(mask_ptr + (q_val & _SEG_MASK) * stride_mask_q + (k_val & _SEG_MASK))
        same_doc = ((q_val ^ k_val) >> _SEG_BITS) == 0
        allowed = same_doc & ((kind == _FULL) | ((kind == _CAUSAL) & (offs_k <= q_start + offs_q)))
        allowed = allowed & (offs_q < seq_q) & (offs_k < seq_k)
    else:
        inside = (offs_q < seq_q) & (offs_k < seq_k)
        # 64-bit: one sample's Sq * S passes 2^31 from S = 46341 on
        allowed = tl.load(mask_ptr + offs_q.to(tl.int64) * stride_mask_q + offs_k, mask=inside, other=0) != 0
    if IS_CAUSAL:
        allowed = allowed & (offs_k <= q_start + offs_q)
    if HAS_WINDOW:
        allowed = allowed & (offs_k > q_start + offs_q - window)
    return allowed


# A kernel calls the rule below with its constexprs and the host with the launch's values; Triton before 3.4 has no
# constexpr functions (no Gluon kernel runs there), and the host call is a plain call
_constexpr_function = getattr(triton, "constexpr_function", lambda fn: fn)


@_constexpr_function
def lse_in_scores(mask_mode: int, causal: bool, head_dim_pad: int) -> bool:
    """Whether the backward passes put -lse / scale into S's (S^T's) initial value before the matmul and take
    p = exp2(S scale), rather than p = exp2(S scale - lse) after it: so that no load of lse stands between the
    matmul's end and the exponentials (the Gluon dQ-writer kernel 1.04-1.06x). At head dims up to 128 (the D=256
    dK/dV kernel, ``gluon.dkdv_d256``, subtracts it after), under every mask but segment codes with the causal flag,
    whose partial blocks' mask then made ptxas 3.6 and 3.7 spill. The two forms round apart in float32, and dS is
    rounded to the input dtype from P: a dQ pass computes P as its dK/dV pass does (a tl dQ pass beside the Gluon
    dK/dV one takes the Gluon passes' form), so the two passes, and the one pass, agree on dS."""
    return head_dim_pad <= 128 and (mask_mode != MASK_SEGMENTS or not causal)
