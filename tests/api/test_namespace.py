"""The package namespace is its public API: ``dir(mmsparse)`` shows no imported helper modules, ``__all__`` lists
every public name it has, and ``__version__`` is the one in pyproject.toml."""

from __future__ import annotations

import re
import types
from pathlib import Path

import mmsparse

ROOT = Path(__file__).resolve().parents[2]


def test_no_foreign_modules_in_the_namespace():
    """Only mmsparse's own subpackages and modules may appear as module objects (imports of them are attributes
    Python sets); ``os``, ``sys``, ``torch`` and the like are imported under a private name or not at all."""
    foreign = [name for name in dir(mmsparse)
               if isinstance(getattr(mmsparse, name), types.ModuleType)
               and not getattr(mmsparse, name).__name__.startswith("mmsparse.")]
    assert foreign == []


PUBLIC_MODULES = {"tuning"}  # submodules the package names as its API


def test_all_is_the_public_api():
    public = {name for name in dir(mmsparse)
              if not name.startswith("_") and not isinstance(getattr(mmsparse, name), types.ModuleType)}
    assert sorted(mmsparse.__all__) == sorted(public | PUBLIC_MODULES)
    assert all(hasattr(mmsparse, name) for name in mmsparse.__all__)


def test_version_matches_pyproject():
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert found is not None and mmsparse.__version__ == found[1]


def test_the_newest_changelog_release_is_the_version():
    """CHANGELOG.md: an "Unreleased" section on top, then the release ``__version__`` names, with its date."""
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert re.fullmatch(rf"{re.escape(mmsparse.__version__)} - \d{{4}}-\d{{2}}-\d{{2}}", headings[1]), headings[:2]
