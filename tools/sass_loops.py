"""Where a compiled kernel spills: its loops in machine code, with their spills and thread-index reads.

    python -m tools.sass_loops DIR [--only SUBSTRING] [--all-loops]

ptxas's report gives a kernel's spill bytes, not where they are: a spill outside the step loop costs nothing, one
inside it costs every step. For each ``.ptx`` file in DIR (as ``python tests/kernels/test_gluon_compiles.py DIR``
and ``python -m tools.ptx_diff compile`` write them) this assembles the PTX with the ptxas Triton ships (for the
PTX's own ``.target``), disassembles it with Triton's nvdisasm, and prints one line per innermost loop that issues
wgmmas (``--all-loops``: every innermost loop): its instructions, wgmmas (``HGMMA``), spill stores and loads
(``STL``, ``LDL``), thread-index reads (``S2R SR_TID``: an address ptxas rebuilds from the thread index rather than
keep it in a register, a short-scoreboard wait in the loop), shared loads (``LDS``) and global loads (``LDG``: the
pair table's, in a segment-code mask's loop without the key block's runs): the loop's code, counted
once, branches a step may skip included. A warp-specialised Gluon kernel's partitions are separate code, so each
consumer warpgroup's step loop is a line of its own. No GPU is needed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# What each column counts: a regular expression over one SASS instruction line.
COUNTED = {
    "hgmma": r"\bHGMMA\b",
    "stl": r"\bSTL\b",
    "ldl": r"\bLDL\b",
    "s2r_tid": r"\bS2R\b.*\bSR_TID",
    "lds": r"\bLDS\b",
    "ldg": r"\bLDG\b",
}
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\((\.L_x_\d+)\)")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")
_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.M)
TOOL_TIMEOUT_S = 300


@dataclass(frozen=True)
class Loop:
    """One loop of a SASS listing: the lines of its head label and of its backward branch, and its counts."""

    first: int
    last: int
    instructions: int
    counts: dict[str, int]


def triton_binary(name: str) -> Path:
    """``ptxas`` (the one Triton assembles sm_90 kernels with: Triton 3.9 ships two, and its PTX needs the newer) or
    ``nvdisasm``, as the installed Triton ships and configures them."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas

    path = Path(get_ptxas(90).path if name == "ptxas" else getattr(knobs.nvidia, name).path)
    if not path.exists():
        raise SystemExit(f"{path} not found: this Triton ships no {name} (an NVIDIA wheel of Triton 3.x does)")
    return path


def disassemble(ptx: Path, work: Path) -> str:
    """The SASS of ``ptx`` assembled for its ``.target`` (sm_90a where it names none)."""
    target = _TARGET.search(ptx.read_text())
    arch = target.group(1) if target else "sm_90a"
    cubin = work / f"{ptx.stem}.cubin"
    subprocess.run([str(triton_binary("ptxas")), f"-arch={arch}", "-O3", str(ptx), "-o", str(cubin)], check=True,
                   capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    done = subprocess.run([str(triton_binary("nvdisasm")), "-c", str(cubin)], check=True, capture_output=True,
                          text=True, timeout=TOOL_TIMEOUT_S)
    return done.stdout


def loops(sass: str, innermost: bool = True) -> list[Loop]:
    """The loops of a SASS listing (nvdisasm -c): a branch back to a label above it closes one. ``innermost``: only
    those with no other loop inside."""
    lines = sass.splitlines()
    labels = {m.group(1): n for n, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = []
    for n, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), n) < n:
            spans.append((labels[m.group(1)], n))
    if innermost:
        spans = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    found = []
    for first, last in sorted(set(spans)):
        body = [line for line in lines[first:last + 1] if _INSTRUCTION.search(line)]
        counts = {name: sum(1 for line in body if re.search(pattern, line)) for name, pattern in COUNTED.items()}
        found.append(Loop(first, last, len(body), counts))
    return found


def report(folder: Path, only: str = "", all_loops: bool = False) -> list[dict]:
    """One row per loop of every kernel in ``folder`` (its ``.ptx`` files whose name holds ``only``)."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ptx in sorted(folder.glob("*.ptx")):
            if only not in ptx.stem:
                continue
            for loop in loops(disassemble(ptx, Path(work))):
                if all_loops or loop.counts["hgmma"]:
                    rows.append({"kernel": ptx.stem, "lines": f"{loop.first}-{loop.last}",
                                 "instructions": loop.instructions, **loop.counts})
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["kernel", "lines", "instructions", *COUNTED]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    out += ["| " + " | ".join(str(row[key]) for key in head) + " |" for row in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a folder of .ptx files")
    p.add_argument("--only", default="", help="only the kernels whose file name holds this")
    p.add_argument("--all-loops", action="store_true", help="every innermost loop, not only those with wgmmas")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"{args.folder} is not a folder of .ptx files")
    rows = report(args.folder, args.only, args.all_loops)
    if not rows:
        print(f"no loop found in {args.folder}'s .ptx files" + (f" named *{args.only}*" if args.only else ""))
        return 1
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
