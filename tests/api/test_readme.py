"""Every Python block of README.md and docs/*.md runs as written, and the README's tile picture is what the code draws.

A block sets its own sizes, small enough for Triton's interpreter on a CPU, and picks its device with DEVICE_LINE,
so it runs unchanged on a CPU and on a GPU. A block may name "cuda" only in that line and in a ``dtype = ...`` line.
A docs block preceded by a ``<!-- not run: why -->`` line is skipped; every README block runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

import mmsparse
from tests.helpers import CYCLIC, REPO

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
DEVICE_LINE = 'device = "cuda" if torch.cuda.is_available() else "cpu"'
NOT_RUN = "<!-- not run:"


def python_blocks(path: Path) -> list[tuple[str, str, bool]]:
    """(id, source, runs) of each ```python block of a markdown file; the id from the file and the heading above."""
    prefix = "" if path == README else f"{path.stem}-"
    blocks, heading, counts = [], "top", {}
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            heading = re.sub(r"[^a-z0-9]+", "-", lines[i][3:].split(":")[0].lower()).strip("-")
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            counts[heading] = counts.get(heading, 0) + 1
            runs = not (i > 0 and lines[i - 1].startswith(NOT_RUN))
            blocks.append((f"{prefix}{heading}-{counts[heading]}", "\n".join(lines[i + 1 : end]), runs))
            i = end
        i += 1
    return blocks


BLOCKS = [block for path in DOCS for block in python_blocks(path)]


def test_readme_has_its_python_blocks():
    readme = python_blocks(README)
    ids = [name for name, _, _ in readme]
    assert len(ids) >= 3 and all(i.startswith("usage") for i in ids[:3]), ids
    assert all(runs for _, _, runs in readme), "every README block runs"


@pytest.mark.parametrize("source,runs", [(s, r) for _, s, r in BLOCKS], ids=[name for name, _, _ in BLOCKS])
def test_block_runs(source, runs):
    if not runs:
        pytest.skip("marked as not run")
    if "transformers" in source:
        pytest.importorskip("transformers")
    for number, line in enumerate(source.splitlines(), 1):
        named = "cuda" in line and line != DEVICE_LINE and not line.startswith("dtype = ")
        assert not named, f"line {number} names the GPU outside the device and dtype lines: {line!r}"
    if "cuda" in source:
        assert DEVICE_LINE in source.splitlines(), f"a block that may use the GPU picks it with {DEVICE_LINE!r}"
    group_before = dist.is_available() and dist.is_initialized()
    try:
        exec(compile(source, "block", "exec"), {"__name__": "doc_block"})
    finally:  # a block that starts a process group of one leaves it behind; other tests expect none
        if dist.is_available() and dist.is_initialized() and not group_before:
            dist.destroy_process_group()


def test_readme_picture_is_what_tile_picture_draws():
    text = README.read_text()
    match = re.search(r"```text\n(block mask at 64x32 tiles.*?)\n```", text, re.S)
    assert match, "the README shows the seed's tiles at 64x32"
    assert 'tile_picture(topology, seg_lens, tile="64x32")' in text
    assert match.group(1) == mmsparse.tile_picture(CYCLIC, (50, 375, 500), tile="64x32")


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_python_block_is_found(path):
    assert len(python_blocks(path)) == path.read_text().count("```python\n")


def test_readme_says_what_the_main_command_exits_with_and_the_keyword_names():
    """The exit status as ``python -m mmsparse --help`` states it, and, where the README likens mbs_attention to
    SDPA, that its keywords are softmax_scale and causal, not SDPA's scale and is_causal."""
    text = README.read_text()
    assert "exits 1 if an error exceeds its tolerance" in text and "passes its tolerance" not in text
    assert "`softmax_scale=` (not `scale=`)" in text and "`causal=True` (not `is_causal=`)" in text
