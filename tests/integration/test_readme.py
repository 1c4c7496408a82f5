"""Every Python block of README.md runs as written, with the sizes and device it sets at its top made small.

A block starts with its imports and the assignments of its sizes, device and dtype (``B, Hq, Hkv, D = ...``,
``device = "cuda"``). The test replaces the values of those names found in SMALL and runs the rest unchanged, so a
block that does not run as written fails here. A block may name "cuda" only in that header.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch
from helpers import REPO

README = REPO / "README.md"

# Small values for the names a block sets at its top. Shapes keep what the blocks rely on (Hq a multiple of Hkv,
# E a multiple of H with E / H in [16, 256], two rows for two samples), with ragged lengths against the tiles.
SMALL = {
    "device": "cuda" if torch.cuda.is_available() else "cpu",
    "dtype": torch.float32,
    "B": 2,
    "Hq": 2,
    "Hkv": 1,
    "D": 16,
    "E": 32,
    "H": 2,
    "seg_lens": (5, 20, 15),
    "rows": [(5, 20, 15), (4, 9, 0)],
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "kv_heads": 1,
    "vocab": 64,
}


def python_blocks() -> list[tuple[str, str]]:
    """(id, source) of each ```python block, the id from the section heading above it."""
    blocks, heading, counts = [], "top", {}
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            heading = re.sub(r"[^a-z0-9]+", "-", lines[i][3:].split(":")[0].lower()).strip("-")
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            counts[heading] = counts.get(heading, 0) + 1
            blocks.append((f"{heading}-{counts[heading]}", "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


def header_length(tree: ast.Module) -> int:
    """Number of leading top-level imports and settings (assignments that call nothing)."""
    n = 0
    for node in tree.body:
        setting = isinstance(node, ast.Assign) and not any(isinstance(c, ast.Call) for c in ast.walk(node.value))
        if not (setting or isinstance(node, (ast.Import, ast.ImportFrom))):
            break
        n += 1
    return n


def shrink(source: str) -> tuple[str, set[str]]:
    """The block with the values of SMALL's names replaced in its header; also the names replaced."""
    tree = ast.parse(source)
    replaced = set()
    for node in tree.body[: header_length(tree)]:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in SMALL:
            node.value = ast.Name(id=f"__small_{target.id}", ctx=ast.Load())
            replaced.add(target.id)
        elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            for j, elt in enumerate(target.elts):
                if isinstance(elt, ast.Name) and elt.id in SMALL:
                    node.value.elts[j] = ast.Name(id=f"__small_{elt.id}", ctx=ast.Load())
                    replaced.add(elt.id)
    return ast.unparse(ast.fix_missing_locations(tree)), replaced


BLOCKS = python_blocks()


def test_readme_has_its_python_blocks():
    ids = [name for name, _ in BLOCKS]
    assert len(ids) >= 4 and any(i.startswith("usage") for i in ids), ids


@pytest.mark.parametrize("source", [s for _, s in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_block_runs(source):
    if "transformers" in source:
        pytest.importorskip("transformers")
    tree = ast.parse(source)
    header = tree.body[: header_length(tree)]
    header_lines = {n for node in header for n in range(node.lineno, node.end_lineno + 1)}
    for number, line in enumerate(source.splitlines(), 1):
        assert "cuda" not in line or number in header_lines, f"line {number} names the device: {line!r}"
    code, replaced = shrink(source)
    if '"cuda"' in source:
        assert "device" in replaced, "a block that uses the GPU sets device = ... at its top"
    names = {t.id for node in header if isinstance(node, ast.Assign) for t in ast.walk(node.targets[0])
             if isinstance(t, ast.Name)}
    assert names & SMALL.keys() <= replaced, "write sizes as NAME = value or A, B = a, b"
    namespace = {f"__small_{name}": value for name, value in SMALL.items()}
    namespace["__name__"] = "readme_block"
    exec(compile(code, "README.md", "exec"), namespace)


def test_shrink_replaces_header_values_only():
    code, replaced = shrink('import torch\ndevice, B = "cuda", 8\nD = 128\nx = abs(1)\nD = 256\n')
    assert replaced == {"device", "B", "D"}
    assert code.splitlines()[1:] == [
        "device, B = (__small_device, __small_B)", "D = __small_D", "x = abs(1)", "D = 256"
    ]
