"""Where each chunk's tokens travel in one rank's exchanges, worked out once per rank and key order.

The fetch and the return copy runs of tokens between a rank's own tokens, its gathered keys, its peers' slots and
the messages of point to point. Which runs depends only on the plan, the rank and the gathered keys' order, so a
call reads them here instead of walking the plan's chunks again (at 43k tokens on 4 GPUs that walk was over a
thousand Python calls a step). A span is (source start, destination start, tokens); runs of adjacent spans are
merged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from .token_runs import chunk_ranges, merged_runs, message_spans, served_chunks

Span = tuple[int, int, int]


@dataclass(frozen=True)
class Message:
    """A message to or from one peer: its tokens, and the runs that fill it or that it fills."""

    tokens: int
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Routes:
    """One rank's exchanges under one key order (``by_position``: the dropout pieces').

    Attributes:
        local_lengths: every rank's own tokens (a fetch slot holds a rank's K/V).
        gathered_lengths: every rank's gathered keys (a return slot holds their dK/dV).
        gathered: this rank's gathered keys.
        present: its own chunks' tokens at the head of its gathered keys (there before any peer's land).
        own: its own tokens into its gathered keys.
        fetch_sends: per peer served, the runs of its own tokens packed into the message (point to point).
        fetch_receives: per peer that serves it, the message's runs into its gathered keys (point to point).
        fetch_pulls: per peer that serves it, the runs of the peer's own tokens into its gathered keys (peer
            copies).
        served: the tokens it serves each peer (the K/V it sends, the dK/dV it gets back).
        return_sends: per owner of keys it gathered, the runs of its gathered keys' dK/dV packed into the message.
        return_pulls: per peer it served, the runs of that peer's gathered keys' dK/dV into a message of the
            served chunks (peer copies).
    """

    local_lengths: tuple[int, ...]
    gathered_lengths: tuple[int, ...]
    gathered: int
    present: int
    own: tuple[Span, ...]
    fetch_sends: dict[int, Message]
    fetch_receives: dict[int, Message]
    fetch_pulls: dict[int, Message]
    served: dict[int, int]
    return_sends: dict[int, Message]
    return_pulls: dict[int, Message]

    @property
    def fetched(self) -> int:
        """Tokens fetched from peers."""
        return sum(m.tokens for m in self.fetch_receives.values())


def plan_routes(problem: Any, by_position: bool) -> Routes:
    """The :class:`Routes` of ``problem`` (a :class:`~mmsparse.distributed.RankProblem`) for one key order."""
    plan, rank, world = problem.plan, problem.rank, problem.world_size
    needed = problem.gathered_chunks(by_position)
    gathered_of = [problem.gathered_chunks(by_position, rank=r) for r in range(world)]
    into = chunk_ranges(plan, needed)
    mine = chunk_ranges(plan, plan.local_chunks[rank])
    peers = [peer for peer in range(world) if peer != rank]

    def message(chunks: list[int], where: dict[int, tuple[int, int]], source_first: bool) -> Message:
        return Message(plan.tokens_of(chunks), tuple(merged_runs(message_spans(plan, chunks, where, source_first))))

    def from_peer(peer: int) -> list[int]:  # in the gathered keys' order, as a peer's message holds them
        return [c for c in needed if plan.owner[c] == peer]

    def pulls(peer: int) -> Message:
        where = chunk_ranges(plan, plan.local_chunks[peer])
        chunks = from_peer(peer)
        spans = [(where[c][0], into[c][0], plan.chunk_tokens(c)) for c in chunks]
        return Message(plan.tokens_of(chunks), tuple(merged_runs(spans)))

    serving = {peer: served_chunks(plan, rank, peer) for peer in peers}
    owing = {peer: served_chunks(plan, peer, rank) for peer in peers}
    return Routes(
        local_lengths=tuple(plan.tokens_of(chunks) for chunks in plan.local_chunks),
        gathered_lengths=tuple(plan.tokens_of(chunks) for chunks in gathered_of),
        gathered=plan.tokens_of(needed),
        present=plan.tokens_of(list(itertools.takewhile(lambda c: plan.owner[c] == rank, needed))),
        own=tuple(merged_runs([(mine[c][0], into[c][0], plan.chunk_tokens(c))
                               for c in needed if plan.owner[c] == rank])),
        fetch_sends={peer: message(chunks, mine, True) for peer, chunks in serving.items() if chunks},
        fetch_receives={peer: message(from_peer(peer), into, False) for peer, chunks in owing.items() if chunks},
        fetch_pulls={peer: pulls(peer) for peer, chunks in owing.items() if chunks},
        served={peer: plan.tokens_of(chunks) for peer, chunks in serving.items()},
        return_sends={peer: message(chunks, into, True) for peer, chunks in owing.items() if chunks},
        return_pulls={peer: message(chunks, chunk_ranges(plan, gathered_of[peer]), True)
                      for peer, chunks in serving.items() if chunks},
    )
