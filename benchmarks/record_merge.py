"""One benchmark record measured over several runs (``python -m benchmarks --update``): a machine whose calls are too
short for every config at once runs them in parts, each config's rows still side by side in one process, and each
part replaces its configs' rows in the record the earlier parts wrote. Only parts of one commit, GPU, torch and
Triton make one record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .configs import ALL_CONFIGS

PROVENANCE = ("gpu", "torch", "triton", "commit")


def rows_kept(path: Path, env: dict[str, str], configs: set[str]) -> list[dict[str, Any]]:
    """The rows of the record at ``path`` (none where there is no record yet) that this run does not measure again
    (its ``configs``). Raises SystemExit, saying why, where the record ran on another commit, GPU or versions, or
    where this run's commit does not name its code (a tree with uncommitted changes: set MMSPARSE_COMMIT)."""
    commit = env["commit"]
    if commit == "unknown" or commit.endswith("+dirty"):
        raise SystemExit(f"--update merges runs of one commit, but this tree's is {commit!r}: commit the changes, or "
                         "name the commit this copy holds in MMSPARSE_COMMIT")
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    for row in rows:
        for key in PROVENANCE:
            if row.get(key) != env[key]:
                raise SystemExit(f"--update: {path} has rows of {key} {row.get(key)!r} (config {row.get('config')}), "
                                 f"this run's is {env[key]!r}; one record holds one commit, GPU and versions: run its "
                                 "configs again, or write a new record without --update")
    return [row for row in rows if row["config"] not in configs]


def merged(kept: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``kept`` and this run's ``rows`` in the configs' order (``benchmarks.configs.ALL_CONFIGS``); each config's
    rows keep their own order."""
    order = {name: i for i, name in enumerate(ALL_CONFIGS)}
    return sorted([*kept, *rows], key=lambda row: order.get(row["config"], len(order)))
