"""Segment topology: which segment of a multimodal sequence may attend to which.

A topology is a k x k 0/1 matrix: ``topology[r][c] == 1`` lets the rows (queries) of segment r see the
columns (keys) of segment c. Together with k segment lengths it defines the token-level "interlaced" mask.

The kernels never see an S x S mask. They see two int32 vectors of length S:
  - ``row_bits[i]``: bit c set when query token i may see segment c (the topology row of its segment);
  - ``col_bits[j]``: ``1 << seg(j)``, the one-hot bit of key token j's segment.
A pair is allowed when ``row_bits[i] & col_bits[j] != 0``. Padding tokens get 0 in both, so a padded query
sees nothing and a padded key is seen by nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .lengths import SegLens, validate_seg_lens

__all__ = [  # validate_seg_lens and SegLens live in mmsparse.lengths; importing them from here still works
    "MAX_SEGMENTS", "SegLens", "Topology", "count_allowed_pairs", "generate_interlaced_mask", "lookup_pairs",
    "segment_ids", "token_bits_torch", "validate_seg_lens",
]

MAX_SEGMENTS = 32  # the bit vectors are int32


def _to_int32_bits(value: int) -> int:
    """Two's-complement view of a 32-bit pattern, so that bit 31 fits an int32 tensor."""
    return value - (1 << 32) if value >= (1 << 31) else value


class Topology:
    """A validated k x k segment topology (1 <= k <= 32), with optional segment names.

    Args:
        matrix: k x k of 0/1 or bool, as nested lists/tuples, a numpy array or a torch tensor.
        names: optional k segment names, e.g. ``("text", "vision", "audio")``.
    """

    def __init__(self, matrix: Any, names: Sequence[str] | None = None) -> None:
        if isinstance(matrix, Topology):
            names = names if names is not None else matrix.names
            matrix = matrix.matrix
        self.matrix = _validate_matrix(matrix)
        k = self.num_segments
        if names is not None:
            names = tuple(str(n) for n in names)
            if len(names) != k:
                raise ValueError(f"topology has {k} segments but {len(names)} names were given: {names}")
        self.names = names
        # Plain ints, computed once: torch.compile then sees constants rather than reading a tensor back.
        rows = self.matrix.tolist()
        self._row_bits = [_to_int32_bits(sum(1 << c for c in range(k) if rows[r][c])) for r in range(k)]
        self._col_bits = [_to_int32_bits(1 << c) for c in range(k)]
        self._hash = hash(tuple(map(tuple, rows)))
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_segments(self) -> int:
        return self.matrix.shape[0]

    def row_bits(self) -> list[int]:
        """Per segment r, the int32 bit pattern of the segments its rows may see."""
        return list(self._row_bits)

    def col_bits(self) -> list[int]:
        """Per segment c, the one-hot int32 bit its keys carry."""
        return list(self._col_bits)

    def bit_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``[k + 1]`` row and column bits per segment index on ``device`` (index k: padding, 0). Kept per
        device, so that building metadata for new lengths copies nothing from the host (no sync)."""
        if torch.compiler.is_compiling():  # traced: constants in the graph, never cached tensors
            return _bit_table(self._row_bits, device), _bit_table(self._col_bits, device)
        tables = self._tables.get(device)
        if tables is None:
            tables = self._tables[device] = (_bit_table(self._row_bits, device), _bit_table(self._col_bits, device))
        return tables

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and torch.equal(self.matrix, other.matrix)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        rows = ", ".join(str([int(x) for x in r]) for r in self.matrix.tolist())
        names = f", names={self.names}" if self.names else ""
        return f"Topology([{rows}]{names})"


def _validate_matrix(matrix: Any) -> torch.Tensor:
    try:
        t = torch.as_tensor(matrix).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"topology must be a k x k matrix of 0/1 (nested lists, numpy or torch); got {matrix!r}"
        ) from e
    if t.dim() != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
        raise ValueError(f"topology must be a square k x k matrix with k >= 1; got shape {tuple(t.shape)}")
    if t.shape[0] > MAX_SEGMENTS:
        raise ValueError(f"topology has {t.shape[0]} segments; at most {MAX_SEGMENTS} are supported")
    if t.dtype != torch.bool:
        bad = ~((t == 0) | (t == 1))
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"topology entries must be 0 or 1; topology[{r}][{c}] = {t[r, c].item()}")
    return t.bool()


def generate_interlaced_mask(topology: Any, seg_lens: SegLens) -> torch.Tensor:
    """The dense token mask of a topology: ``mask[i, j]`` is True when query token i may attend key token j.

    It is S x S: meant for tests, pictures and the arbitrary-mask path. The attention path never builds it.

    Args:
        topology: k x k 0/1 matrix (or a :class:`Topology`).
        seg_lens: k segment lengths, S = sum(seg_lens).

    Returns:
        BoolTensor ``[S, S]`` on the CPU.
    """
    topo = Topology(topology)
    lens = validate_seg_lens(seg_lens, topo.num_segments)
    seg = segment_ids(torch.tensor([lens]), sum(lens))
    return lookup_pairs(topo.matrix, seg, seg)[0]


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
    visible_end = torch.minimum(ends[None, :], pos[:, None] + 1) if causal else ends[None, :].expand(seq_q, -1)
    per_seg = (visible_end - starts[None, :]).clamp(min=0)  # [Sq, k]
    return int((per_seg * topo.matrix[seg]).sum())
