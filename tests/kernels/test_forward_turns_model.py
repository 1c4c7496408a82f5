"""The Gluon forward's synchronisation protocol, run as a model on random schedules (Gluon has no CPU interpreter).

The model replays what ``kernels/gluon/forward.py`` does with its barriers, with the same index and phase formulas:
the producer waits, loads and signals; each consumer warpgroup takes its turn, issues its matmuls (reads of a K or V
stage that last until its ``warpgroup_mma_wait``), hands the turn over and releases stages. mbarriers follow PTX's
parity semantics (a wait for parity P returns once the barrier's current phase has the other parity, so a fresh
barrier counts as phase 1 complete); a named barrier completes a generation once all its parties counted in. A
random scheduler interleaves the three roles and the TMA engine, whose copies land in any order later. Checked: no
deadlock, every matmul reads the block it expects (a stage refilled too early fails), no stage is refilled while a
matmul reads it, the warpgroups issue their turns strictly in turn, and no named barrier is left counted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest


class MBarrier:
    def __init__(self, count: int) -> None:
        self.count, self.pending, self.completed = count, count, 0  # completed: phases completed so far

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def passed(self, parity: int) -> bool:
        return (self.completed & 1) != parity


class NamedBarrier:
    """A hardware named barrier: a generation completes once each of its parties (the consumer warpgroups 0 and 1,
    for a release also the producer "p") counted in, by ``bar.sync`` (then waits) or ``bar.arrive`` (goes on). A
    party counting twice in one generation would complete it early on hardware (it counts threads, not parties)."""

    def __init__(self, parties: int = 2) -> None:
        self.parties = parties
        self.counted: set = set()
        self.generation = 0

    def arrive(self, wg) -> None:
        assert wg not in self.counted, f"{wg} counted twice in one generation"
        self.counted.add(wg)
        if len(self.counted) == self.parties:
            self.counted, self.generation = set(), self.generation + 1

    def sync(self, wg) -> Iterator[None]:
        generation = self.generation
        self.arrive(wg)
        while self.generation == generation:
            yield


class Protocol:
    """One CTA's barriers and K/V stages, for ``n`` listed key blocks and ``stages`` stages."""

    def __init__(self, turns: str, n: int, stages: int, rng: random.Random) -> None:
        self.turns, self.n, self.stages, self.rng = turns, n, stages, rng
        self.slots = {"k": [None] * stages, "v": [None] * stages}  # the block each stage holds
        self.reads = {"k": [set() for _ in range(stages)], "v": [set() for _ in range(stages)]}
        self.ready = {"k": [MBarrier(1) for _ in range(stages)], "v": [MBarrier(1) for _ in range(stages)]}
        self.kv_empty = [MBarrier(2) for _ in range(stages)]
        self.turn = [MBarrier(1), MBarrier(1)]
        self.named = [NamedBarrier(), NamedBarrier()]  # forward.TURN_BARRIER_IDS
        self.named_releases = [NamedBarrier(3) for _ in range(stages)]  # from forward.RELEASE_BARRIER_ID
        self.copies: list[tuple[str, int, int]] = []  # issued TMA copies: (k or v, stage, block)
        self.issued: list[tuple[int, int]] = []  # (warpgroup, turn) in the order the turns issued their matmuls
        if turns == "mbarrier":
            self.turn[0].arrive()  # common.init_turns: warpgroup 0 first

    # -- primitives ------------------------------------------------------------------------------------------------
    @staticmethod
    def wait(bar: MBarrier, parity: int) -> Iterator[None]:
        while not bar.passed(parity):
            yield

    def load(self, kind: str, stage: int, block: int) -> Iterator[None]:
        readers = self.reads[kind][stage]
        assert not readers, f"{kind} stage {stage} refilled while warpgroups {readers} read it"
        self.copies.append((kind, stage, block))
        yield

    def tma_engine(self) -> Iterator[None]:
        while True:
            if self.copies and self.rng.random() < 0.4:
                kind, stage, block = self.copies.pop(self.rng.randrange(len(self.copies)))
                self.slots[kind][stage] = block
                self.ready[kind][stage].arrive()
            yield

    # -- the producer (forward._producer) --------------------------------------------------------------------------
    def producer(self) -> Iterator[None]:
        n, stages = self.n, self.stages
        if self.turns == "named_release":  # forward._stream_kv_named
            for first in range(0, n, stages):
                for stage in range(stages):
                    if first + stage < n:
                        if first > 0:
                            yield from self.named_releases[stage].sync("p")
                        yield from self.load("k", stage, first + stage)
                        yield from self.load("v", stage, first + stage)
        else:  # common.stream_kv_ring
            for it in range(n):
                stage = it % stages
                yield from self.wait(self.kv_empty[stage], ((it // stages) & 1) ^ 1)
                yield from self.load("k", stage, it)
                yield from self.load("v", stage, it)

    # -- a consumer warpgroup (forward._consumer) -----------------------------------------------------------------
    def take_turn(self, wg: int, e: int) -> Iterator[None]:
        if self.turns == "named_release":
            yield from self.named[wg].sync(wg)
        else:
            yield from self.wait(self.turn[wg], e & 1)

    def hand_off(self, wg: int, e: int) -> None:
        if self.turns == "named_release":
            if wg == 0 or e < self.n:  # warpgroup 1 skips its last: warpgroup 0 takes no turn after it
                self.named[1 - wg].arrive(wg)
        else:
            self.turn[1 - wg].arrive()

    def release(self, wg: int, block: int) -> None:
        stage = block % self.stages
        if self.turns == "named_release":
            if block + self.stages < self.n:  # only where the producer waits for it
                self.named_releases[stage].arrive(wg)
        else:
            self.kv_empty[stage].arrive()

    def consumer(self, wg: int) -> Iterator[None]:
        n, stages = self.n, self.stages
        pending: list[tuple[str, int]] = []  # this warpgroup's matmul reads not yet waited for, oldest first

        def issue(kind: str, block: int) -> Iterator[None]:
            stage = block % stages
            yield from self.wait(self.ready[kind][stage], (block // stages) & 1)
            held = self.slots[kind][stage]
            assert held == block, f"warpgroup {wg} reads {kind} block {held}, not {block}"
            self.reads[kind][stage].add(wg)
            pending.append((kind, stage))

        def mma_wait(keep: int) -> None:
            while len(pending) > keep:
                kind, stage = pending.pop(0)
                self.reads[kind][stage].discard(wg)

        if self.turns == "named_release" and wg == 1:
            self.named[0].arrive(1)  # warpgroup 0 goes first
        for e in range(n + 1):  # turn 0: S_0 alone; turn n: the last P V alone
            yield from self.take_turn(wg, e)
            self.issued.append((wg, e))
            if e < n:
                yield from issue("k", e)
            if e > 0:
                yield from issue("v", e - 1)
            self.hand_off(wg, e)
            yield  # the softmax
            if 0 < e < n:
                mma_wait(1)
                yield
            mma_wait(0)
            if e > 0:
                self.release(wg, e - 1)
            yield

    def run(self) -> None:
        roles = {"producer": self.producer(), "wg0": self.consumer(0), "wg1": self.consumer(1)}
        engine = self.tma_engine()
        for _ in range(100_000):
            if not roles:
                break
            next(engine)
            name = self.rng.choice(sorted(roles))
            try:
                next(roles[name])
            except StopIteration:
                del roles[name]
        assert not roles, f"deadlock: {sorted(roles)} still waiting"
        assert self.issued == [(wg, e) for e in range(self.n + 1) for wg in (0, 1)], self.issued
        named = self.named + self.named_releases
        assert all(not b.counted for b in named), "a named barrier is left with a warpgroup counted in"


@pytest.mark.parametrize("turns", ["mbarrier", "named_release"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_forward_turns_protocol(turns, stages):
    for n in (1, 2, 3, 4, 7, 10):
        for seed in range(25):
            Protocol(turns, n, stages, random.Random(seed * 131 + n)).run()


def test_the_model_fails_an_unbalanced_named_turn(monkeypatch):
    """Warpgroup 1 arriving after its last turn too leaves warpgroup 0's barrier counted: the model must catch it."""

    def always(self, wg, e):
        self.named[1 - wg].arrive(wg)

    monkeypatch.setattr(Protocol, "hand_off", always)
    with pytest.raises(AssertionError, match="left with a warpgroup counted"):
        Protocol("named_release", 3, 3, random.Random(0)).run()


def test_the_model_fails_a_named_release_of_the_last_blocks(monkeypatch):
    """Releasing every block through its named barrier, also those the producer never waits for, leaves the
    barriers counted at the end: the model must catch it."""

    def every(self, wg, block):
        self.named_releases[block % self.stages].arrive(wg)

    monkeypatch.setattr(Protocol, "release", every)
    with pytest.raises(AssertionError, match="left with a warpgroup counted|counted twice"):
        Protocol("named_release", 5, 3, random.Random(0)).run()


def test_the_model_fails_a_stage_refilled_too_early(monkeypatch):
    """A producer that refills each stage without waiting for its release: the model must catch it."""

    def early(self):
        for it in range(self.n):
            yield from self.load("k", it % self.stages, it)
            yield from self.load("v", it % self.stages, it)

    monkeypatch.setattr(Protocol, "producer", early)
    with pytest.raises(AssertionError, match="refilled while|reads [kv] block"):
        for seed in range(50):
            Protocol("mbarrier", 6, 3, random.Random(seed)).run()
