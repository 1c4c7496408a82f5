"""A mask built once for many calls: every layer of a step over the same device lengths.

Host lengths (ints, lists) are cached by value, so every layer given them shares one mask. A length tensor is used
as it is: each call given one builds its mask (small list-builder launches and their allocations, most of a small
call's host time), and each layer of a step given the same tensor builds it again.
:func:`mmsparse.mask.build.prepare_mask` builds the mask once; passed as a call's ``seg_lens`` in place of the
lengths, it is used as it is, as FlexAttention's ``BlockMask`` is. Its block lists are built at its first call and
kept for the next ones, and so are the call's launches.

mmsparse does not keep a tensor's mask by the tensor's identity and version for the caller: a write that bypasses
the version counter (``t.data.copy_``, DLPack, an extension's kernel) would leave a stale mask and a silent wrong
answer. The caller says when the lengths are new, by preparing a new mask.

A call on another CUDA stream than the one that prepared the mask, or in a CUDA-graph capture, reads it as a cached
mask is read (:class:`mmsparse.mask.cache.CachedMask`): that stream's own copy, which waits for the building stream.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..checks import check_flag, check_window
from .cache import CachedMask
from .info import MaskInfo
from .topology import Topology


class PreparedMask:
    """A topology's mask over given lengths, built by :func:`prepare_mask`; pass it as ``seg_lens`` to
    :func:`mmsparse.mbs_attention`, :func:`mmsparse.mbs_attention_varlen` (``packed=True``) or a layer's forward,
    with the same topology, ``causal`` and ``window`` the mask was prepared with (checked at each call)."""

    __slots__ = ("info", "topology", "packed", "_streams")

    def __init__(self, info: MaskInfo, topology: Topology, packed: bool) -> None:
        self.info, self.topology, self.packed = info, topology, packed
        self._streams = CachedMask(info, threading.Lock())  # the mask as each stream (and a capture) reads it

    @property
    def seq_len(self) -> int:
        """The key positions S it was prepared for."""
        return self.info.seq_k

    @property
    def q_len(self) -> int:
        """The query positions (the last ``q_len`` of S unless prepared with ``q_start``)."""
        return self.info.seq_q

    @property
    def causal(self) -> bool:
        return self.info.causal

    @property
    def window(self) -> int | None:
        return self.info.window

    @property
    def device(self) -> torch.device:
        return self.info.device

    def for_call(self, topology: Topology, seq_q: int, seq_k: int, causal: Any, device: torch.device,
                 q_start: Any = None, packed: bool = False, window: Any = None) -> MaskInfo:
        """The mask for a call with these arguments (``topology`` validated), or a ValueError that says which one
        differs from what the mask was prepared with, and how to fix it."""
        if torch.compiler.is_compiling():
            raise ValueError("a prepared mask is for eager calls: under torch.compile pass the lengths themselves "
                             "(the compiled graph builds the mask from them, once for the layers that share them)")
        if q_start is not None:
            raise ValueError("q_start is the prepared mask's: pass q_start to mmsparse.prepare_mask, not to the call")
        if packed != self.packed:
            where = ("mbs_attention_varlen (it was prepared with packed=True)" if self.packed
                     else "mbs_attention or a layer (prepare it with packed=True for mbs_attention_varlen)")
            raise ValueError(f"this prepared mask goes to {where}")
        if (seq_q, seq_k) != (self.q_len, self.seq_len):
            raise ValueError(f"the mask was prepared for {self.q_len} queries over {self.seq_len} keys; this call has "
                             f"{seq_q} over {seq_k}: prepare one for these lengths")
        if device != self.device:
            raise ValueError(f"the mask was prepared on {self.device}; this call's tensors are on {device}")
        if check_flag("causal", causal) != self.causal:
            raise ValueError(f"the mask was prepared with causal={self.causal}; this call asks causal={causal}: "
                             "prepare it with the call's causal")
        if check_window(window, seq_k) != self.window:
            raise ValueError(f"the mask was prepared with window={self.window}; this call asks window={window}")
        if topology is not self.topology and topology != self.topology:
            raise ValueError(f"the mask was prepared for {self.topology}; this call's topology is {topology}: pass "
                             "the same topology, or prepare a mask for this one")
        return self._streams.get()

    def __reduce__(self) -> Any:
        raise TypeError("a PreparedMask holds device tensors and built lists for the process that prepared it and is "
                        "not pickled or copied: prepare one where it is used (mmsparse.prepare_mask)")

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        packed = ", packed=True" if self.packed else ""
        return (f"PreparedMask({self.topology}, {self.q_len} queries over {self.seq_len} keys, causal={self.causal}"
                f"{window}{packed}, {self.info.batch} row(s) of lengths, on {self.device})")
