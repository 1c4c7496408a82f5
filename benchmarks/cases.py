"""One config's inputs, its dense masks and the float32 reference every implementation is checked against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import mmsparse  # before triton: on a machine without CUDA it turns on Triton's interpreter

from .configs import BenchConfig
from .inputs import make_inputs

REF_CHUNK_BYTES = 2 << 30  # float32 reference: query rows per chunk so that one [g, rows, S] score tensor ~ this / 8


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
        """Dense bool ``[Sq, Sk]`` on the device, from ``mmsparse.reference_mask``: ``"topology"`` is the config's
        mask, ``"dense"`` all pairs (causal on causal configs), i.e. what dense_flash computes."""
        if kind not in self.masks:
            cfg = self.cfg
            if kind == "dense" and not cfg.causal:  # every pair: a broadcast view, no S x S memory
                self.masks[kind] = torch.ones((), dtype=torch.bool, device=self.device).expand(cfg.q_len, cfg.seq_k)
            else:
                topology, lens = (cfg.topology, cfg.seg_lens) if kind == "topology" else ([[1]], (cfg.seq_k,))
                mask = mmsparse.reference_mask(topology, lens, cfg.seq_k, cfg.q_len, cfg.causal)[0]
                self.masks[kind] = mask.to(self.device)
                del mask
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
