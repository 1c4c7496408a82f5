"""Test set-up for every test below tests/: Triton's interpreter when there is no GPU (before triton is imported),
NaN-poisoned outputs, the GPU memory each test leaves cached handed back, the ``device`` and ``launches`` fixtures,
and the skips of the ``gpu``, ``hopper``, ``large`` and ``interpreter`` markers.

Where the tests are (they mirror the package; no test file sits at the root of tests/):
  mask/         mmsparse/mask: lengths, segment codes, the torch tile classes, the list builders and token bits
                against their torch references
  kernels/      the Triton and Gluon kernels against the float64 reference: attention, pair types, dropout,
                decoding, launch plans and keys, streams, the Hopper kernels and their PTX, GPU-only and past-2^31
                sizes
  api/          the public entry points end to end: arguments, input errors and limits, real batches, nn and
                Hugging Face layers, the CLI, torch.compile, pickling, threads, the references; and the repository
                as a whole: import layers and cycles, this layout, packaging, the README's and docs' blocks and links
  distributed/  context parallelism: the plan, and ContextParallel against one process
  tools/        the benchmark (benchmarks/) and the developer tools (tools/): harness, configs, baselines, A/B,
                ncu tables, the context-parallel model, local timings and multi-GPU runs (on CPU where they can)
  stress/       the stress tools themselves (fuzz, sanitize, soak, shared_gpu, cold_runs; README.md there) and
                their CPU smoke tests, marked ``stress``
helpers.py holds what several modules share (topologies, cases, the float64 checks), poison.py the NaN-poisoned
``torch.empty``, ``empty_strided`` and ``empty_like`` (shared with the stress tools), interpreter.py the interpreter
mapped once per launch, without the overflow checks it discards, with its dtype table built once and bfloat16
widened by a shift (child_site/ gives the processes the tests start the same); no test module imports another."""

import collections
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.interpreter import (  # noqa: E402
    patch_once_per_launch,
    shift_bf16_casts,
    skip_discarded_overflow_checks,
    table_np_dtypes,
)
from tests.poison import poisoned_empty  # noqa: E402

CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_once_per_launch()
    skip_discarded_overflow_checks()
    table_np_dtypes()
    shift_bf16_casts()
    # every Python process a test starts runs child_site/sitecustomize.py, which patches its interpreter as well
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (CHILD_SITE, os.environ.get("PYTHONPATH"))))


@pytest.fixture(scope="session", autouse=True)
def poison_empty():
    """Every ``torch.empty``, ``empty_strided`` and ``empty_like`` of the test session is NaN-poisoned
    (``tests/poison.py``)."""
    with poisoned_empty():
        yield


@pytest.fixture(autouse=True)
def return_cached_gpu_memory():
    """After each test the CUDA caching allocator's unused blocks go back to the driver: pytest-xdist's workers
    share one GPU, and what one worker's allocator keeps from its last float64 reference (tens of GiB) otherwise
    leaves another worker's test, or the fresh process a test starts, out of memory."""
    yield
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def launches(monkeypatch):
    """Kernel name -> launches, counted at FastKernel.launch (through the interpreter every launch goes there; on a
    GPU bound relaunches skip it); the launch itself runs with no torch dispatch mode on."""
    from torch.utils._python_dispatch import _disable_current_modes

    from mmsparse.runtime import launch

    counted: collections.Counter[str] = collections.Counter()
    real = launch.FastKernel.launch

    def counting(self, grid, args, kwargs):
        counted[self.fn.fn.__name__] += 1
        with _disable_current_modes():
            return real(self, grid, args, kwargs)

    monkeypatch.setattr(launch.FastKernel, "launch", counting)
    return counted


def _on_hopper() -> bool:
    from mmsparse.attention.dispatch import hopper_gluon_available

    return hopper_gluon_available(torch.cuda.current_device())


def pytest_collection_modifyitems(config, items):
    """``gpu``, ``hopper`` and ``large`` tests skip without CUDA; ``hopper`` ones also off sm_90 or without Gluon;
    ``large`` ones (slow) unless asked for by ``-m large`` or ``MMSPARSE_LARGE=1``; ``interpreter`` ones (kernels on
    CPU tensors through Triton's interpreter, which this file turns on only without CUDA) skip where CUDA is
    available. ``long_module`` modules come first (in their own order): pytest-xdist hands files out in this order,
    so the longest start at once."""
    items.sort(key=lambda item: item.get_closest_marker("long_module") is None)
    cuda = torch.cuda.is_available()
    large = "large" in (config.option.markexpr or "") or os.environ.get("MMSPARSE_LARGE") == "1"
    hopper = cuda and any(item.get_closest_marker("hopper") for item in items) and _on_hopper()
    for item in items:
        marks = {m for m in ("gpu", "hopper", "large") if item.get_closest_marker(m)}
        if marks and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        elif "hopper" in marks and not hopper:
            item.add_marker(pytest.mark.skip(reason="needs an sm_90 GPU and Triton's Gluon API"))
        elif "large" in marks and not large:
            item.add_marker(pytest.mark.skip(reason="slow: run with -m large or MMSPARSE_LARGE=1"))
        if cuda and item.get_closest_marker("interpreter"):
            item.add_marker(pytest.mark.skip(reason="runs kernels on CPU tensors through Triton's interpreter, which "
                                                    "the test session turns on only without a GPU"))
