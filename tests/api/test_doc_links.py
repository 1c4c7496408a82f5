"""What README.md, docs/*.md and the READMEs of benchmarks/, tools/ and tests/stress/ point at exists: relative
links (and their #anchors), file paths, python -m modules.

Paths are found anywhere in the text, code blocks included: a token with a slash whose first part is a top-level
entry of the checkout (``mmsparse/attention/plan.py``, ``docs/limits.md``, ``benchmarks/results/h200/ab.md``) must
exist from the root; a shorter path to a file (``gluon/dq.py``, ``results/h200/ab.md``) must exist beside the
document or end some file of the checkout; a bare file name in backticks (``ab_control.md``) must be some file's
name. ``{a,b}`` expands to both and ``<gpu>`` stands for any one name. NOT_YET lists the records that tools write
and the docs name before one is committed.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *(REPO / d / "README.md" for d in ("benchmarks", "tools", "tests/stress"))]
EXTENSIONS = (".py", ".md", ".json", ".png", ".toml", ".txt", ".sh", ".cfg", ".yml", ".yaml")
# Records the docs name as not committed yet (the tools' outputs); remove an entry once its record is committed.
NOT_YET: set[str] = set()

_PART = r"(?:[A-Za-z0-9_.*-]|\{[A-Za-z0-9_.,*-]+\}|<[a-z_]+>)+"
PATH = re.compile(rf"(?<![\w./:<>{{}}-]){_PART}(?:/{_PART})+/?")
BARE = re.compile(r"`([A-Za-z0-9_.-]+(?:\.\{[a-z,]+\}|\.[a-z]+))`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MODULE = re.compile(r"(?:python|torchrun[^\n`]*?)\s-m\s+([A-Za-z_][\w.]*)")
URL = re.compile(r"[a-z]+://\S+")


@cache
def repo_files() -> tuple[str, ...]:
    """The checkout's files, relative to the root (tracked and untracked, minus what git ignores)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        return tuple(sorted(f for f in set(out.split("\n")) - {""} if (REPO / f).exists()))
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return tuple(str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts)


@cache
def repo_dirs() -> frozenset[str]:
    return frozenset(str(parent) for f in repo_files() for parent in Path(f).parents if str(parent) != ".")


def expand(path: str) -> list[str]:
    """``a/{b,c}.md`` -> ``a/b.md``, ``a/c.md``; ``<gpu>`` -> ``*``."""
    match = re.search(r"\{([^}]*)\}", path)
    if match:
        head, tail = path[: match.start()], path[match.end() :]
        return [p for alt in match.group(1).split(",") for p in expand(head + alt + tail)]
    return [re.sub(r"<[a-z_]+>", "*", path)]


def exists(pattern: str, doc: Path, anchored: bool) -> bool:
    """A file or folder matches ``pattern`` from the root, or (not anchored) beside ``doc`` or at the end of a path."""
    pattern = pattern.rstrip("/")
    entries = repo_files() + tuple(repo_dirs())
    if any(fnmatch.fnmatchcase(e, pattern) for e in entries):
        return True
    if anchored:
        return False
    beside = str((doc.parent / pattern).resolve().relative_to(REPO)) if doc.parent != REPO else pattern
    return any(fnmatch.fnmatchcase(e, beside) or fnmatch.fnmatchcase(e, "*/" + pattern) for e in entries)


def top_level() -> set[str]:
    return {f.split("/")[0] for f in repo_files()}


def named_paths(text: str) -> list[tuple[str, bool]]:
    """(path, anchored at the root) for each path-like token that names a file or folder of the checkout."""
    text = URL.sub(" ", text)
    found = []
    for match in PATH.finditer(text):
        token = match.group(0).rstrip(".")
        first = token.split("/")[0]
        if first in top_level():
            found.append((token, True))
        elif token.endswith(EXTENSIONS) or re.search(r"\.\{[a-z,]+\}$", token):
            if not re.fullmatch(r"[A-Z_]+", first):  # DIR/..., RUN_A/...: placeholders in commands
                found.append((token, False))
    for match in BARE.finditer(text):
        name = match.group(1)
        if name.endswith(EXTENSIONS) or "{" in name:
            found.append((name, False))
    return found


def missing_paths(doc: Path) -> list[str]:
    missing = []
    for token, anchored in named_paths(doc.read_text()):
        for path in expand(token):
            if Path(path).name in NOT_YET:
                continue
            if not exists(path, doc, anchored):
                missing.append(path)
    return sorted(set(missing))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or REPO not in dest.parents and dest != REPO:
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    return broken


def module_exists(name: str) -> bool:
    relative = Path(*name.split("."))
    if (REPO / relative.with_suffix(".py")).is_file() or (REPO / relative / "__init__.py").is_file():
        return True
    if name.split(".")[0] in top_level():
        return False  # the checkout's own packages: the file must be there
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_named_paths_exist(doc):
    assert missing_paths(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_resolve(doc):
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_python_m_modules_exist(doc):
    modules = MODULE.findall(doc.read_text())
    assert [m for m in modules if not module_exists(m)] == []


def test_the_checks_see_what_they_check():
    """The patterns find paths, links and modules of each kind, and a wrong one fails."""
    readme = REPO / "README.md"
    text = readme.read_text()
    paths = {p for p, _ in named_paths(text)}
    assert {"benchmarks/results/h200/latest.md", "tests/api/test_layers.py", "docs/limits.md"} <= paths, paths
    assert "benchmarks.cp_nccl" in MODULE.findall(text)
    assert "docs/limits.md" in LINK.findall(text)
    doc = REPO / "docs" / "limits.md"
    assert named_paths("see `mmsparse/attention/plann.py` and gluon/dqq.py") == [
        ("mmsparse/attention/plann.py", True), ("gluon/dqq.py", False)]
    assert not exists("mmsparse/attention/plann.py", doc, True)
    assert exists("mmsparse/attention/plan.py", doc, True)
    assert exists("gluon/dq.py", doc, False) and not exists("gluon/dqq.py", doc, False)
    assert exists("../benchmarks/results/h200/ab.md", doc, False)
    assert expand("results/<gpu>/latest.{json,md}") == ["results/*/latest.json", "results/*/latest.md"]
    assert not module_exists("benchmarks.cp_ncc") and module_exists("benchmarks.cp_nccl")
    assert slug("Block-list memory") == "block-list-memory" and slug("The plan (`x.py`)") == "the-plan-xpy"
