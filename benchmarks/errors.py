"""How a row records what went wrong."""

from __future__ import annotations


class Skip(Exception):
    """An implementation that cannot run this config by design (recorded with its reason, not as a failure)."""


class DeviceLost(Exception):
    """The CUDA context is unusable (e.g. after an illegal memory access): nothing more can run in this process."""


def short_error(exc: BaseException, limit: int = 400) -> str:
    """The exception's type and first line, at most ``limit`` characters."""
    first = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {first[0] if first else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
