"""The built wheel: numpy declared (Triton's interpreter imports it), the license and py.typed shipped, and nothing
but the package: not the benchmark, the developer tools or the tests, though they are packages beside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO


def test_wheel_declares_numpy_and_ships_license_and_py_typed(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__}: the build needs >= 77 (SPDX license expression)")
    # A copy of what the build reads, so that its build/ and egg-info land in tmp_path, not in the checkout; no build
    # isolation: the installed setuptools builds it, offline.
    src = tmp_path / "src"
    for package in ("mmsparse", "benchmarks", "tools", "tests"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
           "-w", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("mmsparse-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_text = z.read(next(n for n in names if n.endswith("/LICENSE"))).decode()
    assert "mmsparse/py.typed" in names
    assert {n.split("/")[0] for n in names} == {"mmsparse", wheel.name.split("-py")[0] + ".dist-info"}, names
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("numpy") for r in requires), requires
    assert any(r.startswith("einops") for r in requires), requires
    assert "License-Expression: Apache-2.0" in metadata
