"""One config's inputs, its dense masks and the float32 reference every implementation is checked against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import mmsparse  # before triton: on a machine without CUDA it turns on Triton's interpreter

from .configs import BenchConfig
from .inputs import make_inputs

REF_CHUNK_BYTES = 2 << 30  # float32 reference: query rows per chunk so that one [g, rows, S] score tensor ~ this / 8
MASK_CHUNK_PAIRS = 1 << 26  # reference_mask builds on the CPU: query rows per call so that a call covers ~64M pairs


def topology_mask(topology: object, seg_lens: tuple[int, ...], seq_k: int, seq_q: int, causal: bool,
                  device: torch.device, chunk_pairs: int = MASK_CHUNK_PAIRS,
                  window: int | None = None) -> torch.Tensor:
    """``mmsparse.reference_mask`` as a dense bool ``[Sq, Sk]`` on ``device``, built on the CPU a chunk of query rows
    at a time (``q_start`` places each chunk), so that the CPU never holds more than ``chunk_pairs`` pairs."""
    topo = mmsparse.Topology(topology)  # validated once, not per chunk
    rows = max(1, chunk_pairs // max(seq_k, 1))
    if rows >= seq_q:
        return mmsparse.reference_mask(topo, seg_lens, seq_k, seq_q, causal, window=window)[0].to(device)
    past = seq_k - seq_q
    mask = torch.empty(seq_q, seq_k, dtype=torch.bool, device=device)
    for r0 in range(0, seq_q, rows):
        n = min(rows, seq_q - r0)
        chunk = mmsparse.reference_mask(topo, seg_lens, seq_k, n, causal, q_start=[past + r0], window=window)
        mask[r0 : r0 + n] = chunk[0].to(device)
    return mask


def packed_mask(topology: object, rows: tuple[tuple[int, ...], ...], causal: bool,
                device: torch.device, window: int | None = None) -> torch.Tensor:
    """``mmsparse.reference_packed_mask`` as a dense bool ``[S, S]`` made on ``device``: zeros, and each sample's
    own ``reference_mask`` (built on the CPU, sample by sample) on the diagonal. No S x S tensor on the CPU."""
    topo = mmsparse.Topology(topology)
    total = sum(sum(row) for row in rows)
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    start = 0
    for row in rows:
        end = start + sum(row)
        if end > start:
            sample = mmsparse.reference_mask(topo, row, end - start, causal=causal, window=window)
            mask[start:end, start:end] = sample[0].to(device)
        start = end
    return mask


@dataclass
class Case:
    cfg: BenchConfig
    device: torch.device
    q: torch.Tensor  # [B, Hq, Sq, D]
    k: torch.Tensor  # [B, Hkv, S, D]
    v: torch.Tensor  # [B, Hkv, S, D]
    dout: torch.Tensor  # [B, Hq, Sq, D]
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    refs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def make(cls, cfg: BenchConfig, device: torch.device, dtype: torch.dtype) -> Case:
        return cls(cfg, device, *make_inputs(cfg, device, dtype))

    @property
    def group(self) -> int:
        return self.cfg.heads_q // self.cfg.heads_kv

    def clear_grads(self) -> None:
        self.q.grad = self.k.grad = self.v.grad = None

    def check_slice(self) -> tuple[int, int, slice]:
        """(batch, kv head, its query heads): the last ones, so that batch/head strides are exercised."""
        b, kh = self.cfg.batch - 1, self.cfg.heads_kv - 1
        return b, kh, slice(kh * self.group, (kh + 1) * self.group)

    def mask(self, kind: str) -> torch.Tensor:
        """Dense bool ``[Sq, Sk]`` on the device. ``"topology"``: the config's mask, window included, from
        ``mmsparse.reference_mask`` (a pack: ``reference_packed_mask``'s, sample by sample), never S x S on the CPU.
        ``"dense"``: what dense_flash computes, all pairs, or every key at or before the query on configs with
        causal pairs (``cfg.dense_causal``); never a window."""
        if kind not in self.masks:
            cfg = self.cfg
            if kind == "dense" and not cfg.dense_causal:  # every pair: a broadcast view, no S x S memory
                self.masks[kind] = torch.ones((), dtype=torch.bool, device=self.device).expand(cfg.q_len, cfg.seq_k)
            elif kind == "dense":  # key j <= query position past + i
                mask = torch.ones(cfg.q_len, cfg.seq_k, dtype=torch.bool, device=self.device)
                self.masks[kind] = mask.tril_(cfg.seq_k - cfg.q_len)
            elif kind == "topology" and cfg.packed:
                self.masks[kind] = packed_mask(cfg.topology, cfg.rows, cfg.causal, self.device, window=cfg.window)
            elif kind == "topology":
                self.masks[kind] = topology_mask(cfg.topology, cfg.seg_lens, cfg.seq_k, cfg.q_len, cfg.causal,
                                                 self.device, window=cfg.window)
            else:
                raise ValueError(f"mask kind {kind!r}: 'topology' or 'dense'")
        return self.masks[kind]

    def reference(self, kind: str) -> dict[str, torch.Tensor]:
        """float32 out ``[g, Sq, D]``, dq ``[g, Sq, D]``, dk/dv ``[S, D]`` for :meth:`check_slice` under a mask kind.

        Rows are independent, so the reference runs over chunks of query rows (dk/dv accumulate across chunks).
        """
        if kind not in self.refs:
            b, kh, hs = self.check_slice()
            mask = self.mask(kind)
            q1 = self.q.detach()[b : b + 1, hs]
            do1 = self.dout[b : b + 1, hs]
            k1 = self.k.detach()[b : b + 1, kh : kh + 1].float().requires_grad_()
            v1 = self.v.detach()[b : b + 1, kh : kh + 1].float().requires_grad_()
            rows = max(16, REF_CHUNK_BYTES // (8 * 4 * self.group * self.cfg.seq_k))
            outs, dqs = [], []
            for r0 in range(0, self.cfg.q_len, rows):
                qc = q1[:, :, r0 : r0 + rows].float().requires_grad_()
                out = mmsparse.reference_attention(qc, k1, v1, mask[r0 : r0 + rows], dtype=torch.float32)
                out.backward(do1[:, :, r0 : r0 + rows].float())
                outs.append(out.detach()[0])
                dqs.append(qc.grad[0])
                del out, qc
            self.refs[kind] = {"out": torch.cat(outs, 1), "dq": torch.cat(dqs, 1), "dk": k1.grad[0, 0],
                               "dv": v1.grad[0, 0]}
        return self.refs[kind]
