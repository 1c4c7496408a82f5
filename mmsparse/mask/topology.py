"""Segment topology: which segment of a multimodal sequence may attend to which, and how.

A topology is a k x k matrix of pair types: ``topology[r][c]`` says how the rows (queries) of segment r see the
columns (keys) of segment c: :data:`NONE` (0), :data:`FULL` (1, every key of c) or :data:`CAUSAL` (2, the keys of
c at or before the query's own position). Together with k segment lengths it defines the token-level
"interlaced" mask. The seed's 0/1 matrices are the topologies without causal pairs.

The kernels never see an S x S mask. For 0/1 topologies of at most 32 segments they see two int32 vectors of
length S:
  - ``row_bits[i]``: bit c set when query token i may see segment c (the topology row of its segment);
  - ``col_bits[j]``: ``1 << seg(j)``, the one-hot bit of key token j's segment.
A pair is allowed when ``row_bits[i] & col_bits[j] != 0``. Padding tokens get 0 in both, so a padded query
sees nothing and a padded key is seen by nobody. Every other mask (causal pairs, more segments, packed
samples) goes by segment codes and the pair table: see :mod:`mmsparse.mask.segment_codes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..kernels.constants import CAUSAL, FULL, NONE
from ..runtime.capture import keep_while_captured
from .lengths import SegLens, validate_seg_lens
from .traced_ints import MAX_POINTWISE_VALUES, traced_int_row

__all__ = [  # validate_seg_lens and SegLens live in mmsparse.mask.lengths; importing them from here still works
    "CAUSAL", "FULL", "MAX_BIT_SEGMENTS", "MAX_SEGMENTS", "NONE", "SegLens", "Topology", "count_allowed_pairs",
    "generate_interlaced_mask", "lookup_pairs", "segment_ids", "token_bits_torch", "validate_seg_lens",
]

MAX_BIT_SEGMENTS = 32  # the bit vectors of the 0/1 fast path are int32
MAX_SEGMENTS = 4095  # segment codes keep the segment in 12 bits, with one value left for padding


_ROWS_KEPT_MAX = 64


def _to_int32_bits(value: int) -> int:
    """Two's-complement view of a 32-bit pattern, so that bit 31 fits an int32 tensor."""
    return value - (1 << 32) if value >= (1 << 31) else value


class Topology:
    """A validated k x k segment topology (1 <= k <= 4095), with optional segment names.

    Args:
        matrix: k x k of pair types :data:`NONE`/:data:`FULL`/:data:`CAUSAL` (0/1/2) or bool, as nested
            lists/tuples, a numpy array or a torch tensor.
        names: optional k segment names, e.g. ``("text", "vision", "audio")``.

    Attributes:
        types: int8 ``[k, k]`` pair types.
        matrix: bool ``[k, k]``, ``types != NONE``: which segment sees which at all.
        rows: the pair types as nested tuples of ints, up to 64 segments (else None, as for a traced tensor).
        has_causal_pairs: whether some pair is CAUSAL; None for a tensor traced by torch.compile, whose values are
            unknown until the graph runs (checked there).
    """

    def __init__(self, matrix: Any, names: Sequence[str] | None = None) -> None:
        if isinstance(matrix, Topology):
            names = names if names is not None else matrix.names
            self.types, self.matrix, self.has_causal_pairs = matrix.types, matrix.matrix, matrix.has_causal_pairs
            self._row_bits, self._col_bits = matrix._row_bits, matrix._col_bits
            self.rows = matrix.rows
        else:
            rows = _python_rows(matrix)
            if rows is not None:  # validated in Python: under torch.compile a list is a constant, not a tensor
                self.types = torch.tensor(rows, dtype=torch.int8)
            elif isinstance(matrix, torch.Tensor) and torch.compiler.is_compiling():
                self.types = _traced_types(matrix)  # values unknown until the graph runs
            else:
                self.types = _validate_matrix(matrix)
                rows = self.types.tolist()
            self.matrix = self.types != NONE
            # None: a traced tensor's values are unknown, so its masks go by segment codes, which take any types.
            self.has_causal_pairs = None if rows is None else any(CAUSAL in row for row in rows)
            # The pair types as Python ints, for a small topology: a traced call keys its kept mask by them.
            small = rows is not None and len(rows) <= _ROWS_KEPT_MAX
            self.rows: tuple[tuple[int, ...], ...] | None = tuple(map(tuple, rows)) if small else None
            # Plain ints, computed once: torch.compile then sees constants rather than reading a tensor back.
            k = self.num_segments
            bits = rows is not None and self.uses_bits
            self._row_bits = [_to_int32_bits(sum(1 << c for c in range(k) if rows[r][c])) for r in range(k)] if (
                bits) else []
            self._col_bits = [_to_int32_bits(1 << c) for c in range(k)] if bits else []
        if names is not None:
            names = tuple(str(n) for n in names)
            if len(names) != self.num_segments:
                raise ValueError(f"topology has {self.num_segments} segments but {len(names)} names were given: "
                                 f"{names}")
        self.names = names
        self._hash: int | None = None  # by value, on first use
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pair_tables: dict[torch.device, torch.Tensor] = {}
        self._readers: dict[int, set[int]] = {}  # id of a kept table -> the CUDA streams it is recorded on

    def __getstate__(self) -> dict[str, Any]:
        # The per-device tables are caches; the hash of a large topology hashes bytes, which differs per process;
        # the readers are keyed by the ids of this object's tables, which a copy's new tables could reuse.
        state = self.__dict__.copy()
        for cache in ("_tables", "_pair_tables", "_hash", "_readers"):
            state.pop(cache, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tables, self._pair_tables, self._hash, self._readers = {}, {}, None, {}

    @property
    def num_segments(self) -> int:
        return self.types.shape[0]

    @property
    def uses_bits(self) -> bool:
        """Whether one sample's mask fits the bit vectors: 0/1 pairs and at most 32 segments."""
        return self.num_segments <= MAX_BIT_SEGMENTS and self.has_causal_pairs is False

    def pair_table(self, device: torch.device) -> torch.Tensor:
        """int8 ``[k + 1, k + 1]`` pair types on ``device``, with a last row and column of NONE for padding, kept
        per device (see :mod:`mmsparse.mask.segment_codes`)."""
        k = self.num_segments
        if torch.compiler.is_compiling() and self.rows is not None and (k + 1) ** 2 <= MAX_POINTWISE_VALUES:
            padded = [v for row in self.rows for v in (*row, NONE)] + [NONE] * (k + 1)
            return traced_int_row(padded, torch.int8, device).view(k + 1, k + 1)  # equal for equal topologies
        table = None if torch.compiler.is_compiling() else self._pair_tables.get(device)
        if table is None:
            table = torch.zeros((k + 1, k + 1), dtype=torch.int8, device=self.types.device)
            table[:k, :k] = self.types
            table = table.to(device)
            if not torch.compiler.is_compiling():  # the first one kept wins: one table per device, one readers set
                table = self._pair_tables.setdefault(device, table)
        if not torch.compiler.is_compiling():
            self._read_here(table)
        return table

    def _read_here(self, *tables: torch.Tensor) -> None:
        """The kept tables are about to be read on the current CUDA stream. Each was copied from the host before it
        was kept (a copy from pageable memory completes before ``to`` returns), so any stream may read it; but its
        memory belongs to the pool of the stream that made it. Recorded on every other stream that reads it, it
        does not go back to that pool, when this Topology is dropped, while those streams may still read it."""
        if tables[0].device.type != "cuda":
            return
        if torch.cuda.is_current_stream_capturing():  # read at every replay: kept as long as the graph
            keep_while_captured(tables[0].device, *tables)
            return
        stream = torch.cuda.current_stream(tables[0].device)
        for table in tables:
            readers = self._readers.get(id(table))
            if readers is None:  # the stream that made it
                self._readers[id(table)] = {stream.stream_id}
            elif stream.stream_id not in readers:
                table.record_stream(stream)
                readers.add(stream.stream_id)

    def row_bits(self) -> list[int]:
        """Per segment r, the int32 bit pattern of the segments its rows may see."""
        return list(self._row_bits)

    def col_bits(self) -> list[int]:
        """Per segment c, the one-hot int32 bit its keys carry."""
        return list(self._col_bits)

    def bit_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``[k + 1]`` row and column bits per segment index on ``device`` (index k: padding, 0). Kept per
        device, so that building metadata for new lengths copies nothing from the host (no sync)."""
        if torch.compiler.is_compiling():  # traced: made in the graph (equal for equal topologies), never cached
            return (traced_int_row([*self._row_bits, 0], torch.int32, device),
                    traced_int_row([*self._col_bits, 0], torch.int32, device))
        tables = self._tables.get(device)
        if tables is None:  # the first one kept wins: one pair per device, one readers set
            tables = self._tables.setdefault(device, (_bit_table(self._row_bits, device),
                                                      _bit_table(self._col_bits, device)))
        self._read_here(*tables)
        return tables

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and torch.equal(self.types, other.types)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = _hash_types(self.types)
        return self._hash

    def __repr__(self) -> str:
        rows = ", ".join(str([int(x) for x in r]) for r in self.types.tolist())
        names = f", names={self.names}" if self.names else ""
        return f"Topology([{rows}]{names})"


def _hash_types(types: torch.Tensor) -> int:
    """A hash of the pair types by value: of the rows as tuples, of the bytes past 64 segments."""
    return hash(types.numpy().tobytes()) if types.shape[0] > 64 else hash(tuple(map(tuple, types.tolist())))


_BAD_CONTAINER = "topology must be a k x k matrix of pair types 0/1/2 (nested lists, numpy or torch); got {!r}"
_BAD_SHAPE = "topology must be a square k x k matrix with k >= 1; got shape {}"
_TOO_MANY = (
    "topology has {} segments; at most {} are supported. Samples packed into one sequence share one topology: pass "
    "the packed lengths to mbs_attention_varlen instead of a block-diagonal topology"
)
_BAD_ENTRY = "topology entries must be 0 (none), 1 (full) or 2 (causal); topology[{}][{}] = {}"


def _python_rows(matrix: Any) -> list[list[int]] | None:
    """The pair types of nested lists/tuples of Python numbers, checked in Python (no tensor op, so nothing is
    data-dependent under torch.compile). None for anything else (tensors, arrays, rows of them)."""
    if not isinstance(matrix, (list, tuple)):
        return None
    if not all(isinstance(row, (list, tuple)) for row in matrix):
        return None
    if not all(type(x) in (int, bool, float) for row in matrix for x in row):
        return None
    k = len(matrix)
    if any(len(row) != len(matrix[0]) for row in matrix):
        raise ValueError(_BAD_CONTAINER.format(matrix))
    if k == 0 or len(matrix[0]) != k:
        raise ValueError(_BAD_SHAPE.format((k, len(matrix[0])) if k else (0,)))
    if k > MAX_SEGMENTS:
        raise ValueError(_TOO_MANY.format(k, MAX_SEGMENTS))
    for r, row in enumerate(matrix):
        for c, x in enumerate(row):
            if x not in (NONE, FULL, CAUSAL):
                raise ValueError(_BAD_ENTRY.format(r, c, x))
    return [[int(x) for x in row] for row in matrix]


def _traced_types(t: torch.Tensor) -> torch.Tensor:
    """The pair types of a tensor that torch.compile traces: the shape is checked now, the values when the graph
    runs (reading them now would be data-dependent)."""
    if t.dim() != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
        raise ValueError(_BAD_SHAPE.format(tuple(t.shape)))
    if t.shape[0] > MAX_SEGMENTS:
        raise ValueError(_TOO_MANY.format(t.shape[0], MAX_SEGMENTS))
    if t.dtype != torch.bool:
        ok = ((t == NONE) | (t == FULL) | (t == CAUSAL)).all()
        torch._assert_async(ok, "topology entries must be 0 (none), 1 (full) or 2 (causal)")
    return t.detach().to(torch.int8)


def _validate_matrix(matrix: Any) -> torch.Tensor:
    """The pair types of a user's matrix as int8 ``[k, k]``."""
    try:
        t = torch.as_tensor(matrix).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(_BAD_CONTAINER.format(matrix)) from e
    if t.dim() != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
        raise ValueError(_BAD_SHAPE.format(tuple(t.shape)))
    if t.shape[0] > MAX_SEGMENTS:
        raise ValueError(_TOO_MANY.format(t.shape[0], MAX_SEGMENTS))
    if t.dtype != torch.bool:
        bad = ~((t == NONE) | (t == FULL) | (t == CAUSAL))
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            raise ValueError(_BAD_ENTRY.format(r, c, t[r, c].item()))
    return t.to(torch.int8)


def generate_interlaced_mask(topology: Any, seg_lens: SegLens) -> torch.Tensor:
    """The dense token mask of a topology: ``mask[i, j]`` is True when query token i may attend key token j.

    It is S x S: meant for tests, pictures and the arbitrary-mask path. The attention path never builds it.

    Args:
        topology: k x k matrix of pair types (or a :class:`Topology`).
        seg_lens: k segment lengths, S = sum(seg_lens).

    Returns:
        BoolTensor ``[S, S]`` on the CPU.
    """
    topo = Topology(topology)
    lens = validate_seg_lens(seg_lens, topo.num_segments)
    seq = sum(lens)
    seg = segment_ids(torch.tensor([lens]), seq)
    pos = torch.arange(seq)
    return allowed_by_type(lookup_pairs(topo.types, seg, seg)[0], pos[:, None], pos[None, :])


def allowed_by_type(types: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Which pairs of pair types ``types`` are allowed for queries at ``q_pos`` and keys at ``k_pos``
    (broadcastable): FULL always, CAUSAL when the key is at or before the query, NONE never."""
    return (types == FULL) | ((types == CAUSAL) & (k_pos <= q_pos))


def lookup_pairs(table: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor) -> torch.Tensor:
    """``table[q_seg[b, i], k_seg[b, j]]`` as bool ``[B, Sq, Sk]``, with no S x S index temporaries (only the
    output itself is S x S)."""
    rows = table[q_seg]  # [B, Sq, C]
    index = k_seg[:, None, :].expand(-1, rows.shape[1], -1)  # a stride-0 view, not materialised
    return torch.gather(rows, 2, index)


def segment_ids(seg_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Token -> segment index for each sample.

    Args:
        seg_lens: int ``[B, k]`` lengths (on any device).
        seq_len: S, the padded length. Tokens past a sample's total length get index k (padding).

    Returns:
        int64 ``[B, S]`` on seg_lens' device.
    """
    ends = torch.cumsum(seg_lens.to(torch.int64), dim=-1)
    pos = torch.arange(seq_len, device=seg_lens.device, dtype=torch.int64)
    return torch.searchsorted(ends.contiguous(), pos.expand(seg_lens.shape[0], seq_len).contiguous(), right=True)


def token_bits_torch(topology: Topology, seg_lens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token row and column bit vectors (see the module docstring), built with torch ops.

    Args:
        topology: the validated topology.
        seg_lens: int ``[B, k]`` lengths on the target device; a row may sum to less than seq_len (padding).
        seq_len: S.

    Returns:
        ``(row_bits, col_bits)``, each int32 ``[B, S]`` on seg_lens' device; padding tokens hold 0.
    """
    seg = segment_ids(seg_lens, seq_len)
    row_table, col_table = topology.bit_tables(seg_lens.device)
    return row_table[seg], col_table[seg]


def _bit_table(bits: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([*bits, 0], dtype=torch.int32, device=device)


def count_allowed_pairs(topology: Any, seg_lens: SegLens, causal: bool = False, seq_q: int | None = None) -> int:
    """Number of allowed (query, key) pairs, in O(S * k) without an S x S mask (for density and FLOP counts).

    The queries are the last ``seq_q`` positions (default: all S).
    """
    topo = Topology(topology)
    lens = torch.tensor(validate_seg_lens(seg_lens, topo.num_segments), dtype=torch.int64)
    seq_k = int(lens.sum())
    seq_q = seq_k if seq_q is None else seq_q
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    pos = torch.arange(seq_k - seq_q, seq_k)  # absolute query positions
    seg = segment_ids(lens[None], seq_k)[0][pos]
    types = topo.types.to(torch.int64)[seg]  # [Sq, k]
    causal_pair = (types == CAUSAL) | causal
    visible_end = torch.where(causal_pair, torch.minimum(ends[None, :], pos[:, None] + 1), ends[None, :])
    per_seg = (visible_end - starts[None, :]).clamp(min=0)  # [Sq, k]
    return int((per_seg * (types != NONE)).sum())
