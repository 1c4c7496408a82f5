"""The mask transformers builds for a layer type, as mmsparse arguments: :class:`ModelMask`.

transformers calls a registered mask interface with the composed ``mask_function``, the sizes and offsets of the
call and the 2-D padding mask. :func:`build_model_mask` reads the function back (:mod:`.expression`), cuts each
row (or each packed sample) into runs of tokens whose labels (block ids, samples, padding) are constant, gives every
pair of runs its mmsparse pair type (:mod:`.pair_types`) and returns the topology and run lengths in a
:class:`ModelMask`. That object travels to the attention function in place of the 4-D mask: the model passes it
through unchanged (as a tensor of four dims, of one element's storage, it is taken for a prepared mask). Reading the
labels costs one host read per mask built (per forward and layer type), and nothing per layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ...mask.topology import NONE, Topology
from .expression import Expr, PairValues, SameBlock, SameSample, Window, evaluate, leaves, parse
from .pair_types import run_pair_types


@dataclass
class MaskSpec:
    """What the attention function passes to mmsparse for one layer type.

    Attributes:
        topology: the pair types of the runs (several rows' or samples' tables side by side when they differ).
        seg_lens: per row ``[B, k]`` run lengths (a row summing to less than the keys ends in padding), or, when
            ``packed``, per sample ``[N, k]`` (samples end to end in one row).
        packed: the rows are one packed row of samples that never see each other (``mbs_attention_varlen``).
        window: the sliding window to pass mmsparse (key kept when its position > query position - window), or
            None, also when the window holds every key.
        layer_window: the mask's sliding window as transformers gives it.
        q_length, kv_length: the call's sizes, checked against the attention's tensors.
        has_blocks: the model's mask has bidirectional blocks (a vision model's images or prefix).
        padding: bool ``[B, kv_length]`` (True = real token) when some key is padding, else None.
    """

    topology: Topology
    seg_lens: tuple
    packed: bool
    window: int | None
    layer_window: int | None
    q_length: int
    kv_length: int
    has_blocks: bool
    padding: torch.Tensor | None


class ModelMask(torch.Tensor):
    """A :class:`MaskSpec` in the place of a 4-D mask ``[B, 1, Sq, Skv]``: one False element of storage, expanded.
    Anything that reads it as a mask sees every pair masked; the mmsparse attention function reads ``.spec``."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # any op on it gives a plain tensor
    spec: MaskSpec

    @staticmethod
    def wrap(spec: MaskSpec, batch: int, device: torch.device) -> ModelMask:
        base = torch.zeros((), dtype=torch.bool, device=device).expand(batch, 1, spec.q_length, spec.kv_length)
        out = torch.Tensor._make_subclass(ModelMask, base)
        out.spec = spec
        return out

    def __repr__(self) -> str:
        return f"ModelMask(shape={tuple(self.shape)}, {self.spec})"


def build_model_mask(
    mask_function: Any,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any,
    kv_offset: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> ModelMask:
    """The :class:`ModelMask` of one transformers mask call (the arguments transformers passes a mask interface).

    Raises:
        NotImplementedError: a mask piece mmsparse cannot express, or queries that are not the last keys (a
            static cache).
        ValueError: packed samples that the model's mask lets see each other.
    """
    expr = parse(mask_function)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    if q_offset + q_length != kv_offset + kv_length:
        raise NotImplementedError(
            f"attn_implementation='mmsparse' needs the queries to be the last key positions; here queries "
            f"{q_offset}..{q_offset + q_length - 1} meet keys {kv_offset}..{kv_offset + kv_length - 1} (a static "
            "cache?). Use the default DynamicCache"
        )
    parts = leaves(expr)
    window = layer_window = _window(parts)
    blocks = list({id(p): p for p in parts if isinstance(p, SameBlock)}.values())
    samples = {id(p.sample_ids): p.sample_ids for p in parts if isinstance(p, SameSample)}
    if len(samples) > 1:
        raise NotImplementedError("attn_implementation='mmsparse': a mask with two different packings of one row")
    sample_ids = next(iter(samples.values()), None)
    remapped = any(getattr(p, "remapped", False) or getattr(p, "positions", None) is not None for p in parts)
    if remapped and sample_ids is None:
        raise NotImplementedError("attn_implementation='mmsparse': per-sample positions without packed samples")
    padding = _key_padding(attention_mask, batch_size, kv_offset, kv_length)
    if window is not None and window >= kv_length:
        window = None  # every pair is inside it
    q_first = kv_length - q_length
    tracks = _Tracks.read(blocks, sample_ids, padding, batch_size, kv_offset, kv_length)
    packed = False
    if tracks is None:  # one run per row: no blocks, samples or padding
        runs = _Runs(torch.tensor([0]), torch.tensor([kv_length - 1]), torch.zeros(0, 1, dtype=torch.int64))
        types = run_pair_types(expr, runs.first, runs.last, q_first, window, {}, None, None)
        topology, seg_lens = Topology(types.tolist()), (kv_length,)
    elif tracks.sample is not None and batch_size == 1 and tracks.valid is None:
        tables = _packed_samples(expr, blocks, tracks, tracks.labels[0], q_first, window)
        topology, seg_lens = _side_by_side(tables)
        packed = True
    else:
        tables = [_row_table(expr, blocks, tracks, row, q_first, window) for row in tracks.labels]
        topology, seg_lens = _side_by_side(tables)
        if len(set(seg_lens)) == 1 and sum(seg_lens[0]) == kv_length:
            seg_lens = seg_lens[0]  # one row of lengths shared by the batch
    spec = MaskSpec(topology, seg_lens, packed, window, layer_window, q_length, kv_length, bool(blocks), padding)
    return ModelMask.wrap(spec, batch_size, device)


def _window(parts: list[Expr]) -> int | None:
    sizes = {p.size for p in parts if isinstance(p, Window)}
    if len(sizes) > 1:
        raise NotImplementedError(f"attn_implementation='mmsparse': one mask with several sliding windows {sizes}")
    return sizes.pop() if sizes else None


def _key_padding(
    attention_mask: torch.Tensor | None, batch: int, kv_offset: int, kv_length: int,
) -> torch.Tensor | None:
    """bool ``[B, kv_length]`` of the keys that are real tokens, or None when all are. As transformers does, a 2-D
    mask shorter than the keys counts the keys past its end as padding."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='mmsparse' takes a 2-D padding mask; got shape "
                         f"{tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    end = kv_offset + kv_length
    if mask.shape[-1] < end:
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[-1]), value=False)
    mask = mask[:, kv_offset:end].expand(batch, kv_length)
    return None if bool(mask.all()) else mask


@dataclass
class _Tracks:
    """int64 ``labels [B, T, kv_length]`` on the host: per key, one label per track: its block id under each block
    leaf (tracks 0 .. len(blocks) - 1), then its sample (track ``sample``) and whether it is a real token (track
    ``valid``), when there are any."""

    labels: torch.Tensor
    sample: int | None
    valid: int | None

    @staticmethod
    def read(
        blocks: list[SameBlock], sample_ids: torch.Tensor | None, padding: torch.Tensor | None, batch: int,
        kv_offset: int, kv_length: int,
    ) -> _Tracks | None:
        """The tracks of a call (one copy to the host); None when there is nothing to read."""
        if not blocks and sample_ids is None and padding is None:
            return None
        pos = torch.arange(kv_offset, kv_offset + kv_length)
        tracks = []
        for leaf in blocks:
            ids = leaf.ids
            index = pos.to(ids.device).expand(ids.shape[0], -1)
            if leaf.positions is not None:  # a packed row's remapping: ids read at per-sample positions
                index = leaf.positions.to(ids.device).expand(ids.shape[0], -1).gather(1, index)
            if int(index.max()) >= ids.shape[-1] or int(index.min()) < 0:
                raise NotImplementedError(
                    f"attn_implementation='mmsparse': the block ids have {ids.shape[-1]} positions but the mask "
                    f"reads positions {int(index.min())}..{int(index.max())}"
                )
            tracks.append(ids.gather(1, index).expand(batch, -1))
        sample = valid = None
        if sample_ids is not None:
            sample = len(tracks)
            tracks.append(sample_ids[:, kv_offset : kv_offset + kv_length].expand(batch, -1))
        if padding is not None:
            valid = len(tracks)
            tracks.append(padding)
        labels = torch.stack([t.to(device="cpu", dtype=torch.int64) for t in tracks], dim=1)
        return _Tracks(labels, sample, valid)


@dataclass
class _Runs:
    """Runs of equal labels: first and last position int64 ``[K]``, labels ``[T, K]``."""

    first: torch.Tensor
    last: torch.Tensor
    labels: torch.Tensor

    @staticmethod
    def of(row: torch.Tensor) -> _Runs:
        """The runs of one row's labels ``[T, S]``."""
        change = (row[:, 1:] != row[:, :-1]).any(0).nonzero().reshape(-1) + 1
        first = torch.cat([torch.zeros(1, dtype=torch.int64), change])
        last = torch.cat([change - 1, torch.tensor([row.shape[1] - 1])])
        return _Runs(first, last, row[:, first])

    def select(self, keep: torch.Tensor) -> _Runs:
        return _Runs(self.first[keep], self.last[keep], self.labels[:, keep])

    def lengths(self) -> list[int]:
        return (self.last - self.first + 1).tolist()


def _same_block(blocks: list[SameBlock], runs: _Runs) -> dict[int, torch.Tensor]:
    """Per block leaf, bool ``[K, K]``: the query run and the key run are in one block, its id >= 0."""
    values = {}
    for t, leaf in enumerate(blocks):
        g = runs.labels[t]
        values[id(leaf)] = (g[:, None] == g[None, :]) & (g[:, None] >= 0)
    return values


def _row_table(
    expr: Expr, blocks: list[SameBlock], tracks: _Tracks, row: torch.Tensor, q_first: int, window: int | None,
) -> tuple[torch.Tensor, list[int]]:
    """(pair types ``[K, K]``, run lengths) of one row; trailing padding is left out of both: mmsparse's row
    padding (never seen, its queries give 0)."""
    runs = _Runs.of(row)
    valid = None if tracks.valid is None else runs.labels[tracks.valid].bool()
    same_sample = None
    if tracks.sample is not None:
        s = runs.labels[tracks.sample]
        same_sample = s[:, None] == s[None, :]
    types = run_pair_types(expr, runs.first, runs.last, q_first, window, _same_block(blocks, runs), same_sample,
                           valid)
    if same_sample is not None and bool((types[~same_sample] != NONE).any()):
        raise ValueError(_LEAK)
    lens = runs.lengths()
    if valid is not None:
        keep = int(valid.nonzero().max()) + 1 if bool(valid.any()) else 0
        types, lens = types[:keep, :keep], lens[:keep]
    return types, lens


_LEAK = (
    "attn_implementation='mmsparse': the mask transformers builds lets a packed sample see another one (a block id "
    "shared by two samples, e.g. PaliGemma's prefix id 0 in transformers versions that OR the blocks in after the "
    "packing); mmsparse does not reproduce that. Give each sample its own row (padding) or upgrade transformers"
)


def _packed_samples(
    expr: Expr, blocks: list[SameBlock], tracks: _Tracks, row: torch.Tensor, q_first: int, window: int | None,
) -> list[tuple[torch.Tensor, list[int]]]:
    """Per sample of one packed row, (pair types, run lengths). A mask that lets samples see each other is a
    ValueError (checked on the labels: any block id shared by two samples)."""
    runs = _Runs.of(row)
    sample = runs.labels[tracks.sample]
    _check_samples_apart(expr, blocks, runs, sample)
    tables = []
    for s in torch.unique_consecutive(sample).tolist():
        part = runs.select(sample == s)
        same = torch.ones(part.first.shape[0], part.first.shape[0], dtype=torch.bool)
        types = run_pair_types(expr, part.first, part.last, q_first, window, _same_block(blocks, part), same, None)
        tables.append((types, part.lengths()))
    return tables


def _check_samples_apart(expr: Expr, blocks: list[SameBlock], runs: _Runs, sample: torch.Tensor) -> None:
    """ValueError when a pair of different samples may be allowed: the expression on such a pair, at every position
    that can occur, with each block leaf true when its ids put two samples in one block."""
    may_share = {}
    for t, leaf in enumerate(blocks):
        g = runs.labels[t]
        keep = g >= 0
        spans = False
        if bool(keep.any()):
            id_sample = torch.unique(torch.stack([g[keep], sample[keep]]), dim=1)
            spans = bool((torch.unique(id_sample[0], return_counts=True)[1] > 1).any())
        may_share[id(leaf)] = torch.tensor([[spans]])
    apart = torch.zeros(1, 1, dtype=torch.bool)
    for (c, w), free_c, free_w in itertools.product(((True, True), (True, False), (False, True)), *[(False, True)] * 2):
        out = evaluate(expr, PairValues(c, w, apart, may_share, free_c, free_w))
        if out is True or (isinstance(out, torch.Tensor) and bool(out.any())):
            raise ValueError(_LEAK)


def _side_by_side(tables: list[tuple[torch.Tensor, list[int]]]) -> tuple[Topology, tuple]:
    """One topology for rows (or samples) with their own tables, and each one's lengths in it: ``[N, k]``.

    A table that is the leading block of a larger one uses that one (its missing runs get length 0: a sample with
    fewer images fits the table of one with more); the other tables sit on the diagonal, NONE between them.
    """
    chosen: list[torch.Tensor] = []
    slot = [0] * len(tables)
    for i in sorted(range(len(tables)), key=lambda i: -tables[i][0].shape[0]):
        types = tables[i][0]
        k = types.shape[0]
        for c, big in enumerate(chosen):
            if torch.equal(big[:k, :k], types):
                slot[i] = c
                break
        else:
            chosen.append(types)
            slot[i] = len(chosen) - 1
    offsets = [0]
    for t in chosen:
        offsets.append(offsets[-1] + t.shape[0])
    if offsets[-1] == 0:  # nothing but padding
        return Topology([[NONE]]), tuple((0,) for _ in tables)
    matrix = torch.full((offsets[-1], offsets[-1]), NONE, dtype=torch.int8)
    for c, t in enumerate(chosen):
        matrix[offsets[c] : offsets[c + 1], offsets[c] : offsets[c + 1]] = t
    rows = []
    for i, (_, lens) in enumerate(tables):
        row = [0] * offsets[-1]
        row[offsets[slot[i]] : offsets[slot[i]] + len(lens)] = lens
        rows.append(tuple(row))
    return Topology(matrix.tolist()), tuple(rows)
