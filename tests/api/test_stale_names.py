"""No source file or document names the package the launchers moved out of (``mmsparse.ops``, ``ops.dispatch``):
the dispatch is ``mmsparse/attention/dispatch.py``, the launchers ``mmsparse/attention/``. The records under
``benchmarks/results/`` keep what their run saw and are left out."""

from __future__ import annotations

import re

from tests.api.test_doc_links import repo_files
from tests.helpers import REPO

STALE = re.compile(r"mmsparse\.ops\b|\bops\.dispatch\b|mmsparse/ops/")
HISTORY = ("tests/api/test_stale_names.py",)  # this file names them to look for them


def test_nothing_names_the_removed_ops_package():
    named = [f for f in repo_files()
             if f.endswith((".py", ".md")) and not f.startswith("benchmarks/results/") and f not in HISTORY
             and STALE.search((REPO / f).read_text(errors="replace"))]
    assert named == [], f"these files name the removed mmsparse.ops: {named}"


# The removed one-pass variant of the Gluon dK/dV kernel (dQ by TMA bulk reduce-adds from each warpgroup's staging
# tile); the changelog and the performance record say what it was and why it went, and the test of its config field
# names it on purpose.
BULK = re.compile(r"gluon_one_pass|GLUON_ONE_PASS_BULK|one_pass_runs_gluon|bulk_add_dq|stage_ds\b")
BULK_HISTORY = ("CHANGELOG.md", "docs/performance.md", "tests/kernels/test_one_pass.py",
                "tests/api/test_stale_names.py")


def test_nothing_names_the_removed_bulk_one_pass():
    named = [f for f in repo_files()
             if f.endswith((".py", ".md")) and not f.startswith("benchmarks/results/") and f not in BULK_HISTORY
             and BULK.search((REPO / f).read_text(errors="replace"))]
    assert named == [], f"these files name the removed bulk one pass of the Gluon dK/dV kernel: {named}"


# The retired ordered one-pass backward's names (the tl and bulk kernels' ordered adds; the dQ writer's ordered adds,
# ``mask.add_order``, are another kernel's); the files below name them on purpose: the changelog and the performance
# record (what was tried), the usage notes, the message and the test of the removed setting, and this file.
ORDERED = re.compile(r"dq_order|visit_slot|ordered_one_pass|ordered-one-pass|deterministic_backward=")
ORDERED_HISTORY = ("CHANGELOG.md", "docs/performance.md", "docs/usage.md", "mmsparse/attention/config.py",
                   "tests/kernels/test_plan.py", "tests/api/test_stale_names.py")


def test_nothing_names_the_removed_ordered_one_pass():
    named = [f for f in repo_files()
             if f.endswith((".py", ".md")) and not f.startswith("benchmarks/results/") and f not in ORDERED_HISTORY
             and ORDERED.search((REPO / f).read_text(errors="replace"))]
    assert named == [], f"these files name the removed ordered one-pass backward: {named}"
