"""TritonMBSAttnKernel: multimodal block-sparse (MBS) attention over q, k, v as an nn.Module with no weights.

Its name is the seed's API. Layers with weights (q/k/v and output projections over ``[B, S, E]`` inputs) are in
:mod:`mmsparse.nn`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention.config import kernel_config
from .checks import (
    check_deterministic,
    check_dropout,
    check_flag,
    check_qkv,
    check_softmax_scale,
    check_window,
    layout_hint,
)
from .functional import attention_with_info
from .mask.build import build_mask_info, make_mask_info, topology_mask
from .mask.cache import MaskCache
from .mask.info import MaskInfo
from .mask.lengths import SegLensArg, validate_seg_lens
from .mask.prepared import PreparedMask
from .mask.topology import Topology, generate_interlaced_mask


class TritonMBSAttnKernel(nn.Module):
    """An ``nn.Module`` (not a kernel, despite the seed's name): multimodal block-sparse (MBS) attention for a fixed
    topology and segment lengths, over q, k, v; it holds no weights.

    Args:
        topology: k x k pair types: ``topology[r][c]`` says how the queries of segment r see the keys of
            segment c: ``NONE`` (0, not at all), ``FULL`` (1, every key) or ``CAUSAL`` (2, the keys at or before
            the query's position). Any number of segments (up to 4095); nested lists/tuples, a tensor or a
            :class:`~mmsparse.Topology` (build one once for hundreds of segments).
        seg_lens: k segment lengths (the seed's ``mm_seq_seg``); S = sum(seg_lens).
        causal_mask: also require key position <= query position.
        dropout: attention dropout probability, applied in training mode only.
        softmax_scale: default ``1/sqrt(D)``; a finite number of at least 1e-30.
        names: optional segment names, e.g. ``("text", "vision", "audio")``.
        window: a sliding window: keys at positions greater than the query's minus ``window`` only (as in
            :func:`mmsparse.mbs_attention`); None (default) for none.
        deterministic: the backward, as in :func:`mmsparse.mbs_attention`: True (bitwise
            repeatable), False (one pass, dQ by atomic adds) or None (default: ``use_config``'s, True unless set).

    ``forward(q, k, v)`` takes ``q [B, Hq, Sq, D]`` and ``k, v [B, Hkv, S, D]`` and returns ``[B, Hq, Sq, D]``.
    Masks and block lists are built on the inputs' device on first use and kept by the module (not in the
    package's cache: they go with the module). Every argument is an attribute that may be set later, checked as
    the constructor checks it; setting one the mask depends on (topology, seg_lens, causal_mask, window) drops the
    kept masks.
    """

    # Modules pickled before an argument existed have no value for it: these stand in.
    _deterministic: bool | None = None
    _window: int | None = None

    def __init__(
        self,
        topology: Any,
        seg_lens: SegLensArg,
        causal_mask: bool = False,
        dropout: float = 0.0,
        softmax_scale: float | None = None,
        names: Any = None,
        window: int | None = None,
        deterministic: bool | None = None,
    ) -> None:
        super().__init__()
        self._infos = MaskCache()  # this module's masks, per settings, (Sq, Sk) and device: they go with the module
        self._dense_mask: torch.Tensor | None = None
        self.topology = Topology(topology, names)
        self.seg_lens = seg_lens
        self.causal_mask = causal_mask
        self.dropout = dropout
        self.softmax_scale = softmax_scale
        self.window = window
        self.deterministic = deterministic

    # Each setting is checked when set, as the constructor checks it; setting one the masks depend on drops them.

    @property
    def topology(self) -> Topology:
        """The pair types (a :class:`~mmsparse.Topology`; set it from anything the constructor takes). A topology
        of another segment count needs new ``seg_lens`` (set them after it)."""
        return self._topology

    @topology.setter
    def topology(self, value: Any) -> None:
        self._topology = Topology(value)
        self._drop_masks()

    @property
    def seg_lens(self) -> tuple[int, ...]:
        """The k segment lengths (S = their sum)."""
        return self._seg_lens

    @seg_lens.setter
    def seg_lens(self, value: SegLensArg) -> None:
        self._seg_lens = validate_seg_lens(value, self.topology.num_segments)
        self._drop_masks()

    @property
    def causal_mask(self) -> bool:
        """Whether a key must also be at or before the query's position."""
        return self._causal_mask

    @causal_mask.setter
    def causal_mask(self, value: bool) -> None:
        self._causal_mask = check_flag("causal_mask", value)
        self._drop_masks()

    @property
    def window(self) -> int | None:
        """The sliding window, or None."""
        return self._window

    @window.setter
    def window(self, value: int | None) -> None:
        self._window = check_window(value)
        self._drop_masks()

    @property
    def dropout(self) -> float:
        """The attention dropout probability in training mode (read at each call)."""
        return self._dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        self._dropout = check_dropout(value)

    @property
    def softmax_scale(self) -> float | None:
        """The softmax scale, None for ``1/sqrt(D)`` (read at each call)."""
        return self._softmax_scale

    @softmax_scale.setter
    def softmax_scale(self, value: float | None) -> None:
        self._softmax_scale = check_softmax_scale(value)

    @property
    def deterministic(self) -> bool | None:
        """The backward: True, False or None for ``use_config``'s (read at each call)."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool | None) -> None:
        self._deterministic = check_deterministic(value)

    def _drop_masks(self) -> None:
        # A fresh cache rather than a clear: a call under way in another thread keeps the masks it has, and a mask
        # it stores afterwards is keyed by the settings it was built for, so it is never taken for the new ones.
        self._infos = MaskCache()
        self._dense_mask = None

    def __getstate__(self) -> dict[str, Any]:
        # Pickle, deepcopy and torch.save carry the configuration only: the masks are caches of device tensors
        # (their kernel arguments point back at them weakly, which pickle cannot take), rebuilt on first use.
        state = super().__getstate__()
        state["_infos"], state["_dense_mask"] = MaskCache(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Modules pickled when the settings were plain attributes hold them under their public names.
        for name in _SETTINGS:
            if name in state:
                state["_" + name] = state.pop(name)
        super().__setstate__(state)

    @property
    def seq_len(self) -> int:
        return sum(self.seg_lens)

    @property
    def dense_mask(self) -> torch.Tensor:
        """The S x S interlaced token mask (built lazily, on the CPU: for pictures and tests)."""
        if self._dense_mask is None:
            self._dense_mask = generate_interlaced_mask(self.topology, self.seg_lens)
        return self._dense_mask

    @property
    def block_sparse_mask(self) -> torch.Tensor:
        """bool ``[NQ, NK]``: the live tiles of the forward kernel at its tile size on the current device kind
        (CUDA tiles if a GPU is present, the interpreter's otherwise), self-attention over all S positions."""
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        tile = kernel_config(64, torch.bfloat16, device).fwd
        info = self._info(self.seq_len, self.seq_len, torch.device("cpu"))
        live, _ = info.classes(tile.block_m, tile.block_n)
        return live[0]

    def _info(self, seq_q: int, seq_k: int, device: torch.device) -> MaskInfo:
        if torch.compiler.is_compiling():  # traced: built in the graph; a kept mask would hold another call's tensors
            return build_mask_info(self.topology, self.seg_lens, seq_q, seq_k, self.causal_mask, device,
                                   window=self.window)
        # One read of the settings: the key names what the mask is built from.
        topology, seg_lens, causal, window = self._topology, self._seg_lens, self._causal_mask, self._window
        key = (topology, seg_lens, causal, window, seq_q, seq_k, str(device))
        infos = self._infos
        info = infos.mask(key)
        if info is None:  # built for this module alone: the package's cache never holds it
            info = infos.store_mask(key, make_mask_info(topology, seg_lens, seq_q, seq_k, causal, device,
                                                        window=window))
        return info

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: SegLensArg | PreparedMask | None = None,
        check_lengths: bool = True,
    ) -> torch.Tensor:
        """q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, S, D]``. ``seg_lens`` overrides the module's lengths for this
        call: per-sample ``[B, k]`` (int tensor or list of B tuples), rows summing to at most S, padding after."""
        check_qkv(q, k, v)
        if seg_lens is not None:
            info = topology_mask(q, k, self.topology, seg_lens, self.causal_mask, check_lengths, window=self.window)
            return attention_with_info(q, k, v, info, self.softmax_scale, self.dropout if self.training else 0.0,
                                       self.deterministic)
        if k.shape[2] != self.seq_len:
            hint = layout_hint(k, self.seg_lens)
            raise ValueError(
                f"k/v have {k.shape[2]} positions but the module's seg_lens {self.seg_lens} sum to {self.seq_len}"
                + (f". {hint}" if hint else "")
            )
        info = self._info(q.shape[2], k.shape[2], q.device)
        return attention_with_info(q, k, v, info, self.softmax_scale, self.dropout if self.training else 0.0,
                                   self.deterministic)

    def extra_repr(self) -> str:
        return (f"topology={self.topology.types.tolist()}, seg_lens={self.seg_lens}, "
                f"causal_mask={self.causal_mask}, dropout={self.dropout}"
                + ("" if self.window is None else f", window={self.window}")
                + ("" if self.deterministic is None else f", deterministic={self.deterministic}"))


_SETTINGS = ("topology", "seg_lens", "causal_mask", "dropout", "softmax_scale", "window", "deterministic")
