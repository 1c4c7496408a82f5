"""One rank's attention as pieces that the block-sparse kernels run as they are, and their log-sum-exp merge.

A rank's queries are chunks of the sequence; the keys it holds after the exchange are the needed chunks, in sequence
order (a rank that is one piece holds its own first: that piece needs no order). The topology part of the mask comes
from per-token bits (or segment codes), whatever the tokens' positions. The causal part needs positions, and the kernels
compare local indices (key j <= first query + i), so with ``causal`` each query chunk runs as two pieces whose positions
the kernels get right: the key chunks before it (all visible: no causal test) and its own chunk (queries and keys at the
same positions). A topology with CAUSAL pairs runs every query chunk that way, plus (without the global flag) the key
chunks after it: before its queries a CAUSAL pair is FULL, after them NONE, so those pieces take the pair table with
CAUSAL replaced. Pieces merge by their log-sum-exp; each piece's backward then runs against the merged output and
log-sum-exp, which gives exactly its share of the gradients (the ring-attention identity).

With a sliding window every piece is one query chunk against one key chunk (:mod:`.local`), and its ``q_start``
is the first query's position less the first key's: the kernels then test the causal order, CAUSAL pairs and the
window on true relative positions, with the real pair table.

Dropout draws its bits by global query and key positions, so with dropout every piece is split until its queries
and its keys are each one run of consecutive positions (:func:`split_by_position`); its seed then carries the
positions of its first query and first key, and the kernels draw the bits a single-GPU call draws there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.backward import ExchangeHooks
from ..attention.call import CallLaunch
from ..attention.config import Settings, current_settings, with_threshold
from ..attention.custom_ops import TracedCall, attention_backward, attention_forward
from ..attention.forward import combine_partials
from ..mask.info import BitMask, CodeMask


@dataclass
class Piece:
    """Queries ``q_rows`` (a range of the rank's local tokens) against keys ``k_rows`` (a range of the gathered
    keys, or of the local keys when ``local_keys``), with the causal test when ``causal``."""

    q_rows: slice
    k_rows: slice
    local_keys: bool
    causal: bool
    info: BitMask | CodeMask
    # The dropout seed's position offsets (one run each): the kernels draw a query's bits at q_start + row + the
    # first, a key's at column + the second, which are then the global positions.
    positions: tuple[int, int] | None = None


def make_piece(q_rows: slice, k_rows: slice, local_keys: bool, causal: bool, q_bits: torch.Tensor,
               k_bits: torch.Tensor, num_segments: int) -> Piece:
    """q_bits: int32 ``[Bm, Sq_piece]`` row bits of the piece's queries; k_bits: ``[Bm, Sk_piece]`` column bits."""
    info = BitMask(q_bits.contiguous(), k_bits.contiguous(), num_segments, causal)
    return Piece(q_rows, k_rows, local_keys, causal, info)


def make_code_piece(q_rows: slice, k_rows: slice, local_keys: bool, causal: bool, q_codes: torch.Tensor,
                    k_codes: torch.Tensor, table: torch.Tensor, num_segments: int) -> Piece:
    """A piece of a segment-code mask (:mod:`mmsparse.mask.segment_codes`): codes ``[Bm, S_piece]`` and the pair
    table its keys' side of the queries needs."""
    info = CodeMask(q_codes.contiguous(), k_codes.contiguous(), table, num_segments, causal)
    return Piece(q_rows, k_rows, local_keys, causal, info)


def split_by_position(piece: Piece, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[Piece]:
    """``piece`` cut so that each part's queries and keys are runs of consecutive global positions.
    ``q_positions``/``k_positions``: the global positions of the piece's query rows and key rows. A causal piece
    (one chunk against itself) is one run already."""
    parts = []
    for qa, qb, q0 in _runs(q_positions):
        for ka, kb, k0 in _runs(k_positions):
            # Without a window q_start is 0: the causal test of a piece compares local indices (a chunk against
            # itself). With one it is the first query's position less the first key's (the window needs them).
            shift = 0 if piece.info.window is None else q0 - k0
            sliced = _sliced(piece.info, slice(qa, qb), slice(ka, kb), shift)
            parts.append(Piece(slice(piece.q_rows.start + qa, piece.q_rows.start + qb),
                               slice(piece.k_rows.start + ka, piece.k_rows.start + kb), piece.local_keys,
                               piece.causal, sliced, (q0 - shift, k0)))
    if piece.causal and len(parts) != 1:
        raise AssertionError("a causal piece spans one chunk: its rows and keys are one run each")
    return parts


def _sliced(info: BitMask | CodeMask, rows: slice, keys: slice, q_start: int) -> BitMask | CodeMask:
    """The mask of ``info``'s query ``rows`` over its ``keys``, its first query at position ``q_start``."""
    start = torch.full_like(info.q_start, q_start)
    if isinstance(info, BitMask):
        return BitMask(info.q_bits[:, rows].contiguous(), info.k_bits[:, keys].contiguous(), info.num_segments,
                       info.causal, start, info.window)
    return CodeMask(info.q_codes[:, rows].contiguous(), info.k_codes[:, keys].contiguous(), info.table,
                    info.num_segments, info.causal, start, window=info.window)


def _runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, first position) of each run of consecutive positions."""
    pos = positions.cpu()
    if pos.numel() == 0:
        return []
    breaks = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, pos.numel()]
    return [(a, b, int(pos[a])) for a, b in zip(starts, ends)]


@dataclass
class PiecesCall:
    """What one call's pieces carry from its forward to its backward, by value: the settings the forward read (so
    the backward runs with them on whichever thread and whenever it runs; the ordered dQ writer's longest-first
    default off) and each piece's launches, which the backward reuses instead of planning again."""

    settings: Settings = field(default_factory=current_settings)
    launches: dict[int, CallLaunch | TracedCall] = field(default_factory=dict)  # by id of the piece

    def __post_init__(self) -> None:
        # The pieces' backward is the two passes, also over masks where a call alone runs the ordered dQ writer
        # (KernelConfig.ordered_max_keys): its one pass would end the dK/dV pass's taking of keys as they land and
        # the return of dK/dV beside the dQ pass
        self.settings = with_threshold(self.settings, "ordered_max_keys", 0)


def piece_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: Piece, scale: float,
                  dropout_p: float, seed: torch.Tensor | None, call: PiecesCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one piece; lse in log2 units, +inf on rows that see nothing. With dropout, ``seed`` is the
    piece's (:func:`piece_seeds`). Its launches go into ``call``."""
    out, lse, call.launches[id(piece)] = attention_forward(q, k, v, piece.info, scale, dropout_p, seed, call.settings)
    return out, lse


def piece_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, piece: Piece, scale: float, dropout_p: float, seed: torch.Tensor | None,
                   call: PiecesCall, hooks: ExchangeHooks | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one piece, against the merged out and lse of its query rows, with the forward's settings
    and launches (``call``). ``hooks``: the rank's exchange beside the piece's backward (``attention_backward``'s).
    The kernels read ``out`` at its strides, a slice of the rank's rows included; ``lse`` is made contiguous."""
    return attention_backward(do, q, k, v, out, lse.contiguous(), piece.info, scale, dropout_p, seed,
                              settings=call.settings, launch=call.launches.get(id(piece)), hooks=hooks)


def piece_seeds(pieces: list[Piece], seed: torch.Tensor) -> list[torch.Tensor]:
    """Each piece's int64 ``[3]`` dropout seed, a tensor of its own: the call's Philox key and the piece's first
    query and key positions (pieces from :func:`split_by_position`)."""
    offsets = torch.tensor([p.positions for p in pieces], dtype=torch.int64, device=seed.device)
    return [row.clone() for row in torch.cat([seed[:1].expand(len(pieces), 1), offsets], dim=1).unbind(0)]


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results over disjoint key sets, in list order (deterministic), with the forward's split-KV
    combine: out = sum_p 2^(lse_p - lse) out_p, lse = log2 sum_p 2^lse_p; rows that see nothing anywhere give 0
    and lse = +inf."""
    if len(outs) == 1:
        return outs[0], lses[0]
    parts = torch.stack([o.float() for o in outs])
    part_lses = torch.stack(lses)
    # a piece marks a row that sees nothing with +inf, a split of the forward with -inf
    part_lses = torch.where(part_lses == float("inf"), float("-inf"), part_lses)
    return combine_partials(parts, part_lses, outs[0].dtype)
