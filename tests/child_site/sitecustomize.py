"""Run by every Python process a test starts (tests/conftest.py puts this folder first on the children's
``PYTHONPATH``): where ``TRITON_INTERPRET=1`` is set when the process starts, Triton's interpreter gets the test
process's own patches (``tests/interpreter.py``) right after ``import triton`` finishes. Nothing is imported before
the process itself imports triton, so import order behaves as without this file; a patch that cannot be installed
leaves the interpreter as it is. Context-parallel ranks, tools' children and stress workers then run the same
kernels through the same interpreter as the test process, at its speed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_PATCHES = Path(__file__).resolve().parents[1] / "interpreter.py"


def _install_patches() -> None:
    try:
        spec = importlib.util.spec_from_file_location("_mmsparse_tests_interpreter", _PATCHES)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.patch_once_per_launch()
        module.skip_discarded_overflow_checks()
        module.table_np_dtypes()
        module.shift_bf16_casts()
    except Exception:  # noqa: BLE001 (a child that cannot be patched runs unpatched, only slower)
        pass


class _AfterTritonImport(importlib.abc.MetaPathFinder):
    """Finds ``triton`` as the other finders would, and installs the patches once its module has run."""

    def find_spec(self, name, path, target=None):  # type: ignore[override]
        if name != "triton":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _install_patches()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    sys.meta_path.insert(0, _AfterTritonImport())
