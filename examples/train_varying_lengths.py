"""A training loop over multimodal batches whose segment lengths change every step, under
``torch.compile(fullgraph=True)``, with no recompiles after warm-up.

Every step draws new per-sample lengths (text, vision, audio) for a padded batch: some samples have no audio,
some are short, the tail of each row is padding. The lengths go in as a device tensor ``[B, 3]``, so the block
metadata is built on the device inside the compiled graph. The script counts

- Dynamo graphs and recompiles after the first step (must stay 0),
- Triton kernel variants compiled after the first steps (must stay 0),

and every few steps compares the compiled model's output and weight gradients with the same model whose
attention is the float64 dense reference (``mmsparse.reference_attention`` under the exact token mask). It exits
non-zero if anything recompiles or disagrees. The summary (JSON) goes into ``--out DIR``, by default a new temporary
directory whose path it prints.

    python examples/train_varying_lengths.py            # GPU: S = 4096, 2 blocks, 40 steps
    python examples/train_varying_lengths.py --tiny     # CPU through Triton's interpreter, about a minute
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from einops import rearrange
from torch import nn

import mmsparse  # before anything imports triton: without CUDA it turns on Triton's interpreter
from mmsparse import TritonMBSAttnKernel, reference_attention, reference_mask
from mmsparse.kernels.tl.backward import attention_dkdv_tl, attention_dq_tl
from mmsparse.kernels.tl.forward import attention_combine_tl, attention_fwd_tl
from mmsparse.runtime.launch import compiled_variants

TOPOLOGY = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]  # text sees everything; vision and audio see text and themselves


@dataclass
class Config:
    seq_len: int = 4096
    dim: int = 256
    heads: int = 4
    blocks: int = 2
    batch: int = 4
    steps: int = 40
    check_every: int = 10
    lr: float = 1e-3


TINY = Config(seq_len=48, dim=32, heads=2, blocks=1, batch=2, steps=6, check_every=3)


class Block(nn.Module):
    """Pre-norm attention + MLP. ``reference=True`` swaps the attention for the float64 dense reference."""

    def __init__(self, dim: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        # The module's own lengths are a default; every call passes the batch's lengths.
        self.attn = TritonMBSAttnKernel(TOPOLOGY, (seq_len // 4, seq_len // 2, seq_len - 3 * (seq_len // 4)))
        self.reference = False

    def forward(self, x: torch.Tensor, seg_lens: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = rearrange(self.qkv(self.norm1(x)), "b s (three h d) -> three b h s d", three=3, h=self.heads)
        if self.reference:
            mask = reference_mask(TOPOLOGY, seg_lens.tolist(), s).to(x.device)
            y = reference_attention(q, k, v, mask).to(q.dtype)
        else:
            y = self.attn(q, k, v, seg_lens=seg_lens, check_lengths=False)  # no host sync: device lengths
        x = x + self.proj(rearrange(y, "b h s d -> b s (h d)"))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.seq_len) for _ in range(cfg.blocks))
        self.head = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, seg_lens: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, seg_lens)
        return self.head(x)


def random_lengths(cfg: Config, gen: torch.Generator) -> torch.Tensor:
    """[B, 3] lengths (text, vision, audio) filling 50-100% of the sequence; audio is absent in some samples."""
    rows = []
    for _ in range(cfg.batch):
        total = int(cfg.seq_len * (0.5 + 0.5 * torch.rand((), generator=gen).item()))
        text = int(torch.randint(1, max(2, total // 4), (), generator=gen))
        audio = 0 if torch.rand((), generator=gen).item() < 0.3 else int(torch.randint(0, total - text + 1, (),
                                                                                          generator=gen))
        rows.append([text, total - text - audio, audio])
    return torch.tensor(rows, dtype=torch.int32)


def triton_variants() -> int:
    return sum(compiled_variants(kernel) for kernel in (attention_fwd_tl, attention_combine_tl, attention_dkdv_tl,
                                                         attention_dq_tl))


def real_tokens(seg_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """bool [B, S]: True on a sample's tokens, False on its padding tail."""
    return torch.arange(seq_len, device=seg_lens.device)[None, :] < seg_lens.sum(-1, keepdim=True)


def check_against_reference(model: nn.Module, compiled: nn.Module, x: torch.Tensor, lens: torch.Tensor) -> float:
    """Max abs difference of the output and of every weight gradient: compiled mmsparse model vs the same weights
    with float64 reference attention."""

    def run(fn: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        y = fn(x, lens)
        y.square().mean().backward()
        return [y.detach()] + [p.grad.detach().clone() for p in model.parameters()]

    got = run(compiled)
    for block in model.blocks:
        block.reference = True
    try:
        want = run(model)
    finally:
        for block in model.blocks:
            block.reference = False
    model.zero_grad(set_to_none=True)
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].replace("``", "").split()))
    ap.add_argument("--tiny", action="store_true", help="small shapes for the CPU interpreter")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 40, tiny 6)")
    ap.add_argument("--out", type=Path, help="folder for the JSON summary (default: a new temporary directory)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TINY if args.tiny or device.type != "cuda" else Config()
    if args.steps:
        cfg.steps = args.steps
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = Model(cfg).to(device)
    compiled = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    target = nn.Linear(cfg.dim, cfg.dim).to(device).requires_grad_(False)  # a fixed map to learn

    from torch._dynamo.utils import counters

    counters.clear()
    graphs_after_warmup = variants_after_warmup = None
    worst, log = 0.0, []
    for step in range(cfg.steps):
        lens = random_lengths(cfg, gen).to(device)
        x = torch.randn(cfg.batch, cfg.seq_len, cfg.dim, device=device)
        real = real_tokens(lens, cfg.seq_len)[..., None]
        loss = ((compiled(x, lens) - target(x)).square() * real).sum() / (real.sum() * cfg.dim)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1:  # the first two steps compile the graph and every kernel variant these shapes use
            graphs_after_warmup, variants_after_warmup = counters["stats"]["unique_graphs"], triton_variants()
        line = f"step {step:3d}  lengths {lens.tolist()}  loss {loss.item():.4f}"
        if step % cfg.check_every == cfg.check_every - 1 or step == cfg.steps - 1:
            err = check_against_reference(model, compiled, x, lens)
            worst = max(worst, err)
            line += f"  max |compiled - float64 reference| {err:.2e}"
        print(line, flush=True)
        log.append(line)
    graphs = counters["stats"]["unique_graphs"]
    recompiles = graphs - graphs_after_warmup
    new_variants = triton_variants() - variants_after_warmup
    tol = 1e-3 if device.type == "cuda" else 1e-4  # fp32 (tf32x3 on the GPU) vs float64
    ok = recompiles == 0 and new_variants == 0 and worst < tol
    summary = {"device": str(device), "config": asdict(cfg), "dynamo_graphs": graphs,
               "recompiles_after_warmup": recompiles, "triton_variants_after_warmup": new_variants,
               "max_abs_err_vs_reference": worst, "tolerance": tol, "ok": ok, "torch": torch.__version__,
               "mmsparse": mmsparse.__version__ if hasattr(mmsparse, "__version__") else None}
    print(json.dumps({k: summary[k] for k in ("dynamo_graphs", "recompiles_after_warmup",
                                               "triton_variants_after_warmup", "max_abs_err_vs_reference", "ok")}))
    out = args.out or Path(tempfile.mkdtemp(prefix="mmsparse-train_varying_lengths-"))  # never inside the checkout
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train_varying_lengths_{device.type}.json"
    path.write_text(json.dumps({**summary, "log": log}, indent=1))
    print(f"summary: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
