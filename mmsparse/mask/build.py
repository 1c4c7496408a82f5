"""The mask of a call: a topology and lengths (cached by value when the lengths are on the host) or a user's bool
mask, validated and built into a :class:`MaskInfo`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..checks import check_device, check_flag, check_no_function_transform, check_window, count, layout_hint
from .cache import CACHE
from .info import MaskInfo
from .keys import value_key
from .lengths import SegLensArg, lens_tensor, packed_lens_tensor, q_start_tensor, seg_lens_argument
from .prepared import PreparedMask
from .topology import Topology


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
    (:func:`check_window`). Every entry point's lengths come through here (:func:`seg_lens_argument` refuses what
    cannot be lengths); a :class:`PreparedMask` in their place is checked against the call and used as it is."""
    if isinstance(seg_lens, PreparedMask):
        return seg_lens.for_call(topology_of(topology), seq_q, seq_k, causal, device, q_start, packed, window)
    seg_lens = seg_lens_argument(seg_lens, device=device)
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
    info = make_mask_info(topology_of(topology, topo_key), seg_lens, seq_q, seq_k, causal, device, check_lengths,
                          q_start, packed, window)
    if torch.compiler.is_compiling() and q_start is None:  # traced: the lists ops may read kept lists
        rows = topo_key.rows if isinstance(topo_key, Topology) else topo_key[1] if topo_key[0] == "value" else None
        info.host_values = host_values_key(rows, seg_lens, seq_q, seq_k, causal, packed, window)
    return info if key is None else CACHE.store_mask(key, info)


# Past this many ints (a topology of 60 segments) a key costs more host time per step than building the lists in the
# graph, and makes every traced op's argument that long.
MAX_KEY_INTS = 4096


def host_values_key(rows: Any, seg_lens: Any, seq_q: int, seq_k: int, causal: bool, packed: bool,
                    window: int | None) -> list[int] | None:
    """The values a mask is built from, as flat ints (``mmsparse.mask.kept`` reads them), where they are all host
    values: ``rows`` the topology's pair types, ``seg_lens`` a row of lengths or rows of them. None otherwise (a
    length tensor, a traced topology tensor, or more than :data:`MAX_KEY_INTS` ints)."""
    if not _int_rows(rows) or not isinstance(seg_lens, (list, tuple)) or len(seg_lens) == 0:
        return None
    nested = isinstance(seg_lens[0], (list, tuple))
    lens = seg_lens if nested else [seg_lens]
    if not _int_rows(lens) or len(rows) * (len(rows) + len(lens)) > MAX_KEY_INTS:
        return None
    return [len(rows), *(v for row in rows for v in row), int(nested), len(lens), *(n for row in lens for n in row),
            seq_q, seq_k, int(causal), int(packed), -1 if window is None else window]


def _int_rows(rows: Any) -> bool:
    """Rows of ints (a graph's int symbols pass too: Dynamo reads them as ints)."""
    return isinstance(rows, (list, tuple)) and all(
        isinstance(row, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in row)
        for row in rows)


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


def topology_of(topology: Any, key: Any = None) -> Topology:
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


def dense_mask_info(attn_mask: Any, batch: int, seq_q: int, seq_k: int, causal: bool, device: torch.device,
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
        raise ValueError(f"attn_mask has shape {shape}; {accepted_mask_shapes(batch, seq_q, seq_k)}")
    if m.shape[1] == 1 and seq_q != 1:
        m = m.expand(-1, seq_q, -1)  # a key padding mask: the same keys for every query
    m = m[:, m.shape[1] - seq_q :]  # the query rows: the last Sq positions
    return MaskInfo.from_dense(m.to(device), causal, window)


def accepted_mask_shapes(batch: int, seq_q: int, seq_k: int) -> str:
    """The attn_mask shapes accepted for these sizes, in words."""
    rows = str(seq_q) if seq_q == seq_k else f"{seq_q} or {seq_k}"
    b = "1" if batch == 1 else f"1 or {batch}"
    last = "" if seq_q == seq_k else f" (with {seq_k} rows, the last {seq_q} are the queries')"
    return (f"expected a bool mask of queries x keys: [{rows}, {seq_k}]{last}, [B, {rows}, {seq_k}] or SDPA's "
            f"[B, 1, {rows}, {seq_k}], with B = {b}; a query dim of 1 broadcasts over the queries")


def topology_mask(
    q: torch.Tensor, k: torch.Tensor, topology: Any, seg_lens: SegLensArg, causal: bool, check_lengths: bool = True,
    q_start: torch.Tensor | Sequence[int] | None = None, window: int | None = None,
) -> MaskInfo:
    """The mask of a topology and lengths for checked q ``[B, Hq, Sq, D]`` and k ``[B, Hkv, S, D]`` (cached as
    :func:`build_mask_info` caches). A length error says so when k looks like ``[B, S, H, D]``; a mask with one row
    per sample must have as many rows as q has samples."""
    if not isinstance(seg_lens, PreparedMask):  # here too: a generator is read once, for the hint too
        seg_lens = seg_lens_argument(seg_lens, device=q.device)
    try:
        info = build_mask_info(topology, seg_lens, q.shape[2], k.shape[2], causal, q.device, check_lengths, q_start,
                               window=window)
    except ValueError as e:  # checked only on failure: the common path pays nothing for the hint
        hint = None if isinstance(seg_lens, PreparedMask) else layout_hint(k, seg_lens)
        if hint is None:
            raise
        raise ValueError(f"{e}. {hint}") from None
    if info.batch not in (1, q.shape[0]):
        # the mask has a row per sample of the lengths or of q_start (checked against each other already)
        rows = (f"q_start has {count(info.batch, 'entry', 'entries')}" if q_start is not None and
                len(q_start) == info.batch else f"per-sample seg_lens has {count(info.batch, 'row')}")
        raise ValueError(f"{rows} but the batch has {count(q.shape[0], 'sample')}")
    return info


def prepare_mask(
    topology: Any, seg_lens: SegLensArg, seq_len: int, *, q_len: int | None = None, causal: bool = False,
    window: int | None = None, q_start: torch.Tensor | Sequence[int] | None = None, packed: bool = False,
    device: torch.device | str | None = None, check_lengths: bool = True,
) -> PreparedMask:
    """Build a mask once, for every call that passes it as ``seg_lens`` (every layer of a step).

    Args:
        topology: k x k pair types, in any form :func:`mmsparse.mbs_attention` takes.
        seg_lens: lengths in any form :func:`mmsparse.mbs_attention` takes (``[N, k]`` packed samples with
            ``packed=True``); typically a device tensor, new each step.
        seq_len: the key positions S (k/v's dim 2; the packed total with ``packed=True``).
        q_len: the queries (q's dim 2, the last ``q_len`` positions unless ``q_start``); default ``seq_len``.
        causal, window, q_start: as :func:`mmsparse.mbs_attention`'s; the calls must pass the same causal and
            window (checked) and no q_start.
        packed: the lengths are ``[N, k]`` samples laid end to end, for :func:`mmsparse.mbs_attention_varlen`.
        device: where the calls' tensors are (default: a length tensor's device, else the current CUDA device, else
            the CPU).
        check_lengths: validate a device tensor of lengths (one host sync), as the calls would.

    Returns:
        :class:`PreparedMask`.
    """
    if torch.compiler.is_compiling():
        raise ValueError("prepare_mask is for eager calls: under torch.compile pass the lengths to the calls")
    check_no_function_transform()
    q_len = seq_len if q_len is None else q_len
    for name, value in (("seq_len", seq_len), ("q_len", q_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (positions); got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be positive; got {value}")
    if q_len > seq_len or (packed and q_len != seq_len):
        raise ValueError(f"q_len ({q_len}) must be at most seq_len ({seq_len}), and equal to it with packed=True")
    if device is None:
        device = (seg_lens.device if isinstance(seg_lens, torch.Tensor) and seg_lens.device.type != "cpu"
                  else torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
    device = check_device(device)
    causal, packed = check_flag("causal", causal), check_flag("packed", packed)
    if isinstance(seg_lens, PreparedMask):
        raise TypeError("seg_lens is a prepared mask already: pass it to the calls")
    topo = topology_of(topology)
    info = build_mask_info(topo, seg_lens, q_len, seq_len, causal, device, check_lengths, q_start, packed=packed,
                           window=window)
    return PreparedMask(info, topo, packed)
