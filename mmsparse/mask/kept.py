"""Masks of host values, kept for traced graphs: a compiled step whose topology and lengths are host values builds
its mask and block lists once per process, not at every step.

A traced call hands its custom ops the values its mask is made of, as flat ints (``MaskInfo.host_values``, from
:func:`mmsparse.mask.build.host_values_key`; a graph may hold the lengths as symbols, which the ops then read as
numbers), and no mask tensor. The ops find the mask of those values here (:func:`kept_mask`), built when first asked
for, and read its token-level tensors and its tiles' lists as an eager call reads its own mask's: the graph builds
no mask at all, where it would otherwise make the mask's tensors at every step (a few small launches, and the host
work of their allocations).

A kept mask outlives the call that built it and is read on any stream, so it is built on a stream and a thread of
mmsparse's own, never the caller's: under ``torch.compile(mode="reduce-overhead")`` the warm-up allocates all of
the calling thread's memory from a CUDA graph's private pool, whose blocks the graph reuses (and checks). Each
reading stream waits for the builds once, and the tensors are recorded on it, so that their memory is not handed
out again while it still reads them. A capture reads a mask kept before it, as the mask cache's captured masks do
(``torch.cuda.graph`` synchronises before capturing, so what was built is complete), and the graph keeps it alive
(:func:`mmsparse.runtime.capture.keep_while_captured`); nothing is built in a capture.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..runtime.capture import keep_while_captured
from ..runtime.launch import stream_key, stream_of
from ..runtime.recent import RecentlyUsed
from ..runtime.streams import build_stream, on_build_stream
from .build import make_mask_info
from .info import MaskInfo, TileKey
from .topology import Topology

MAX_KEPT = 64


class _Kept:
    __slots__ = ("info", "readers")

    def __init__(self, info: MaskInfo) -> None:
        self.info = info
        self.readers: set[Any] = set()  # streams that waited for every build so far


_KEPT: RecentlyUsed[_Kept] = RecentlyUsed(MAX_KEPT)
_LOCK = threading.Lock()


def kept_mask(key: tuple[int, ...], device: torch.device, tiles: list[TileKey]) -> MaskInfo | None:
    """The mask of ``key`` (``MaskInfo.host_values``) on ``device``, with its fixed-slot block lists at every tile
    of ``tiles`` built, all of it ready to read on the current stream: its token-level tensors and tables
    (``kernel_tensors``) and those lists. Built and kept on first use. During a CUDA-graph capture: the mask as kept
    before it, held for the graph's life, or None where it or one of the lists was not built before it (nothing is
    built in a capture)."""
    if device.type != "cuda":
        kept = _KEPT.get((key, device)) or _KEPT.store((key, device), _Kept(_mask_of(key, device)))
        for tile in tiles:
            kept.info.lists(*tile, compact=False)
        return kept.info
    if torch.cuda.is_current_stream_capturing():
        kept = _KEPT.get((key, device))
        if kept is None or any(kept.info.lists_built(*tile) is None for tile in tiles):
            return None
        keep_while_captured(device, kept.info)
        return kept.info
    reader = stream_key(device)
    with _LOCK:
        kept = _KEPT.get((key, device))
        missing = [tile for tile in tiles if kept is None or kept.info.lists_built(*tile) is None]
        if missing:
            kept = _build(key, device, missing, kept)
        _ready_on(kept, reader)
    return kept.info


def clear_kept() -> None:
    """Forget the kept masks (``clear_caches``)."""
    _KEPT.clear()


def _build(key: tuple[int, ...], device: torch.device, tiles: list[TileKey], kept: _Kept | None) -> _Kept:
    """Build the mask (unless ``kept``) and its lists at ``tiles`` on mmsparse's build stream, after the caller's
    work so far, on mmsparse's own thread (:mod:`mmsparse.runtime.own_thread`: a CUDA graph's warm-up routes every
    allocation of the calling thread to the graph's pool, whatever the stream). Every reader waits for it again."""
    def run() -> _Kept:
        made = kept if kept is not None else _Kept(_mask_of(key, device))
        for tile in tiles:
            made.info.lists(*tile, compact=False)
        return made

    made = on_build_stream(device, run)
    made.readers.clear()
    return made if kept is not None else _KEPT.store((key, device), made)


def _ready_on(kept: _Kept, reader: Any) -> None:
    """Make what ``kept`` holds readable on the stream ``reader`` (a ``stream_key``): it waits for every build so
    far, once, and the tensors are recorded on it. Called under the lock."""
    if reader in kept.readers:
        return
    stream = stream_of(reader)
    stream.wait_stream(build_stream(kept.info.device))
    for tensor in kept.info.held_tensors():
        tensor.record_stream(stream)
    kept.readers.add(reader)


def _mask_of(key: tuple[int, ...], device: torch.device) -> MaskInfo:
    """The mask of a ``MaskInfo.host_values`` key, built now on the current stream."""
    k = key[0]
    rows = [list(key[1 + i * k:1 + (i + 1) * k]) for i in range(k)]
    at = 1 + k * k
    nested, n_lens = key[at], key[at + 1]
    at += 2
    lens = [list(key[at + i * k:at + (i + 1) * k]) for i in range(n_lens)]
    seq_q, seq_k, causal, packed, window = key[at + n_lens * k:]
    return make_mask_info(Topology(rows), lens if nested else lens[0], seq_q, seq_k, bool(causal), device,
                          packed=bool(packed), window=None if window < 0 else window)
