"""Run a case with packed (CSR) block lists, the layout large masks get, at the small sizes of the fuzzer and the
sanitizer (which would otherwise always get fixed slots)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mmsparse
from mmsparse.mask.bit_lists import COMPACT_BYTES


@contextlib.contextmanager
def lists_layout(packed: bool) -> Iterator[None]:
    """Masks built inside get packed lists when ``packed`` (fixed slots otherwise, at these sizes), and are
    forgotten on both sides: a later case must not reuse them."""
    mmsparse.clear_caches()
    try:
        with mmsparse.tuning.use_tuning(compact_bytes=0 if packed else COMPACT_BYTES):
            yield
    finally:
        mmsparse.clear_caches()
