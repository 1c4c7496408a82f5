"""Train a small text + vision + audio transformer with mmsparse attention and with dense masked SDPA.

Both runs start from the same weights and see the same synthetic batches, so their loss curves should overlap; the
script prints both curves, the tokens/s of each attention path, and saves a loss plot (PNG, if matplotlib is
installed: ``pip install -e '.[examples]'``) and the numbers (JSON) into ``--out DIR``, by default a new temporary
directory whose path it prints.

The task: each sample has a hidden class. Vision and audio tokens are noisy class-dependent features; the text is a
class-dependent token pattern (period ``text_period``) with half of its tokens masked. The model predicts the masked
text tokens from the visible ones and from the other modalities, which carry the class. Topology (rows attend
columns): text sees everything, vision sees text and vision, audio sees text and audio.

    python examples/train_multimodal.py            # GPU, realistic lengths (256 text + 1024 vision + 768 audio)
    python examples/train_multimodal.py --tiny     # CPU through Triton's interpreter, well under a minute
    python examples/train_multimodal.py --tiny --out results/   # keep the PNG and JSON in ./results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mmsparse  # before anything imports triton: without CUDA it turns on Triton's interpreter
from mmsparse import generate_interlaced_mask
from mmsparse.nn import MultimodalSelfAttention

TOPOLOGY = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]  # text, vision, audio
NAMES = ("text", "vision", "audio")


@dataclass
class Config:
    seg_lens: tuple[int, int, int] = (256, 1024, 768)
    dim: int = 512
    heads: int = 8
    kv_heads: int = 4
    layers: int = 4
    batch: int = 8
    steps: int = 200
    warmup: int = 5  # steps left out of tokens/s (compilation, autotuning)
    lr: float = 1e-3
    vocab: int = 256
    vision_dim: int = 96
    audio_dim: int = 64
    classes: int = 32
    text_period: int = 8
    seed: int = 0


TINY = Config(seg_lens=(12, 24, 12), dim=32, heads=2, kv_heads=1, layers=1, batch=2, steps=10, warmup=1, lr=1e-2,
              vocab=32, vision_dim=16, audio_dim=8, classes=4, text_period=4)


class DenseMaskedAttention(MultimodalSelfAttention):
    """The same layer and weights; the attention step is SDPA with the dense S x S interlaced mask."""

    def attention(self, q, k, v, seg_lens, causal):
        key = (tuple(seg_lens), causal, q.device)
        if getattr(self, "_mask_key", None) != key:
            mask = generate_interlaced_mask(self.topology, seg_lens)
            if causal:
                mask = mask & torch.ones_like(mask).tril()
            self._mask, self._mask_key = mask.to(q.device), key
        dropout_p = self.dropout if self.training else 0.0
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask, dropout_p=dropout_p)


class Block(nn.Module):
    def __init__(self, cfg: Config, attention_cls: type) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = attention_cls(cfg.dim, cfg.heads, TOPOLOGY, cfg.seg_lens, num_kv_heads=cfg.kv_heads)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MultimodalTransformer(nn.Module):
    """Embeddings per modality -> concatenated sequence [text | vision | audio] -> blocks -> text-token logits."""

    def __init__(self, cfg: Config, attention_cls: type = MultimodalSelfAttention) -> None:
        super().__init__()
        self.cfg = cfg
        self.text_embed = nn.Embedding(cfg.vocab + 1, cfg.dim)  # last id = [MASK]
        self.vision_proj = nn.Linear(cfg.vision_dim, cfg.dim)
        self.audio_proj = nn.Linear(cfg.audio_dim, cfg.dim)
        self.pos = nn.Parameter(torch.randn(sum(cfg.seg_lens), cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, attention_cls) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, text: torch.Tensor, vision: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """text ``[B, T]`` ids, vision ``[B, V, vision_dim]``, audio ``[B, A, audio_dim]`` -> ``[B, T, vocab]``."""
        x = torch.cat([self.text_embed(text), self.vision_proj(vision), self.audio_proj(audio)], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, : text.shape[1]]))


class SyntheticMultimodal:
    """Deterministic synthetic batches; the same seed gives the same stream."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        g = torch.Generator().manual_seed(cfg.seed + 1)
        t, v, a = cfg.seg_lens
        pattern = torch.randint(0, cfg.vocab, (cfg.classes, cfg.text_period), generator=g)
        self.text = pattern.repeat(1, math.ceil(t / cfg.text_period))[:, :t]
        self.vision = torch.randn(cfg.classes, 1, cfg.vision_dim, generator=g) + 0.5 * torch.randn(1, v, cfg.vision_dim,
                                                                                                 generator=g)
        self.audio = torch.randn(cfg.classes, 1, cfg.audio_dim, generator=g) + 0.5 * torch.randn(1, a, cfg.audio_dim,
                                                                                               generator=g)
        self.gen = torch.Generator().manual_seed(cfg.seed + 2)

    def batch(self) -> tuple[torch.Tensor, ...]:
        cfg, g = self.cfg, self.gen
        c = torch.randint(0, cfg.classes, (cfg.batch,), generator=g)
        target = self.text[c]
        masked = torch.rand(target.shape, generator=g) < 0.5
        text = torch.where(masked, torch.full_like(target, cfg.vocab), target)
        vision = self.vision[c] + torch.randn(cfg.batch, *self.vision.shape[1:], generator=g)
        audio = self.audio[c] + torch.randn(cfg.batch, *self.audio.shape[1:], generator=g)
        labels = torch.where(masked, target, torch.full_like(target, -100))
        return tuple(t.to(self.device, non_blocking=True) for t in (text, vision, audio, labels))


def progress(iterable, total: int, desc: str):
    """tqdm when installed, otherwise a one-line progress counter on stderr."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(iterable, total=total, desc=desc, leave=False)
        return
    for i, item in enumerate(iterable):
        print(f"\r{desc}: {i + 1}/{total}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr)


def train(model: nn.Module, batches: list, cfg: Config, device: torch.device, desc: str, bf16: bool) -> dict:
    """Train on the given batches (bf16 autocast if asked); loss per step and tokens/s over the steps after warmup."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    losses, start = [], None
    tokens = cfg.batch * sum(cfg.seg_lens)
    model.train()
    for step, (text, vision, audio, labels) in progress(enumerate(batches), len(batches), desc):
        if step == min(cfg.warmup, len(batches) - 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with autocast:
            logits = model(text, vision, audio)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # syncs: each step is timed to completion
    timed = len(batches) - min(cfg.warmup, len(batches) - 1)
    elapsed = time.perf_counter() - start
    return {"loss": losses, "tokens_per_s": timed * tokens / elapsed, "step_ms": 1e3 * elapsed / timed}


def save_plot(results: dict, cfg: Config, precision: str, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib, or mmsparse's [examples] extra)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("dense", "-"), ("mmsparse", "--")):
        r = results[name]
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], style, label=f"{name} ({r['tokens_per_s']:,.0f} tokens/s)")
    ax.set_xlabel("step")
    ax.set_ylabel("masked-text cross-entropy")
    ax.set_title(f"seg_lens {cfg.seg_lens}, dim {cfg.dim}, {cfg.layers} layers, batch {cfg.batch}, {precision}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss plot: {path}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].replace("``", "").split()))
    p.add_argument("--tiny", action="store_true", help="tiny sizes for the CPU interpreter")
    p.add_argument("--steps", type=int, help="training steps (default 200, tiny 10)")
    p.add_argument("--batch", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--seg-lens", type=int, nargs=3, metavar=("TEXT", "VISION", "AUDIO"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("bf16", "fp32"), help="default bf16 autocast on GPU, fp32 on CPU")
    p.add_argument("--out", type=Path, help="folder for the PNG and JSON (default: a new temporary directory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = TINY if args.tiny else Config()
    overrides = {"steps": args.steps, "batch": args.batch, "layers": args.layers, "seed": args.seed,
                 "seg_lens": tuple(args.seg_lens) if args.seg_lens else None}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("no CUDA device: the interpreter is slow, consider --tiny", file=sys.stderr)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")

    torch.manual_seed(cfg.seed)
    sparse_model = MultimodalTransformer(cfg).to(device)
    dense_model = MultimodalTransformer(cfg, DenseMaskedAttention).to(device)
    dense_model.load_state_dict(sparse_model.state_dict())  # same init
    data = SyntheticMultimodal(cfg, device)
    batches = [data.batch() for _ in range(cfg.steps)]  # same data for both

    density = generate_interlaced_mask(TOPOLOGY, cfg.seg_lens).float().mean().item()
    n_params = sum(p.numel() for p in sparse_model.parameters())
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (Triton interpreter)'}, "
          f"torch {torch.__version__}, mmsparse {mmsparse.__version__}")
    print(f"segments {dict(zip(NAMES, cfg.seg_lens))}, topology {TOPOLOGY}, mask density {density:.3f}, "
          f"{n_params / 1e6:.2f}M parameters, batch {cfg.batch}, {cfg.steps} steps, {precision}")

    results = {name: train(model, batches, cfg, device, name, precision == "bf16")
               for name, model in (("mmsparse", sparse_model), ("dense", dense_model))}

    every = max(1, cfg.steps // 10)
    print(f"{'step':>6} {'mmsparse':>10} {'dense':>10} {'|diff|':>9}")
    for i in list(range(0, cfg.steps, every)) + ([cfg.steps - 1] if (cfg.steps - 1) % every else []):
        a, b = results["mmsparse"]["loss"][i], results["dense"]["loss"][i]
        print(f"{i + 1:>6} {a:>10.4f} {b:>10.4f} {abs(a - b):>9.2e}")
    diff = max(abs(a - b) for a, b in zip(results["mmsparse"]["loss"], results["dense"]["loss"]))
    for name in ("mmsparse", "dense"):
        r = results[name]
        print(f"{name:>9}: {r['tokens_per_s']:>12,.0f} tokens/s ({r['step_ms']:.1f} ms/step)")
    speedup = results["mmsparse"]["tokens_per_s"] / results["dense"]["tokens_per_s"]
    if device.type == "cpu":
        print("(on CPU the kernels run in Triton's interpreter: its tokens/s says nothing about GPU speed)")
    print(f"max |loss diff| {diff:.2e}; mmsparse / dense throughput {speedup:.2f}x; "
          f"first -> last loss {results['mmsparse']['loss'][0]:.3f} -> {results['mmsparse']['loss'][-1]:.3f} "
          f"(chance {math.log(cfg.vocab):.3f})")

    out = args.out or Path(tempfile.mkdtemp(prefix="mmsparse-train_multimodal-"))  # never inside the checkout
    out.mkdir(parents=True, exist_ok=True)
    stem = "train_multimodal_tiny" if args.tiny else f"train_multimodal_{precision}"
    record = {"config": asdict(cfg), "device": str(device), "torch": torch.__version__, "precision": precision,
              "density": density,
              "max_loss_diff": diff, **results}
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name()
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    print(f"numbers: {out / f'{stem}.json'}")
    print(save_plot(results, cfg, precision, out / f"{stem}.png"))
    return results


if __name__ == "__main__":
    main()
