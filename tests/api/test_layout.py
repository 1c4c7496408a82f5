"""The tests mirror the package: every test module sits in one of the folders ``tests/conftest.py`` describes, none
at the root of tests/, and each folder is a package (so that two folders may hold modules of the same name)."""

from __future__ import annotations

from tests.helpers import REPO

TESTS = REPO / "tests"
FOLDERS = {"mask", "kernels", "api", "distributed", "tools", "stress"}


def test_no_test_module_at_the_root():
    stray = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not stray, f"test modules at the root of tests/: {stray}; move each into one of {sorted(FOLDERS)}"


def test_test_modules_sit_in_the_described_folders():
    found = {p.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts}
    assert found <= FOLDERS, f"test folders not in tests/conftest.py's layout: {sorted(found - FOLDERS)}"
    for folder in FOLDERS:
        assert (TESTS / folder / "__init__.py").is_file(), folder
    assert (TESTS / "__init__.py").is_file()
    conftest = (TESTS / "conftest.py").read_text()
    assert all(f"  {folder}/ " in conftest for folder in FOLDERS), "conftest.py's docstring names every folder"
