"""Whether a change left the kernels' machine code alone: compile them for sm_90 from two trees, compare the PTX.

    python -m tools.ptx_diff compile REF_OR_DIR OUT [--sets gluon,one_pass,tl] [--only SUBSTRING]
    python -m tools.ptx_diff compile . OUT          # this working tree
    python -m tools.ptx_diff diff BEFORE AFTER      # one line per kernel: same / differs / only in one

No GPU is needed: Triton's compiler and ptxas ship with the wheel. ``compile`` writes one PTX file per kernel variant
into ``OUT/<set>/``, each set compiled in a child process that imports mmsparse from the tree (a folder with
``mmsparse/`` in it, or a git ref, exported with ``git archive``: see ``tools.ab``), without TRITON_INTERPRET and
with a Triton cache of its own (a warm cache would hand back PTX compiled from other sources):

- ``gluon``: the Gluon variants of the tree's tests/kernels/test_gluon_compiles.py (the config's tiles and more);
- ``one_pass``: the tl one-pass variants of the tree's tests/kernels/test_one_pass_compiles.py;
- ``tl``: the tl forward, combine, delta, dQ and dK/dV kernels of tools/ptx_tl.py's cases (this checkout's list,
  run against the tree's launchers).

``diff`` compares the files of the same name after dropping what only says where the source was: ``.loc`` and
``.file`` lines, the debug labels and sections, and ``//`` comments. A kernel that lost unused parameters (an
argument removed from its signature and its launch) has a shorter parameter list and renumbered parameter names, and
nothing else different: ``diff`` reports it as the same code with the parameters it lost, only where the remaining
parameters keep their order and types. Its exit status is 1 if any kernel differs, else 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETS = ("gluon", "one_pass", "tl")
COMPILE_TIMEOUT_S = 3600


def _set_command(name: str, tree: Path, out: Path, only: str) -> list[str]:
    """The child process that compiles one set of ``tree`` into ``out``."""
    scripts = {"gluon": tree / "tests" / "kernels" / "test_gluon_compiles.py",
               "one_pass": tree / "tests" / "kernels" / "test_one_pass_compiles.py",
               "tl": HERE / "ptx_tl.py"}
    return [sys.executable, str(scripts[name]), str(out), only]


def compile_tree(tree: Path, out: Path, sets: tuple[str, ...] = SETS, only: str = "") -> None:
    """Compile ``sets`` of the tree at ``tree`` into ``out/<set>/``, one PTX file per kernel variant whose name
    contains ``only``."""
    for name in sets:
        folder = out / name
        cache = out / f".cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(tree), TRITON_CACHE_DIR=str(cache))
        proc = subprocess.run(_set_command(name, tree, folder, only), cwd=tree, env=env, capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        shutil.rmtree(cache, ignore_errors=True)
        if proc.returncode:
            raise RuntimeError(f"compiling {name} of {tree} failed:\n{proc.stderr[-4000:]}")
        print(f"{name}: {len(list(folder.glob('*.ptx')))} kernels compiled from {tree}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Comparing


_DEBUG_LABEL = re.compile(r"\$L__(?:tmp|func_begin|func_end)\d+:")
_PARAM = re.compile(r"\b([A-Za-z_]\w*)_param_(\d+)\b")
_PARAM_DECL = re.compile(r"\.param\s+(.*?)\s*\b[A-Za-z_]\w*_param_(\d+)(\[\d+\])?,?$")


def code_lines(ptx: str) -> list[str]:
    """The PTX's code: no source locations (``.loc``, ``.file``), debug labels, debug sections or comments."""
    lines = []
    for line in ptx.splitlines():
        code = line.split("//", 1)[0].rstrip()
        stripped = code.strip()
        if stripped.startswith(".section") and ".debug" in stripped:
            break  # the debug sections close the file
        if not stripped or stripped.startswith((".loc", ".file")) or _DEBUG_LABEL.fullmatch(stripped):
            continue
        lines.append(code)
    return lines


@dataclass(frozen=True)
class Params:
    """A kernel's parameter declarations (index -> type) and its code with every parameter renamed ``P<k>`` in
    the order the code first uses them."""

    types: dict[int, str]
    used: list[int]  # parameter indices in the order of first use
    code: list[str]


def split_params(lines: list[str]) -> Params:
    types: dict[int, str] = {}
    rest = []
    for line in lines:
        decl = _PARAM_DECL.search(line.strip())
        if decl and line.strip().startswith(".param"):
            types[int(decl.group(2))] = decl.group(1) + (decl.group(3) or "")
        else:
            rest.append(line)
    used: list[int] = []
    for line in rest:
        for m in _PARAM.finditer(line):
            if int(m.group(2)) not in used:
                used.append(int(m.group(2)))
    order = {index: k for k, index in enumerate(used)}
    code = [_PARAM.sub(lambda m: f"P{order[int(m.group(2))]}", line) for line in rest]
    return Params(types, used, code)


def _ranks(values: list[int]) -> list[int]:
    return sorted(range(len(values)), key=values.__getitem__)


def compare(before: str, after: str) -> str:
    """``same``; ``same code, ...`` (parameters no code used are gone, the others keep their order and types);
    or ``differs (...)`` with the first code line that differs (past the parameter declarations, and with the
    parameters renamed by use, where their number changed)."""
    a, b = code_lines(before), code_lines(after)
    if a == b:
        return "same"
    pa, pb = split_params(a), split_params(b)
    # the k-th parameter used before is the k-th used after, and the used ones keep their relative order
    kept_order = len(pa.used) == len(pb.used) and _ranks(pa.used) == _ranks(pb.used)
    if pa.code == pb.code and kept_order and [pa.types[i] for i in pa.used] == [pb.types[i] for i in pb.used]:
        return (f"same code, parameters {len(pa.types)} -> {len(pb.types)} (the {len(pa.used)} it reads keep their "
                f"order and types)")
    if len(pa.types) != len(pb.types):  # past the declarations, with the parameters renamed by use
        a, b, where = pa.code, pb.code, f"parameters {len(pa.types)} -> {len(pb.types)}, and "
    else:
        where = ""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"differs ({where}code line {first + 1}: {a[first].strip() if first < len(a) else '<end>'!r} -> "
            f"{b[first].strip() if first < len(b) else '<end>'!r})")


def diff_folders(before: Path, after: Path) -> list[tuple[str, str]]:
    """``(kernel, verdict)`` for every PTX file under either folder (``set/name``), sorted."""
    names = sorted({str(p.relative_to(root).with_suffix("")) for root in (before, after) for p in root.rglob("*.ptx")})
    rows = []
    for name in names:
        a, b = before / f"{name}.ptx", after / f"{name}.ptx"
        if not b.exists():
            rows.append((name, "only before"))
        elif not a.exists():
            rows.append((name, "only after"))
        else:
            rows.append((name, compare(a.read_text(), b.read_text())))
    return rows


def _tree(spec: str, scratch: Path) -> Path:
    from .ab import resolve_tree

    return resolve_tree(None if spec == "." else spec, scratch).path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ptx_diff", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile a tree's kernels into a folder")
    comp.add_argument("tree", help="a folder with mmsparse/ in it, a git ref, or . (this working tree)")
    comp.add_argument("out", type=Path)
    comp.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    comp.add_argument("--only", default="", help="only the variants whose name contains this")
    dif = sub.add_parser("diff", help="compare two compiled folders")
    dif.add_argument("before", type=Path)
    dif.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "compile":
        sets = tuple(s for s in args.sets.split(",") if s)
        unknown = set(sets) - set(SETS)
        if unknown:
            parser.error(f"--sets takes {', '.join(SETS)}; got {sorted(unknown)}")
        with tempfile.TemporaryDirectory() as scratch:
            compile_tree(_tree(args.tree, Path(scratch)), args.out.resolve(), sets, args.only)
        return 0
    rows = diff_folders(args.before, args.after)
    for name, verdict in rows:
        print(f"{name}: {verdict}")
    return 1 if any(v.startswith("differs") for _, v in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
