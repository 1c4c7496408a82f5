"""Run a case with packed (CSR) block lists, the layout large masks get, at the small sizes of the fuzzer and the
sanitizer (which would otherwise always get fixed slots)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mmsparse.functional
from mmsparse.mask import block_lists


@contextlib.contextmanager
def lists_layout(packed: bool) -> Iterator[None]:
    """Masks built inside get packed lists when ``packed`` (fixed slots otherwise, at these sizes), and are not
    cached: a later case must not reuse them."""
    saved, cache = block_lists.COMPACT_BYTES, mmsparse.functional._INFO_CACHE
    block_lists.COMPACT_BYTES = 0 if packed else saved
    mmsparse.functional._INFO_CACHE = type(cache)()
    try:
        yield
    finally:
        block_lists.COMPACT_BYTES, mmsparse.functional._INFO_CACHE = saved, cache
