"""No import cycle anywhere in the repository: between the modules of mmsparse/, benchmarks/, tools/ and tests/,
no module imports itself through others; and benchmarks/ imports neither tools/ nor tests/. Imports inside
functions and under ``TYPE_CHECKING`` count too (a cycle that only type checking walks still ties two modules
together).

Read from the source with ``ast``, so nothing is imported to check it. A module's edges go to the modules it names
(``from a import b`` names the module ``a.b`` when there is one, else ``a``); the parent packages Python runs on
the way are not edges, since every import passes through them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.imports import imported, module_files

PACKAGES = ("mmsparse", "benchmarks", "tools", "tests")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; a module importing
    itself is not an edge here."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = module_files(root, packages)
    known = set(files)
    return {module: imported(module, path, known) for module, path in files.items()}


@pytest.fixture(scope="module")
def repo_graph() -> dict[str, set[str]]:
    """The repository's graph, read once for the module's tests (each reads it, none changes it)."""
    return import_graph()


def test_no_import_cycle(repo_graph):
    found = cycles(repo_graph)
    assert not found, "import cycles (break each, e.g. by moving what both need into a module of its own):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_the_benchmark_imports_no_tool(repo_graph):
    """The dependencies run one way: tools/ and the stress tools use the benchmark's harness, never the reverse."""
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in repo_graph.items()
        if module.startswith("benchmarks")
        for target in targets
        if target.startswith(("tools", "tests"))
    )
    assert not upward, "\n".join(upward)


def test_the_check_sees_a_cycle(tmp_path, repo_graph):
    """A cycle through a relative import under TYPE_CHECKING, and one through ``from package import module``, are
    found; the repository's real edges are seen (a check that sees nothing passes)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n")
    (pkg / "sub" / "c.py").write_text("def h():\n    from pkg import d\n")
    (pkg / "d.py").write_text("from .sub import c\n")
    (pkg / "e.py").write_text("import pkg.a\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub.c"]]
    graph = repo_graph
    assert "benchmarks.impl" in graph["benchmarks.check"] and "tests.helpers" in graph["tests.api.test_layers"]
    assert "mmsparse.attention.plan" in graph["tests.stress.fuzz"] and "benchmarks.cp_cases" in graph["tools.cp_plan"]
