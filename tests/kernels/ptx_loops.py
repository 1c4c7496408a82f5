"""The synchronisation in the steady-state loops of a Gluon kernel's PTX, counted per iteration.

A loop is a label that later branches jump back to; LLVM lays a loop's blocks out between its header and its last
back edge, so the instructions in between are one iteration (a block of a nested loop counts once, a conditional
block as if taken), though not necessarily in the order they run: LLVM may rotate a loop, so an iteration's text
can start anywhere in its cycle.
``matmul_loops`` keeps the loops that commit ``commits`` wgmma groups an iteration (the forward's consumer loop
commits two: Q K^T and P V).
"""

from __future__ import annotations

import re
from collections import Counter

_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
# instruction -> the key it is counted under; named barriers keep their id ("reg" if in a register) and thread count
_KINDS = [
    (re.compile(r"^(?:@%p\d+\s+)?(bar\.sync|bar\.arrive|barrier\.sync|barrier\.arrive)\s+(\d+|%r\d+)(?:,\s*(\d+))?;"),
     None),
    (re.compile(r"mbarrier\.arrive(?:\.release)?(?:\.cta)?\.shared(?:::cta)?\.b64"), "mbarrier.arrive"),
    (re.compile(r"mbarrier\.try_wait"), "mbarrier.try_wait"),
    (re.compile(r"wgmma\.commit_group"), "wgmma.commit_group"),
    (re.compile(r"wgmma\.mma_async"), "wgmma.mma_async"),
]


def _kind(stmt: str) -> str | None:
    for pattern, name in _KINDS:
        m = pattern.search(stmt)
        if m:
            if name is not None:
                return name
            op, bar, threads = m.groups()
            bar = "reg" if bar.startswith("%") else bar  # an id in a register
            return f"{op.replace('barrier.', 'bar.')} {bar}" + (f", {threads}" if threads else "")
    return None


def loop_syncs(ptx: str) -> dict[str, list[str]]:
    """Per loop header label, the synchronisation instructions (and wgmmas) between the header and its last back
    edge, in text order."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans: dict[str, tuple[int, int]] = {}
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            start = labels[m.group(1)]
            spans[m.group(1)] = (start, i)  # the last back edge wins
    loops = {}
    for label, (start, end) in spans.items():
        kinds = (_kind(line) for line in lines[start : end + 1] if not line.startswith("//"))
        loops[label] = [k for k in kinds if k is not None]
    return loops


def matmul_loops(ptx: str, commits: int = 2) -> list[list[str]]:
    """The loops that commit ``commits`` wgmma groups an iteration: their instructions as :func:`loop_syncs`."""
    return [seq for seq in loop_syncs(ptx).values() if seq.count("wgmma.commit_group") == commits]


def counts(seq: list[str]) -> Counter:
    """How often each instruction kind occurs in one loop's sequence (wgmma.mma_async left out)."""
    return Counter(k for k in seq if k != "wgmma.mma_async")


_PREDICATE = re.compile(r"^@!?%p\d+\s+")


def shared_loads_before_exponentials(ptx: str) -> int:
    """How many times a shared-memory load stands between a wgmma wait and the first exponential after it (a load
    whose latency the exponentials then wait for once the matmul is done), in text order."""
    count, waiting, loaded = 0, False, False
    for line in ptx.splitlines():
        stmt = _PREDICATE.sub("", line.strip())
        if stmt.startswith("wgmma.wait_group"):
            waiting, loaded = True, False
        elif waiting and stmt.startswith("ld.shared"):
            loaded = True
        elif waiting and stmt.startswith("ex2.approx"):
            count += loaded
            waiting = False
    return count
