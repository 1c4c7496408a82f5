"""Where a run happened: GPU, versions, commit, and the folder name of a GPU's records."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def environment(device: Any) -> dict[str, str]:
    """``gpu``, ``torch``, ``triton`` and ``commit`` of this process, for every record's provenance."""
    return {**versions(device), "commit": git_commit()}


def versions(device: Any) -> dict[str, str]:
    """``gpu``, ``torch`` and ``triton`` of this process."""
    import torch
    import triton

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"cpu ({platform.machine()}, Triton interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__}


def git_commit(repo: Path = REPO_DIR) -> str:
    """HEAD of a checkout, ``+dirty`` when tracked files differ from it. MMSPARSE_COMMIT overrides it for copies
    without ``.git`` (e.g. a GPU machine that receives the working tree)."""
    if os.environ.get("MMSPARSE_COMMIT"):
        return os.environ["MMSPARSE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_slug(gpu: str) -> str:
    """A short folder name for a device name: ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA H200`` -> ``h200``,
    a CPU -> ``cpu``."""
    name = gpu.lower()
    if name.startswith("cpu"):
        return "cpu"
    name = re.sub(r"^nvidia\s+", "", name)
    model = re.search(r"\b[a-z]+\d+[a-z]*\b", name)  # the first model-like token: h100, a100, l40s
    if model:
        return model.group(0)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def results_dir(gpu: str) -> Path:
    """``benchmarks/results/<gpu-slug>``: every record of one GPU, current only."""
    return RESULTS_DIR / gpu_slug(gpu)


def record_dir(gpu: str, topic: str, smoke: bool = False) -> Path:
    """Where a run writes its record when not given ``--out``: :func:`results_dir` of a GPU; for a run on a CPU (the
    interpreter's times say nothing of the kernels) or a smoke run (``smoke``: e.g. ``--tiny`` shapes), a new
    temporary folder, so that only GPU records land in the repository."""
    if smoke or gpu_slug(gpu) == "cpu":
        return Path(tempfile.mkdtemp(prefix=f"mmsparse-{topic}-"))
    return results_dir(gpu)
