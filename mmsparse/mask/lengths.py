"""Segment lengths and query positions: parsing, validation and clipping, in one place.

A sample's layout is k segment lengths (one per topology segment); a batch gives one row shared by every sample
or one row per sample (``[B, k]``), a row summing to less than the sequence being padded at its end. ``q_start``
places each sample's first query (decoding over caches of different lengths).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any, Union

import torch

from .segment_codes import MAX_DOCS
from .traced_ints import traced_int_row

SegLens = Union[Sequence[int], torch.Tensor]  # one sample's k lengths
SegLensArg = Union[Sequence[int], Sequence[Sequence[int]], torch.Tensor]  # shared k lengths, or per sample [B, k]


def is_array(value: Any) -> bool:
    """A numpy array (or alike: dtype with a kind, shape, ndim and tolist), not imported here."""
    dtype = getattr(value, "dtype", None)
    return (hasattr(dtype, "kind") and hasattr(dtype, "str") and hasattr(value, "ndim")
            and hasattr(value, "tolist"))


# What a seg_lens argument may be, for messages.
SEG_LENS_FORMS = ("k segment lengths (a list or tuple of k ints, one per segment), per-sample [B, k] rows, or an "
                  "integer tensor of either shape")


def seg_lens_argument(seg_lens: Any, name: str = "seg_lens", device: torch.device | None = None) -> Any:
    """The lengths argument of an entry point, refused with a TypeError/ValueError that says what it must be
    (:data:`SEG_LENS_FORMS`) when it cannot be lengths, else in a form this module's checks read: lists and tuples as
    they are; a generator or other iterator read once, into a tuple; a numpy array, or rows given as 1-D tensors or
    arrays, as lists of ints; a tensor as it is, if on the CPU or on ``device`` (q's) (a meta tensor has no values
    to read). None passes (the callers say it is required). ``name``: how messages call it."""
    # isinstance before getattr and hasattr, which Dynamo cannot call on a symbolic int
    kind = type(seg_lens)
    if kind is list or kind is tuple:  # the common case first: a call's host lengths
        first = seg_lens[0] if seg_lens else None
        if first is None or isinstance(first, (int, torch.SymInt, list, tuple)):
            return seg_lens
        if (isinstance(first, torch.Tensor) and first.dim() == 1) or (is_array(first) and first.ndim == 1):
            return [r.tolist() if isinstance(r, torch.Tensor) or is_array(r) else r for r in seg_lens]
        return seg_lens
    if seg_lens is None:
        return None
    if isinstance(seg_lens, (int, float, torch.SymInt)):  # before is_array's getattr
        raise _not_lengths(seg_lens, name)
    if isinstance(seg_lens, torch.Tensor):
        allowed = ("cpu", device.type) if device is not None else ("cpu", "cuda")
        if seg_lens.device.type not in allowed:
            where = f"on the CPU or on q's device ({device})" if device is not None else "on the CPU or a GPU"
            raise ValueError(f"{name} is a tensor on the {seg_lens.device} device; lengths must be {where}, where "
                             "their values can be read")
        return seg_lens
    array = is_array(seg_lens)
    if array and seg_lens.ndim > 0:
        return seg_lens.tolist()
    if array or isinstance(seg_lens, (str, bytes, bytearray, Mapping, Set)) or not isinstance(seg_lens, Iterable):
        raise _not_lengths(seg_lens, name)
    return seg_lens if isinstance(seg_lens, Sequence) else tuple(seg_lens)


def _not_lengths(seg_lens: Any, name: str) -> TypeError:
    """The error of a value that is no lengths, with the forms they take and, for one int, the list it meant."""
    got = type(seg_lens).__name__
    if torch.compiler.is_compiling():  # Dynamo cannot format a symbolic int into a string
        return TypeError(f"{name} must be {SEG_LENS_FORMS}; got {got}")
    hint = ""
    if isinstance(seg_lens, (Mapping, Set)):
        hint = " (an unordered collection: list the lengths in segment order)"
    elif not isinstance(seg_lens, bool):
        try:
            n = operator.index(seg_lens)
            hint = f" (one segment of {n} tokens is [{n}])"
        except TypeError:
            pass
    return TypeError(f"{name} must be {SEG_LENS_FORMS}; got {got} {seg_lens!r}{hint}")


def tracing_or_capturing(t: torch.Tensor) -> bool:
    """Whether reading ``t`` back to the host is impossible now: under torch.compile the lengths are symbolic, and
    a host read during CUDA-graph capture would break the capture. Lengths then go unchecked."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def validate_seg_lens(seg_lens: SegLens, num_segments: int, name: str = "seg_lens") -> tuple[int, ...]:
    """Check one sample's segment lengths (host ints) against the topology size; return them as a tuple.

    ``name`` is how messages call them: ``seg_lens[3]`` names row 3 of per-sample or packed lengths. Under
    torch.compile an entry may be symbolic (an int argument that changed between calls, which Dynamo passes as an
    int): the checks compare it, which guards its range, not its value, and it is returned as it is, so that one
    graph serves every length.
    """
    seg_lens = seg_lens_argument(seg_lens, name)
    if isinstance(seg_lens, torch.Tensor):
        if seg_lens.dim() != 1:
            raise ValueError(f"{name} must be 1-D here (one length per segment); got shape {tuple(seg_lens.shape)}")
        if seg_lens.is_floating_point():
            raise TypeError(f"{name} must hold integers; got dtype {seg_lens.dtype}")
        seg_lens = seg_lens.tolist()
    try:
        lens = tuple(seg_lens)
    except TypeError as e:
        raise ValueError(f"{name} must be a sequence of {num_segments} non-negative ints; got {seg_lens!r}") from e
    if len(lens) != num_segments:
        raise ValueError(
            f"topology has {num_segments} segments but {name} has {len(lens)} entries ({lens}); give one length "
            "per segment, 0 for a segment absent from the sample"
        )
    checked = []
    for i, n in enumerate(lens):
        # isinstance first: Dynamo cannot call hasattr on a symbolic int
        if isinstance(n, bool) or not (isinstance(n, (int, torch.SymInt)) or hasattr(n, "__index__")):
            raise TypeError(f"{name}[{i}] must be an int; got {type(n).__name__} {n!r}")
        n = n if isinstance(n, (int, torch.SymInt)) else int(n)  # numpy ints and other __index__ types
        if n < 0:
            # Dynamo cannot format a symbolic int into a string: traced messages leave the values out
            shown = "" if torch.compiler.is_compiling() else f" = {n}"
            raise ValueError(f"{name}[{i}]{shown} is negative; segment lengths must be >= 0")
        checked.append(n)
    return tuple(checked)


def unread_row(seg_lens: torch.Tensor, num_segments: int) -> torch.Tensor:
    """A 1-D length tensor that is not read back (``check_lengths=False``, traced, or captured in a CUDA graph) as a
    ``[1, k]`` view: its shape and dtype checked, its values not (as a ``[B, k]`` tensor's are not then)."""
    if seg_lens.dim() != 1 or seg_lens.shape[0] != num_segments:
        raise ValueError(f"seg_lens must be {num_segments} lengths (one per segment) or per-sample [batch, "
                         f"{num_segments}]; got shape {tuple(seg_lens.shape)}")
    if seg_lens.is_floating_point() or seg_lens.dtype == torch.bool:
        raise TypeError(f"seg_lens must be an integer tensor; got {seg_lens.dtype}")
    return seg_lens[None]


def is_per_sample(seg_lens: SegLensArg) -> bool:
    """Whether ``seg_lens`` gives one row per sample (``[B, k]``) rather than one row shared by the batch."""
    if isinstance(seg_lens, torch.Tensor):
        return seg_lens.dim() == 2
    return len(seg_lens) > 0 and isinstance(seg_lens[0], Sequence)


def check_rows(rows: Sequence[Sequence[int]], num_segments: int, seq_len: int) -> list[tuple[int, ...]]:
    """Validate per-sample lengths (host ints, one row per sample), naming the row at fault."""
    checked = []
    for b, row in enumerate(rows):
        r = validate_seg_lens(row, num_segments, f"seg_lens[{b}]")
        if sum(r) > seq_len:
            if torch.compiler.is_compiling():  # no values: see validate_seg_lens
                raise ValueError(f"seg_lens[{b}] sums to more than the sequence length")
            raise ValueError(f"seg_lens[{b}] = {r} sums to {sum(r)}, more than the sequence length {seq_len}")
        checked.append(r)
    return checked


def lens_tensor(
    seg_lens: SegLensArg | None, num_segments: int, seq_len: int, device: torch.device, check_lengths: bool = True
) -> torch.Tensor:
    """Validate lengths; return an integer ``[Bm, k]`` tensor on device (int32 from host lengths, a tensor's own
    dtype otherwise). One list of k ints -> Bm = 1 (shared), and it must cover the sequence; a per-sample row may
    sum to less (padding at its end). ``check_lengths=False`` skips reading a device tensor back (no host sync)."""
    k = num_segments
    if seg_lens is None:
        raise ValueError(f"seg_lens is required with a topology: {k} lengths, or per-sample [batch, {k}]")
    if isinstance(seg_lens, torch.Tensor) and seg_lens.dim() not in (1, 2):
        raise ValueError(f"a seg_lens tensor must be {k} lengths or per-sample [batch, {k}]; got shape "
                         f"{tuple(seg_lens.shape)}")
    if isinstance(seg_lens, torch.Tensor) and seg_lens.dim() == 2:
        if seg_lens.is_floating_point() or seg_lens.dtype == torch.bool:
            raise TypeError(f"per-sample seg_lens must be an integer tensor; got {seg_lens.dtype}")
        if seg_lens.shape[1] != k:
            raise ValueError(f"per-sample seg_lens has shape {tuple(seg_lens.shape)}; expected [batch, {k}]")
        if check_lengths and not tracing_or_capturing(seg_lens):  # one read of the lengths: one host sync
            check_rows(seg_lens.tolist(), k, seq_len)
        return seg_lens.to(device)  # any integer dtype: the token bits read int32/int64 as they are, cast the rest
    if not is_per_sample(seg_lens):
        if isinstance(seg_lens, torch.Tensor) and (not check_lengths or tracing_or_capturing(seg_lens)):
            return unread_row(seg_lens, k).to(device)
        lens = validate_seg_lens(seg_lens, k)
        if sum(lens) != seq_len:
            fix = "the segments must cover the sequence (pass per-sample lengths [B, k] to pad a shorter sample)"
            if torch.compiler.is_compiling():  # no values: see validate_seg_lens
                raise ValueError(f"sum(seg_lens) differs from the positions of k/v; {fix}")
            raise ValueError(f"sum(seg_lens) = {sum(lens)} ({lens}) but k/v have {seq_len} positions; {fix}")
        if torch.compiler.is_compiling():  # equal lengths, equal graph nodes (one mask for every layer)
            return traced_int_row(lens, torch.int32, device)[None]
        return torch.tensor([lens], dtype=torch.int32, device=device)
    return torch.tensor(check_rows(seg_lens, k, seq_len), dtype=torch.int32, device=device)


def packed_lens_tensor(
    seg_lens: SegLensArg, num_segments: int, total: int, device: torch.device, check_lengths: bool = True
) -> torch.Tensor:
    """``[N, k]`` lengths of N packed samples as an integer tensor on device, checked (non-negative, summing to
    ``total``) unless ``check_lengths`` is False or they cannot be read back now (one host sync for a device
    tensor)."""
    k = num_segments
    if isinstance(seg_lens, torch.Tensor):
        if seg_lens.is_floating_point() or seg_lens.dtype == torch.bool:
            raise TypeError(f"packed seg_lens must be an integer tensor; got {seg_lens.dtype}")
        if seg_lens.dim() != 2 or seg_lens.shape[1] != k:
            raise ValueError(f"packed seg_lens must be [samples, {k}]; got shape {tuple(seg_lens.shape)}")
        lens = seg_lens
        if check_lengths and not tracing_or_capturing(lens):
            low, high = torch.aminmax(lens) if lens.numel() else (lens.new_zeros(()), lens.new_zeros(()))
            stats = torch.stack([low.to(torch.int64), lens.sum(dtype=torch.int64)]).tolist()  # one read
            if stats[0] < 0:
                bad = (lens < 0).nonzero()[0].tolist()
                raise ValueError(f"packed seg_lens[{bad[0]}][{bad[1]}] is negative; segment lengths must be >= 0")
            if stats[1] != total:
                raise ValueError(f"packed lengths sum to {stats[1]} but q/k/v have {total} positions")
    else:
        if len(seg_lens) == 0 or not isinstance(seg_lens[0], Sequence):
            raise ValueError(f"packed seg_lens must be [samples, {k}] (one row of {k} lengths per sample)")
        rows = [validate_seg_lens(r, k, f"seg_lens[{n}]") for n, r in enumerate(seg_lens)]  # name the sample
        if sum(map(sum, rows)) != total:
            if torch.compiler.is_compiling():  # no values: see validate_seg_lens
                raise ValueError("packed lengths do not sum to the q/k/v positions")
            raise ValueError(f"packed lengths sum to {sum(map(sum, rows))} but q/k/v have {total} positions")
        lens = torch.tensor(rows, dtype=torch.int32)
    if lens.shape[0] > MAX_DOCS:
        raise ValueError(f"{lens.shape[0]} samples in one pack; at most {MAX_DOCS} are supported: split the pack")
    return lens.to(device)


def q_start_tensor(
    q_start: torch.Tensor | Sequence[int], seq_q: int, seq_k: int, device: torch.device, check: bool = True
) -> torch.Tensor:
    """int32 ``[B]`` on device: the position of each sample's first query, checked to keep every query inside
    0..seq_k - 1 (unless ``check`` is False or the values cannot be read back now)."""
    t = torch.as_tensor(q_start)
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"q_start must be a 1-D integer tensor or list [batch]; got {q_start!r}")
    if check and not tracing_or_capturing(t) and bool(((t < 0) | (t + seq_q > seq_k)).any()):
        raise ValueError(f"q_start {t.tolist()} must keep every query inside 0..{seq_k - 1} (q_len {seq_q})")
    return t.to(device=device, dtype=torch.int32)


def clip_seg_lens(seg_lens: SegLensArg, valid_lens: torch.Tensor) -> torch.Tensor:
    """Per-sample segment lengths truncated to each sample's number of valid (non-padding) tokens.

    Tokens past ``valid_lens[b]`` become padding: the segments are cut at that point, in order.

    Args:
        seg_lens: k lengths, or per-sample ``[B, k]`` lengths.
        valid_lens: int ``[B]``, valid tokens per sample (a right-padded batch).

    Returns:
        int64 ``[B, k]`` on valid_lens' device.
    """
    lens = torch.as_tensor(seg_lens, dtype=torch.int64, device=valid_lens.device)
    lens = lens.expand(valid_lens.shape[0], -1) if lens.dim() == 1 else lens
    ends = torch.minimum(lens.cumsum(-1), valid_lens.to(torch.int64)[:, None])
    return torch.diff(ends, dim=-1, prepend=torch.zeros_like(ends[:, :1]))


def valid_lens_from_padding(keep: torch.Tensor) -> torch.Tensor:
    """Number of valid tokens per sample from a right-padding mask, checking that it is one.

    Args:
        keep: bool ``[B, S]``, True for real tokens; each row must be True then False (padding at the end only).

    Returns:
        int64 ``[B]``.
    """
    n = keep.sum(-1)
    expected = torch.arange(keep.shape[-1], device=keep.device)[None, :] < n[:, None]
    if not torch.equal(keep, expected):
        raise ValueError(
            "mmsparse supports padding at the end of a sample only (right padding); this padding mask has padding "
            "before real tokens (left padding?). Right-pad the batch, or pass per-sample seg_lens instead"
        )
    return n
