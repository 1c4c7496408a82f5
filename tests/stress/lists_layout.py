"""Run a case with packed (CSR) block lists, the layout large masks get, at the small sizes of the fuzzer and the
sanitizer (which would otherwise always get fixed slots)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mmsparse
from mmsparse.mask import block_lists


@contextlib.contextmanager
def lists_layout(packed: bool) -> Iterator[None]:
    """Masks built inside get packed lists when ``packed`` (fixed slots otherwise, at these sizes), and are not
    cached beyond it: mmsparse's caches are cleared on the way in (no mask built before is reused inside) and on
    the way out (no later case reuses one built inside)."""
    saved = block_lists.COMPACT_BYTES
    block_lists.COMPACT_BYTES = 0 if packed else saved
    mmsparse.clear_caches()
    try:
        yield
    finally:
        block_lists.COMPACT_BYTES = saved
        mmsparse.clear_caches()
