"""Public functional API of multimodal block-sparse (MBS) attention: input checks, the mask (cached), the dropout
seed, then the autograd.Function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .attention.autograd import MBSAttentionFunction
from .attention.config import current_settings
from .attention.limits import check_problem_size
from .attention.plan import plan_attention
from .mask.cache import CACHE
from .mask.info import MaskInfo
from .mask.keys import value_key
from .mask.lengths import SegLensArg, lens_tensor, packed_lens_tensor, q_start_tensor
from .mask.topology import Topology
from .runtime.launch import interpreter_active
from .runtime.scratch import clear_scratch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError/TypeError naming the problem when q, k, v cannot go to the kernels."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32"
                            + (FLOAT64_HINT if t.dtype == torch.float64 else ""))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype} (cast them first)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not interpreter_active():
        raise ValueError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton/mmsparse, "
            "or move q, k, v to a CUDA device"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {q.device}: use CUDA tensors (or CPU with TRITON_INTERPRET=1)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    bq, hq, sq, d = q.shape
    bk, hk, sk, dk = k.shape
    if bq != bk:
        raise ValueError(f"batch sizes differ: q has {bq}, k/v have {bk}")
    if d != dk:
        raise ValueError(f"head dims differ: q has {d}, k/v have {dk}")
    if not head_dim_supported(d):
        raise ValueError(f"head dim {d} is not supported: use {SUPPORTED_HEAD_DIMS}")
    # k/v in [B, S, H, D] by mistake: more entries in dim 1 than in dim 2, rarely so in [B, H, S, D]
    hint = f" (if q/k/v are [B, S, H, D]: {_LAYOUT_HINT})" if hk > sk else ""
    if hq == 0 or hk == 0:
        raise ValueError(f"heads must be positive: q has {hq} query heads and k/v {hk} key/value heads (dim 1 of "
                         f"[B, H, S, D]){hint}")
    if hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA/MQA{hint}")
    if sq > sk:
        raise ValueError(
            f"q has {sq} positions but k/v only {sk}: queries are the last q_len of the kv positions{hint}"
        )
    check_problem_size(bq, hq, sq, sk)


SUPPORTED_HEAD_DIMS = "a multiple of 8 between 16 and 256"


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernels take this head dim (:data:`SUPPORTED_HEAD_DIMS`)."""
    return 16 <= head_dim <= 256 and head_dim % 8 == 0


def check_flag(name: str, value: Any) -> bool:
    """A yes/no argument as a bool: True/False (0/1 and numpy bools too). Anything else, such as the string "yes"
    (which Python would read as true), is a TypeError."""
    if value is True or value is False:
        return value
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if numpy_bool or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False; got {type(value).__name__} {value!r}")


def check_deterministic(value: Any) -> bool | None:
    """The ``deterministic`` argument: None (the process-wide default, :func:`mmsparse.use_config`) or a bool
    (:func:`check_flag`); anything else is a TypeError."""
    if value is None:
        return None
    try:
        return check_flag("deterministic", value)
    except TypeError:
        raise TypeError(f"deterministic must be True (bitwise repeatable two-pass backward), False (one-pass backward, "
                        f"dQ by atomic adds) or None (the default of use_config); got {type(value).__name__} "
                        f"{value!r}") from None


def check_window(window: Any, seq_k: int | None = None) -> int | None:
    """A sliding window as an int or None: a key is kept only when its position is past the query's minus
    ``window``, so ``window=1`` keeps each query's own position and the future, ``window=W`` the W positions up to
    the query. None, or (given the key count ``seq_k``) a window of at least seq_k, which keeps every key, is
    no window."""
    if window is None:
        return None
    numpy_int = type(window).__module__ == "numpy" and hasattr(window, "item") and "int" in type(window).__name__
    if isinstance(window, bool) or not (isinstance(window, int) or numpy_int):
        raise TypeError(f"window must be a positive int (keys within that many positions up to the query) or None; "
                        f"got {type(window).__name__} {window!r}")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be a positive int: a key is kept when its position is past the query's minus "
                         f"the window, so window=1 keeps only the query's own position; got {window}")
    return None if seq_k is not None and window >= seq_k else window


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 sample"``, ``"2 samples"``: a number and its noun, in the plural (default: noun + "s") unless 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def check_dropout(value: Any, name: str = "dropout") -> float:
    """A dropout probability as a float in [0, 1): a TypeError for anything but a real number (a bool or a string
    included), a ValueError outside the range."""
    numpy_float = type(value).__module__ == "numpy" and "float" in type(value).__name__
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or numpy_float):
        raise TypeError(f"{name} must be a float in [0, 1); got {type(value).__name__} {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1); got {value!r}")
    return float(value)


def check_softmax_scale(value: Any) -> float | None:
    """A softmax scale as a float: None (meaning 1/sqrt(head dim)) or a finite positive number."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"softmax_scale must be a positive float or None (for 1/sqrt(head_dim)); got "
                        f"{type(value).__name__} {value!r}")
    try:
        scale = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"softmax_scale must be a positive float or None (for 1/sqrt(head_dim)); got "
                        f"{type(value).__name__} {value!r}") from e
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"softmax_scale must be a finite positive number; got {value!r}")
    return scale


FLOAT64_HINT = (
    ". For float64 checks (gradcheck and the like) use the dense float64 reference instead: "
    "mmsparse.reference_attention(q, k, v, mmsparse.reference_mask(topology, seg_lens, S)); the kernels run in "
    "float32 or below"
)

_LAYOUT_HINT = (
    "mmsparse takes q/k/v as [B, H, S, D], as F.scaled_dot_product_attention does; for [B, S, H, D] tensors pass "
    "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (views, no copy) and transpose the output back"
)


def layout_hint(k: torch.Tensor, seg_lens: Any) -> str | None:
    """The layout hint when k's dim 1 holds the positions the lengths ask for but dim 2 does not: a [B, S, H, D]
    tensor passed by mistake. None otherwise (or when the lengths cannot be read)."""
    try:
        lens = seg_lens.tolist() if isinstance(seg_lens, torch.Tensor) else seg_lens
        rows = lens if len(lens) and isinstance(lens[0], (list, tuple)) else [lens]
        needed = max(sum(int(n) for n in row) for row in rows)
    except (TypeError, ValueError):
        return None
    if needed > k.shape[2] and needed <= k.shape[1]:
        return f"k/v have {k.shape[1]} in dim 1 and {k.shape[2]} in dim 2: {_LAYOUT_HINT}"
    return None


def build_mask_info(
    topology: Any, seg_lens: SegLensArg, seq_q: int, seq_k: int, causal: bool, device: torch.device,
    check_lengths: bool = True,
    q_start: torch.Tensor | Sequence[int] | None = None,
    packed: bool = False,
    window: int | None = None,
) -> MaskInfo:
    """Validated :class:`MaskInfo` for a topology and lengths. Host-side lengths (ints, lists) are cached by
    value; a length tensor is used as is (built on its device every call, no cache). ``check_lengths=False``
    skips reading a device length tensor back to the host (no sync; invalid lengths then go unreported).
    ``packed``: seg_lens are ``[N, k]`` samples laid end to end in one sequence. ``window``: a sliding window
    (:func:`check_window`)."""
    if causal is not True and causal is not False:
        causal = check_flag("causal", causal)
    window = check_window(window, seq_k)
    topo_key, key, lens_key = _topology_key(topology), None, None
    # Traced calls build the mask in the graph: a cached mask would carry the tensors of an earlier call.
    if not isinstance(seg_lens, torch.Tensor) and q_start is None and not torch.compiler.is_compiling():
        lens_key = value_key(seg_lens)
    if lens_key is not None:
        key = ("mask", topo_key, lens_key, seq_q, seq_k, causal, str(device), packed, window)
        hit = CACHE.mask(key)
        if hit is not None:
            return hit
    info = make_mask_info(_as_topology(topology, topo_key), seg_lens, seq_q, seq_k, causal, device, check_lengths,
                          q_start, packed, window)
    return info if key is None else CACHE.store_mask(key, info)


def make_mask_info(
    topology: Topology, seg_lens: SegLensArg, seq_q: int, seq_k: int, causal: bool, device: torch.device,
    check_lengths: bool = True,
    q_start: torch.Tensor | Sequence[int] | None = None,
    packed: bool = False,
    window: int | None = None,
) -> MaskInfo:
    """A new :class:`MaskInfo` for a validated topology and lengths (checked here), kept by no cache: the
    arguments are :func:`build_mask_info`'s, with ``causal`` a bool and ``window`` checked already."""
    if not isinstance(topology, Topology):
        raise TypeError(f"make_mask_info takes a Topology; got {type(topology).__name__} (build_mask_info takes "
                        "any matrix)")
    if packed:
        lens = packed_lens_tensor(seg_lens, topology.num_segments, seq_k, device, check_lengths)
        return MaskInfo.from_segments(topology, lens, seq_q, seq_k, causal, packed=True, window=window)
    lens = lens_tensor(seg_lens, topology.num_segments, seq_k, device, check_lengths)
    if q_start is not None:
        q_start = q_start_tensor(q_start, seq_q, seq_k, device, check_lengths)
        if lens.shape[0] not in (1, q_start.shape[0]):
            raise ValueError(f"q_start has {count(q_start.shape[0], 'entry', 'entries')} but seg_lens has "
                             f"{count(lens.shape[0], 'row')}")
    if topology.uses_bits:
        return MaskInfo.from_topology(topology, lens, seq_q, seq_k, causal, q_start, window)
    return MaskInfo.from_segments(topology, lens, seq_q, seq_k, causal, q_start, window=window)


def clear_caches() -> None:
    """Forget every mask, topology, first-query position and launch plan the package keeps between calls, and the
    scratch memory of device-side descriptors: their device memory goes back to torch's allocator. Modules keep
    their own masks (``TritonMBSAttnKernel``); those go with the module. Call it after the last use of the masks,
    e.g. between phases with different lengths, or to measure a cold start."""
    CACHE.clear()
    plan_attention.cache_clear()
    clear_scratch()


def _as_topology(topology: Any, key: Any = None) -> Topology:
    """The validated Topology of a user's matrix; list/tuple matrices are validated once and kept (with their
    per-device bit tables), so that a call with a new length tensor builds only the lengths' part. ``key``: the
    matrix's :func:`_topology_key`, when the caller has it already."""
    key = _topology_key(topology) if key is None else key
    if isinstance(key, Topology):
        return key
    # Traced: built in the graph, and the cache is not read either (a guard on its entries would recompile the graph
    # whenever an eager call reorders or adds them); a kept topology would hold the graph's tensors.
    if torch.compiler.is_compiling():
        return Topology(topology)
    topo = CACHE.value(("topology", key))
    if topo is None:
        topo = CACHE.store_value(("topology", key), Topology(topology))
    return topo


def _topology_key(topology: Any) -> Any:
    """A cache key for a topology that costs less than validating it: nested lists/tuples are keyed by their whole
    value (:func:`mmsparse.mask.keys.value_key`), so the steady state of a call with host lengths builds nothing."""
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (list, tuple)):
        key = value_key(topology)
        if key is not None:
            return ("value", key)
    return Topology(topology)  # tensors, arrays, rows without a key: validated and hashed by value


def _dense_info(attn_mask: Any, batch: int, seq_q: int, seq_k: int, causal: bool, device: torch.device,
                window: int | None = None) -> MaskInfo:
    """MaskInfo of a user's bool mask: ``[Sq or S, S]``, ``[B, Sq or S, S]`` or SDPA's ``[B, 1, Sq or S, S]``, with
    B = 1 or the batch; a query dim of 1 (a key padding mask) is broadcast over the queries. ``window``: checked
    (:func:`check_window`), AND-ed with the mask."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a bool torch.Tensor (True = may attend); got {type(attn_mask).__name__}")
    if attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask has dtype {attn_mask.dtype}: additive float masks are not supported, only bool masks "
            "(True = may attend). A float mask of 0 (attend) and -inf (masked) converts with attn_mask == 0; other "
            "additive biases cannot be expressed"
        )
    if attn_mask.dtype != torch.bool:
        raise TypeError(
            f"attn_mask must be a bool tensor (True = may attend); got dtype {attn_mask.dtype} (for a 0/1 mask pass "
            "attn_mask.bool())"
        )
    shape = tuple(attn_mask.shape)
    rows_ok = (1, seq_q, seq_k)
    m = None
    if attn_mask.dim() == 2:
        m = attn_mask[None]
    elif attn_mask.dim() == 3:
        m = attn_mask
    elif attn_mask.dim() == 4:
        if shape[1] != 1 and shape[0] in (1, batch) and shape[2] in rows_ok and shape[3] == seq_k:
            raise ValueError(
                f"attn_mask has shape {shape}: a mask per head ({shape[1]} heads) is not supported. One mask per "
                "sample is, shared by all heads: [B, 1, Sq, S] as SDPA takes it, [B, Sq, S] or [Sq, S]"
            )
        m = attn_mask[:, 0] if shape[1] == 1 else None
    if m is None or m.shape[0] not in (1, batch) or m.shape[1] not in rows_ok or m.shape[2] != seq_k:
        raise ValueError(f"attn_mask has shape {shape}; {_mask_shapes(batch, seq_q, seq_k)}")
    if m.shape[1] == 1 and seq_q != 1:
        m = m.expand(-1, seq_q, -1)  # a key padding mask: the same keys for every query
    m = m[:, m.shape[1] - seq_q :]  # the query rows: the last Sq positions
    return MaskInfo.from_dense(m.to(device), causal, window)


def _mask_shapes(batch: int, seq_q: int, seq_k: int) -> str:
    """The attn_mask shapes accepted for these sizes, in words."""
    rows = str(seq_q) if seq_q == seq_k else f"{seq_q} or {seq_k}"
    b = "1" if batch == 1 else f"1 or {batch}"
    last = "" if seq_q == seq_k else f" (with {seq_k} rows, the last {seq_q} are the queries')"
    return (f"expected a bool mask of queries x keys: [{rows}, {seq_k}]{last}, [B, {rows}, {seq_k}] or SDPA's "
            f"[B, 1, {rows}, {seq_k}], with B = {b}; a query dim of 1 broadcasts over the queries")


def new_dropout_seed(device: torch.device) -> torch.Tensor:
    """The kernels' int64 ``[3]`` dropout seed: a key over the full 64 bits (Philox's), from torch's default
    generator of the device (torch.manual_seed reproduces it; two calls share a dropout mask with odds 2^-64, not
    2^-30), then the query and key position offsets, 0 for a call over the whole sequence."""
    return torch.cat([torch.randint(-(2**63), 2**63 - 1, (1,), device=device, dtype=torch.int64),
                      torch.zeros(2, device=device, dtype=torch.int64)])


def attention_with_info(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float | None,
    dropout_p: float, deterministic: bool | None = None,
) -> torch.Tensor:
    """Run the kernels on checked inputs with prepared metadata (used by the module and the functional API).
    ``deterministic``: the backward (None: ``use_config``'s). This thread's ``use_config`` settings are read here,
    once, and the backward runs with them."""
    dropout_p = check_dropout(dropout_p, "dropout_p")
    scale = check_softmax_scale(softmax_scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    deterministic = check_deterministic(deterministic)
    settings = current_settings()
    deterministic = settings.deterministic if deterministic is None else deterministic
    if q.numel() == 0 or k.shape[2] == 0:
        # Nothing to attend (Sq <= Sk, so the output is empty): zeros tied to q, k and v alike, whose gradients
        # are then zeros of their shapes rather than absent (autograd.grad refuses an input not in the graph).
        return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())
    seed = new_dropout_seed(q.device) if dropout_p > 0 else None
    return MBSAttentionFunction.apply(q, k, v, info, scale, dropout_p, seed, deterministic, settings)


def mbs_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topology: Any = None,
    seg_lens: SegLensArg | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    check_lengths: bool = True,
    q_start: torch.Tensor | Sequence[int] | None = None,
    window: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Block-sparse multimodal attention.

    Args:
        q: ``[B, Hq, Sq, D]``; the queries are the last Sq of the S key positions.
        k, v: ``[B, Hkv, S, D]``, Hq a multiple of Hkv; fp16, bf16 or fp32; D a multiple of 8 in [16, 256].
        topology: k x k pair types: ``topology[r][c]`` says how the queries of segment r see the keys of
            segment c: ``NONE`` (0, not at all), ``FULL`` (1, every key) or ``CAUSAL`` (2, the keys at or before
            the query's position). Any number of segments (up to 4095); nested lists/tuples, a tensor or a
            :class:`~mmsparse.Topology` (build one once for hundreds of segments). Give either a topology with
            seg_lens, or attn_mask.
        seg_lens: k lengths summing to S, or per-sample ``[B, k]`` (list of B tuples or an int tensor), each row
            summing to at most S; the rest of a row is padding (never attended; its queries output 0).
        causal: also require key position <= query position.
        dropout_p: attention dropout probability (pass 0.0 in eval mode).
        softmax_scale: default ``1/sqrt(D)``.
        attn_mask: a bool mask (True = may attend) *instead of* a topology: ``[Sq, S]`` (or ``[S, S]``),
            ``[B, Sq, S]`` or SDPA's ``[B, 1, Sq, S]``, B being 1 or the batch; a query dim of 1 broadcasts.
            Per-head masks and additive float masks are not supported.
        check_lengths: validate a device tensor of lengths (reads it back: a host sync). Pass False in a
            training loop that feeds device lengths every step; nothing is checked under torch.compile or
            CUDA-graph capture either.
        q_start: optional int ``[B]``: the position of each sample's first query, e.g. each cache's length
            when decoding over caches of different lengths (default: the last Sq positions, ``S - Sq``).
        window: a sliding window: a key is kept only when its position is past the query's minus ``window``
            (None: no window).
        deterministic: the backward. True: two passes (dK/dV, then dQ), bitwise repeatable. False: allows one
            pass that adds dQ into a float32 ``[B, Hq, Sq, D]`` buffer by atomic adds (5 matmuls per tile pair
            instead of 7; dQ's last bits vary from run to run), run below ``one_pass_max_keys`` keys (2048), where
            it was measured faster; longer calls keep the two passes. None (default):
            ``mmsparse.use_config(deterministic=...)``'s setting, True unless changed; an argument given here wins.

    Returns:
        ``[B, Hq, Sq, D]`` in q's dtype.
    """
    check_qkv(q, k, v)
    seq_q, seq_k = q.shape[2], k.shape[2]
    if attn_mask is not None:
        if topology is not None or seg_lens is not None:
            raise ValueError(
                "pass either a topology with seg_lens, or attn_mask, not both: attn_mask replaces the topology"
            )
        if q_start is not None:
            raise ValueError("q_start goes with a topology; with attn_mask the mask's rows place the queries")
        info = _dense_info(attn_mask, q.shape[0], seq_q, seq_k, check_flag("causal", causal), q.device,
                           check_window(window, seq_k))
    elif topology is None:
        raise ValueError("mbs_attention needs a topology with seg_lens, or attn_mask (a bool [S, S] mask)")
    else:
        info = topology_mask(q, k, topology, seg_lens, causal, check_lengths, q_start, window)
    return attention_with_info(q, k, v, info, softmax_scale, dropout_p, deterministic)


def topology_mask(
    q: torch.Tensor, k: torch.Tensor, topology: Any, seg_lens: SegLensArg, causal: bool, check_lengths: bool = True,
    q_start: torch.Tensor | Sequence[int] | None = None, window: int | None = None,
) -> MaskInfo:
    """The mask of a topology and lengths for checked q ``[B, Hq, Sq, D]`` and k ``[B, Hkv, S, D]`` (cached as
    :func:`build_mask_info` caches). A length error says so when k looks like ``[B, S, H, D]``; a mask with one row
    per sample must have as many rows as q has samples."""
    try:
        info = build_mask_info(topology, seg_lens, q.shape[2], k.shape[2], causal, q.device, check_lengths, q_start,
                               window=window)
    except ValueError as e:  # checked only on failure: the common path pays nothing for the hint
        hint = layout_hint(k, seg_lens)
        if hint is None:
            raise
        raise ValueError(f"{e}. {hint}") from None
    if info.batch not in (1, q.shape[0]):
        raise ValueError(f"per-sample seg_lens has {count(info.batch, 'row')} but the batch has "
                         f"{count(q.shape[0], 'sample')}")
    return info


def mbs_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topology: Any,
    seg_lens: SegLensArg,
    causal: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    check_lengths: bool = True,
    window: int | None = None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Packed ("varlen") batches: samples laid end to end along one sequence, no padding, any number of them.

    Sample n owns the next ``sum(seg_lens[n])`` positions; its tokens attend per the topology within the
    sample only, so the tiles between samples are skipped like any other empty tile.

    Args:
        q: ``[1, Hq, total, D]``, or flash-attn's ``[total, Hq, D]`` (used as a strided view, no copy);
            k, v: the same layout with Hkv heads.
        topology: k x k pair types (0/1/2) shared by the samples.
        seg_lens: ``[N, k]`` per-sample lengths (list of N rows or an int tensor, e.g. on the GPU), summing to
            ``total``; zero-length segments are fine.
        causal: causal within each sample (positions are the packed ones, so this is per-sample causal).
        check_lengths: validate a device tensor of lengths (one host sync). Host lengths (lists) are validated
            once and the mask is cached by value, as in :func:`mbs_attention`; a tensor builds it every call.
        window: a sliding window, as in :func:`mbs_attention` (positions are the packed ones; samples never see
            each other anyway).
        deterministic: the backward, as in :func:`mbs_attention` (False: one pass, dQ by atomic adds).

    Returns:
        q's layout: ``[1, Hq, total, D]`` or ``[total, Hq, D]``.
    """
    flash_layout = q.dim() == 3
    if flash_layout:
        if k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                f"q is [total, H, D] (flash-attn's packed layout) but k/v have shapes {tuple(k.shape)} and "
                f"{tuple(v.shape)}: give all three as [total, H, D], or all as [1, H, total, D]"
            )
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
    check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    if q.shape[0] != 1:
        raise ValueError(f"packed q/k/v have batch size 1 (samples laid end to end); got {q.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError("packed attention needs q and k/v over the same positions")
    total = k.shape[2]
    info = build_mask_info(topology, seg_lens, total, total, causal, q.device, check_lengths, packed=True,
                           window=window)
    out = attention_with_info(q, k, v, info, softmax_scale, dropout_p, deterministic)
    return out[0].permute(1, 0, 2) if flash_layout else out
