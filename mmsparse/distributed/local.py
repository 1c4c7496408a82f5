"""One rank's share of a context-parallel attention, from the plan alone: no process group, no communication.

:class:`RankProblem` is what rank ``r`` of a ``P``-rank plan computes: the tokens it holds, the key positions it
gathers, and its pieces (:mod:`.pieces`). :func:`forward_pieces` and :func:`backward_pieces` run the pieces given a
callable that delivers the gathered K/V. :class:`~.context_parallel.ContextParallel` is the RankProblem of its own
rank with the exchange around those two calls; a benchmark or a test builds any rank's in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..attention.backward import ExchangeHooks
from ..checks import check_window
from ..mask.info import BitMask, CodeMask
from ..mask.segment_codes import token_codes
from ..mask.topology import CAUSAL, FULL, NONE, Topology, token_bits_torch, validate_seg_lens
from ..runtime.launch import stream_key
from .fetch import Arriving
from .pieces import (
    Piece,
    PiecesCall,
    make_code_piece,
    make_piece,
    merge,
    piece_backward,
    piece_forward,
    split_by_position,
)
from .plan import ContextParallelPlan, plan_context_parallel
from .routes import Routes, plan_routes
from .token_runs import chunk_ranges, served_chunks

Gather = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # () -> (k, v) of the gathered keys (gathered_chunks() order)
# (dK/dV of the rank's own keys or None, dK/dV of the gathered keys) -> None, as backward_pieces queues them
KVGrads = Callable[[torch.Tensor | None, torch.Tensor], None]


class ContributionRows(NamedTuple):
    """Where each of a rank's local tokens finds its dK/dV contributions, as int32 ``[S_local]`` row indices into
    each source (-1: none there)."""

    local: torch.Tensor  # the local pieces' own dK/dV (the identity)
    own: torch.Tensor | None  # the rank's gathered keys (None: it gathered none of its own)
    by_peer: dict[int, torch.Tensor]  # each peer's returned message, for the peers it serves


class RankProblem:
    """Rank ``rank`` of a ``world_size``-rank context-parallel plan: its tokens, gathered keys and pieces.

    Args:
        topology: k x k pair types ``NONE``/``FULL``/``CAUSAL`` (0/1/2), any number of segments, or a
            :class:`~mmsparse.Topology`, as for ``mbs_attention``.
        seg_lens: k lengths, or ``[B, k]`` per sample (a sample's tail past its total is padding).
        rank, world_size: which rank of how many.
        causal: the global causal flag.
        chunk: tokens per chunk (default: the plan's, about 16 chunks a rank).
        tile: chunks are multiples of it (default: 128 rows on a GPU, 16 in the interpreter).
        window: a sliding window, as in ``mbs_attention`` (key position > query position - window); key chunks
            wholly outside it are neither fetched nor run.
    """

    def __init__(self, topology: Any, seg_lens: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor, rank: int,
                 world_size: int, causal: bool = False, chunk: int | None = None, tile: int | None = None,
                 window: int | None = None) -> None:
        check_causal(causal)
        self.topology = Topology(topology)
        lens = seg_lens.tolist() if isinstance(seg_lens, torch.Tensor) else seg_lens
        k = self.topology.num_segments
        per_sample = lens and isinstance(lens[0], (list, tuple))
        rows = ([validate_seg_lens(r, k, f"seg_lens[{b}]") for b, r in enumerate(lens)] if per_sample else
                [validate_seg_lens(lens, k)])
        self.causal = causal
        self.seq_len = max(sum(r) for r in rows)
        self.window = check_window(window, self.seq_len)
        if tile is None:  # chunks of whole kernel tiles (128 rows on a GPU; the interpreter's tiles are 16 or 32)
            tile = 128 if torch.cuda.is_available() else 16
        self.plan: ContextParallelPlan = plan_context_parallel(self.topology, rows, world_size, causal, self.seq_len,
                                                               chunk, tile, self.window)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
        self.rank, self.world_size = rank, world_size
        self._lens = torch.tensor(rows, dtype=torch.int64)
        self._index = self.plan.token_index(self.rank)
        # Built on first use per device and CUDA stream: the pieces' tensors and block lists are written on the
        # stream that builds them, and another stream would read them without waiting.
        self._bits: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pieces: dict[Any, tuple[list[Piece], torch.Tensor]] = {}
        self._dropout_pieces: dict[Any, list[Piece]] = {}
        self._contribution_rows: dict[Any, ContributionRows] = {}
        self._routes: dict[bool, Routes] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The token bits and pieces are per-device caches (their masks' kernel arguments are not picklable):
        # rebuilt on first use.
        state = self.__dict__.copy()
        state["_bits"], state["_pieces"], state["_dropout_pieces"], state["_contribution_rows"] = {}, {}, {}, {}
        return state

    @property
    def local_len(self) -> int:
        return int(self._index.numel())

    @property
    def token_index(self) -> torch.Tensor:
        """int64 positions of this rank's tokens (its queries and its share of K/V), in the order it holds them."""
        return self._index

    @property
    def live_pairs(self) -> int:
        """Live (query, key) pairs of this rank's queries, per head, summed over the samples."""
        return self.plan.live_pairs[self.rank]

    def gathered_chunks(self, by_position: bool = False, rank: int | None = None) -> tuple[int, ...]:
        """The chunks whose K/V this rank (or ``rank``) gathers, its own among them, in the order it holds them:
        sequence order, except where the ranks are one piece (:meth:`one_piece`): its own chunks first, then each
        other rank's in rank order. That piece's mask does not depend on the keys' order, and the exchange then
        copies, sends and sums each rank's chunks as one run instead of one chunk at a time."""
        rank = self.rank if rank is None else rank
        needed = self.plan.needed_kv[rank]
        if not self.one_piece(by_position):
            return needed
        owners = [rank, *(r for r in range(self.world_size) if r != rank)]
        return tuple(c for r in owners for c in needed if self.plan.owner[c] == r)

    def most_gathered_kv_bytes(self, k: torch.Tensor) -> int:
        """Bytes of the gathered K and V of the rank that gathers the most keys, for keys shaped and typed like
        ``k`` (``[B, Hkv, ., D]``): the same on every rank, whichever rank asks."""
        most = max(self.routes().gathered_lengths)
        return 2 * k.shape[0] * k.shape[1] * most * k.shape[3] * k.element_size()

    def gathered_positions(self, by_position: bool = False) -> torch.Tensor:
        """int64 positions of the keys this rank gathers (its own among them), in :meth:`gathered_chunks`' order
        (the pieces' order for ``by_position``)."""
        chunks = self.gathered_chunks(by_position)
        spans = [torch.arange(c * self.plan.chunk, c * self.plan.chunk + self.plan.chunk_tokens(c)) for c in chunks]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.int64)

    def one_piece(self, by_position: bool = False) -> bool:
        """Whether every rank's attention is a single piece, its queries over all its gathered keys (token bits,
        no causal flag, no window, no dropout cut): each query row and each key is then one piece's alone, so the
        piece's gradients, already in the inputs' dtype, are exact. Every rank answers alike (the rule reads only
        what the ranks share), so the dK/dV return can travel in the inputs' dtype instead of float32."""
        return self.topology.uses_bits and not self.causal and self.window is None and not by_position

    def kv_grad_dtype(self, dtype: torch.dtype, by_position: bool = False) -> torch.dtype:
        """The dtype of the dK/dV contributions that go back to the chunks' owners: the inputs' where
        :meth:`one_piece` (exact), else float32 (sums over several pieces)."""
        return dtype if self.one_piece(by_position) else torch.float32

    def pieces(self, device: torch.device, by_position: bool = False) -> list[Piece]:
        """This rank's pieces (see :mod:`.pieces`), built once per device and stream; ``by_position``: cut into
        runs of consecutive positions, as dropout needs."""
        return self._pieces_by_position(device) if by_position else self._local_pieces(device)

    def routes(self, by_position: bool = False) -> Routes:
        """Where each chunk's tokens travel in this rank's exchanges (:mod:`.routes`), worked out once per key
        order."""
        if by_position not in self._routes:
            self._routes[by_position] = plan_routes(self, by_position)
        return self._routes[by_position]

    def contribution_rows(self, by_position: bool, device: torch.device) -> ContributionRows:
        """Where each of this rank's local tokens finds its dK/dV contributions (:class:`ContributionRows`), built
        once per device."""
        key = (by_position, _where(device))
        if key not in self._contribution_rows:
            self._contribution_rows[key] = self._rows_of_contributions(by_position, device)
        return self._contribution_rows[key]

    # internals -------------------------------------------------------------------------------------------------

    def _rows_of_contributions(self, by_position: bool, device: torch.device) -> ContributionRows:
        plan, rank = self.plan, self.rank
        mine = chunk_ranges(plan, plan.local_chunks[rank])

        def rows(places: dict[int, tuple[int, int]]) -> torch.Tensor:
            index = torch.full((self.local_len,), -1, dtype=torch.int32)
            for c, (start, end) in places.items():
                index[mine[c][0] : mine[c][0] + end - start] = torch.arange(start, end, dtype=torch.int32)
            return index.to(device)

        gathered = chunk_ranges(plan, self.gathered_chunks(by_position))
        own = {c: gathered[c] for c in plan.local_chunks[rank] if c in gathered}
        served = {peer: served_chunks(plan, rank, peer) for peer in range(self.world_size) if peer != rank}
        by_peer = {peer: rows(chunk_ranges(plan, chunks)) for peer, chunks in served.items() if chunks}
        local = torch.arange(self.local_len, dtype=torch.int32, device=device)
        return ContributionRows(local, rows(own) if own else None, by_peer)

    def _token_bits(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        bits = self._bits.get(_where(device))
        if bits is None:
            bits = self._bits[_where(device)] = token_bits_torch(self.topology, self._lens.to(device), self.seq_len)
        return bits

    def _local_pieces(self, device: torch.device) -> list[Piece]:
        """The pieces of this rank's attention (see :mod:`.pieces`), built once per device."""
        cached = self._pieces.get(_where(device))
        if cached is not None:
            return cached[0]
        if self.window is not None:
            return self._window_pieces(device)
        if not self.topology.uses_bits:
            return self._code_pieces(device)
        row_bits, col_bits = self._token_bits(device)
        num_segments = self.topology.num_segments
        gathered = self.gathered_positions().to(device)
        local = self._index.to(device)
        pieces: list[Piece] = []
        if not self.causal:
            pieces.extend(self._whole_piece(device, gathered))
        else:
            chunk, start = self.plan.chunk, 0
            for c in self.plan.local_chunks[self.rank]:
                n = self.plan.chunk_tokens(c)
                rows = slice(start, start + n)
                q_pos = local[rows]
                before = int((gathered < c * chunk).sum())  # gathered keys sit in sequence order
                if before:
                    pieces.append(make_piece(rows, slice(0, before), False, False, row_bits[:, q_pos],
                                             col_bits[:, gathered[:before]], num_segments))
                pieces.append(make_piece(rows, rows, True, True, row_bits[:, q_pos], col_bits[:, q_pos],
                                         num_segments))
                start += n
        self._pieces[_where(device)] = (pieces, gathered)
        return pieces

    def _whole_piece(self, device: torch.device, gathered: torch.Tensor) -> list[Piece]:
        """The one piece of a token-bits mask without the causal flag: every local query over every gathered key
        (``gathered``: their positions, in the order held); none without gathered keys."""
        if not gathered.numel():
            return []
        row_bits, col_bits = self._token_bits(device)
        return [make_piece(slice(0, self.local_len), slice(0, gathered.numel()), False, False,
                           row_bits[:, self._index.to(device)], col_bits[:, gathered], self.topology.num_segments)]

    def _pieces_by_position(self, device: torch.device) -> list[Piece]:
        """The pieces cut into runs of consecutive positions (for dropout: see :mod:`.pieces`), once per device.
        The keys are in sequence order here (:meth:`gathered_chunks`), where runs are longest."""
        cached = self._dropout_pieces.get(_where(device))
        if cached is None:
            gathered, local = self.gathered_positions(by_position=True).to(device), self._index.to(device)
            pieces = self._whole_piece(device, gathered) if self.one_piece() else self._local_pieces(device)
            cached = self._dropout_pieces[_where(device)] = [
                part for p in pieces
                for part in split_by_position(p, local[p.q_rows], (local if p.local_keys else gathered)[p.k_rows])]
        return cached

    def _code_pieces(self, device: torch.device) -> list[Piece]:
        """Pieces of a segment-code mask (pair types, more than 32 segments): per local query chunk, the gathered
        key chunks before it (CAUSAL pairs are FULL there), its own chunk (the real table, positions aligned) and,
        unless causal, the key chunks after it (CAUSAL pairs are NONE there)."""
        k = self.topology.num_segments
        codes = token_codes(self._lens.to(device), k, self.seq_len, packed=False)
        table = self.topology.pair_table(device)
        before_table = torch.where(table == CAUSAL, FULL, table).to(table.dtype)
        after_table = torch.where(table == CAUSAL, NONE, table).to(table.dtype)
        gathered = self.gathered_positions().to(device)
        local = self._index.to(device)
        chunk, start, pieces = self.plan.chunk, 0, []
        for c in self.plan.local_chunks[self.rank]:
            n = self.plan.chunk_tokens(c)
            rows = slice(start, start + n)
            q_codes = codes[:, local[rows]]
            before = int((gathered < c * chunk).sum())  # gathered keys sit in sequence order
            after = int((gathered < (c + 1) * chunk).sum())
            if before:
                pieces.append(make_code_piece(rows, slice(0, before), False, False, q_codes,
                                              codes[:, gathered[:before]], before_table, k))
            pieces.append(make_code_piece(rows, rows, True, self.causal, q_codes, q_codes, table, k))
            if not self.causal and after < gathered.numel():
                pieces.append(make_code_piece(rows, slice(after, gathered.numel()), False, False, q_codes,
                                              codes[:, gathered[after:]], after_table, k))
            start += n
        self._pieces[_where(device)] = (pieces, gathered)
        return pieces

    def _window_pieces(self, device: torch.device) -> list[Piece]:
        """Pieces under a sliding window: per local query chunk, one piece per key chunk it has pairs with (the
        plan's counts, window included), its own from the local keys. Each piece's queries and keys are one run of
        positions, so its first query's position relative to its first key (``q_start``) puts the causal test,
        CAUSAL pairs and the window where they belong, with the real pair table."""
        gathered = self.gathered_positions().to(device)
        local = self._index.to(device)
        chunk = self.plan.chunk
        needed = self.plan.needed_kv[self.rank]
        starts = dict(zip(needed, torch.tensor([0, *(self.plan.chunk_tokens(c) for c in needed)]).cumsum(0).tolist()))
        if self.topology.uses_bits:
            row_bits, col_bits = self._token_bits(device)
        else:
            codes = token_codes(self._lens.to(device), self.topology.num_segments, self.seq_len, packed=False)
            table = self.topology.pair_table(device)
        pieces, start = [], 0
        for c in self.plan.local_chunks[self.rank]:
            n = self.plan.chunk_tokens(c)
            rows = slice(start, start + n)
            q_pos = local[rows]
            for c2 in needed:
                if int(self.plan.pairs[c, c2]) == 0:
                    continue
                own = c2 == c
                keys = rows if own else slice(starts[c2], starts[c2] + self.plan.chunk_tokens(c2))
                k_pos = q_pos if own else gathered[keys]
                q_start = torch.tensor([(c - c2) * chunk], dtype=torch.int32, device=device)
                info: BitMask | CodeMask
                if self.topology.uses_bits:
                    info = BitMask(row_bits[:, q_pos].contiguous(), col_bits[:, k_pos].contiguous(),
                                   self.topology.num_segments, self.causal, q_start, self.window)
                else:
                    info = CodeMask(codes[:, q_pos].contiguous(), codes[:, k_pos].contiguous(), table,
                                    self.topology.num_segments, self.causal, q_start, window=self.window)
                pieces.append(Piece(rows, keys, own, self.causal, info))
            start += n
        self._pieces[_where(device)] = (pieces, gathered)
        return pieces


def _where(device: torch.device) -> tuple[torch.device, Any]:
    """The key of what a RankProblem builds: the device and its current CUDA stream (None off the GPU)."""
    return device, stream_key(device)


def check_causal(causal: Any) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")


def forward_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: list[Piece], seeds: list[Any],
                   scale: float, dropout_p: float, gather: Gather,
                   call: PiecesCall | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's forward: (out ``[B, Hq, S_local, D]``, lse float32 ``[B, Hq, S_local]``, log2 units).

    Args:
        q: ``[B, Hq, S_local, D]``; k, v: ``[B, Hkv, S_local, D]``: the rank's tokens.
        pieces, seeds: the rank's pieces and their dropout seeds (None each without dropout).
        gather: gives the gathered K and V; called once, after the pieces over the rank's own keys are launched
            (in a real run it waits for the exchange, which those pieces overlap).
        call: the settings the pieces run with and, filled here, their launches, for :func:`backward_pieces`
            (None: this thread's settings now, and the launches are not kept).
    """
    call = PiecesCall() if call is None else call
    if _whole(pieces, q.shape[2]):  # one piece over every row: its result is the rank's, nothing to merge
        k_g, v_g = gather()
        (piece,), (seed,) = pieces, seeds
        return piece_forward(q, k_g[:, :, piece.k_rows], v_g[:, :, piece.k_rows], piece, scale, dropout_p, seed, call)
    # The merge keeps the pieces' order, so the result does not depend on which finished first.
    done = {id(p): piece_forward(q[:, :, p.q_rows], k[:, :, p.k_rows], v[:, :, p.k_rows], p, scale, dropout_p, s,
                                 call)
            for p, s in zip(pieces, seeds) if p.local_keys}
    k_g, v_g = gather()
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("inf"), dtype=torch.float32, device=q.device)
    for rows, group in _by_rows(list(zip(pieces, seeds))):
        parts = [done.pop(id(p)) if p.local_keys else
                 piece_forward(q[:, :, rows], k_g[:, :, p.k_rows], v_g[:, :, p.k_rows], p, scale, dropout_p, s, call)
                 for p, s in group]
        out[:, :, rows], lse[:, :, rows] = merge([o for o, _ in parts], [s for _, s in parts])
    return out, lse


def backward_pieces(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, pieces: list[Piece], seeds: list[Any], scale: float, dropout_p: float,
                    gather: Gather, call: PiecesCall | None = None, on_kv_grads: KVGrads | None = None,
                    arriving: Arriving | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A rank's backward against the merged ``out`` and ``lse`` of :func:`forward_pieces`: (dq
    ``[B, Hq, S_local, D]``, dK/dV of its own keys ``[B, 2 Hkv, S_local, D]`` or None when no piece reads them,
    dK/dV of the gathered keys ``[B, 2 Hkv, S_gathered, D]``), float32 sums over the pieces; where the rank is
    one piece over every row (:meth:`RankProblem.one_piece`), that piece's own gradients in the inputs' dtype.
    ``gather`` is called once, after the pieces over the rank's own keys. ``call``: the forward's (None: this
    thread's settings now, and the pieces plan again). ``on_kv_grads(dkv_local, dkv_gathered)``: called once
    with the two dK/dV as soon as they are queued: for one piece before its dQ pass, so that the return it starts
    runs beside that pass; else after the last piece. ``arriving``: for one piece, ``gather``'s keys at once, with
    those still landing (:meth:`.fetch.Fetch.arriving`), which its dK/dV pass takes as they land."""
    call = PiecesCall() if call is None else call
    hkv = k.shape[1]
    if _whole(pieces, q.shape[2]):
        k_g, v_g, landing = arriving() if arriving is not None else (*gather(), None)
        (piece,), (seed,) = pieces, seeds
        keys = piece.k_rows
        handed: list[torch.Tensor] = []  # the gathered keys' dK/dV, once queued

        def dkdv_queued(dk_p: torch.Tensor, dv_p: torch.Tensor) -> None:
            if (keys.start, keys.stop) == (0, k_g.shape[2]):
                dkv_g = torch.cat([dk_p, dv_p], dim=1)
            else:
                dkv_g = dk_p.new_zeros((k.shape[0], 2 * hkv, k_g.shape[2], k.shape[3]))
                dkv_g[:, :hkv, keys], dkv_g[:, hkv:, keys] = dk_p, dv_p
            handed.append(dkv_g)
            if on_kv_grads is not None:
                on_kv_grads(None, dkv_g)

        if landing is not None and keys.start != 0:
            landing.wait()  # the piece's keys do not start with the ones already there
            landing = None
        dq, _, _ = piece_backward(grad_out, q, k_g[:, :, keys], v_g[:, :, keys], out, lse, piece, scale, dropout_p,
                                  seed, call, ExchangeHooks(landing, dkdv_queued))
        return dq, None, handed[0]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_l = torch.zeros((k.shape[0], 2 * hkv, k.shape[2], k.shape[3]), dtype=torch.float32, device=q.device)
    gathered = None  # (k_g, v_g, their dK/dV) once gathered

    def wait() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_g, v_g = gather()
        return k_g, v_g, torch.zeros((k.shape[0], 2 * hkv, k_g.shape[2], k.shape[3]), dtype=torch.float32,
                                     device=q.device)

    # Own keys first, as in the forward (a stable sort: a fixed order).
    for piece, seed in sorted(zip(pieces, seeds), key=lambda ps: not ps[0].local_keys):
        if piece.local_keys:
            kk, vv, target = k, v, dkv_l
        else:
            gathered = gathered or wait()
            kk, vv, target = gathered
        rows, keys = piece.q_rows, piece.k_rows
        dq_p, dk_p, dv_p = piece_backward(grad_out[:, :, rows], q[:, :, rows], kk[:, :, keys], vv[:, :, keys],
                                          out[:, :, rows], lse[:, :, rows], piece, scale, dropout_p, seed, call)
        dq[:, :, rows] += dq_p
        target[:, :hkv, keys] += dk_p
        target[:, hkv:, keys] += dv_p
    gathered = gathered or wait()  # called even when no piece reads gathered keys (a real run's sends complete)
    if on_kv_grads is not None:
        on_kv_grads(dkv_l, gathered[2])
    return dq, dkv_l, gathered[2]


def _whole(pieces: list[Piece], local_len: int) -> bool:
    """Whether ``pieces`` is one piece over the gathered keys that holds every local query row."""
    return (len(pieces) == 1 and not pieces[0].local_keys
            and (pieces[0].q_rows.start, pieces[0].q_rows.stop) == (0, local_len))


def _by_rows(pieces: list[tuple[Piece, Any]]) -> list[tuple[slice, list[tuple[Piece, Any]]]]:
    """(piece, seed) pairs grouped by the pieces' query rows, each group in list order (the merge order). Pieces
    cut by position interleave their query runs, so a group gathers pieces that are not adjacent."""
    groups: dict[tuple[int, int], tuple[slice, list[tuple[Piece, Any]]]] = {}
    for p, s in pieces:
        groups.setdefault((p.q_rows.start, p.q_rows.stop), (p.q_rows, []))[1].append((p, s))
    ordered = sorted(groups.values(), key=lambda g: g[0].start)
    for (a, _), (b, _) in zip(ordered, ordered[1:]):
        if b.start < a.stop:
            raise AssertionError(f"pieces over query rows {a} and {b} overlap without being equal")
    return ordered
