"""A Gemma-3-like vision-language model's training step under transformers' attention backends, side by side in
one process: ``python -m benchmarks.hf_vlm --out DIR`` (``--tiny``: a CPU smoke run).

The language model is Gemma 3 1B's shape (26 layers, 5 sliding : 1 full, window 512, 4 heads and 1 KV head of
256, ``query_pre_attn_scalar`` 256) with a 32k vocabulary (the full 262k one's logits alone would not fit at 32k
tokens), about 0.75B parameters; the vision tower is a small SigLIP giving images of 256 tokens. B = 2 rows of 8k
and 32k tokens with 8 to 32 images spread through the text (each between <boi> and <eoi>). Every backend gets the
same weights (switched with ``set_attn_implementation``) and the same batch: ``mmsparse`` (the model's own mask),
``sdpa`` (transformers' dense 4-D mask), ``flex_attention`` (transformers' flex backend, its block mask built from
the same mask functions) and ``eager`` (where it fits). One step is forward + backward with activation
checkpointing (bf16 weights), no optimizer. Records ``results/<gpu>/hf_vlm.{json,md}``: median step time, peak
memory, each backend's loss against SDPA's, and where one profiled step's GPU time goes (attention kernels, mask
building, the rest: :mod:`benchmarks.hf_breakdown`).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import mmsparse  # noqa: F401  (before transformers' model classes: on a CPU it turns Triton's interpreter on)

from .env import environment, record_dir
from .hf_breakdown import step_breakdown
from .report import fmt, log, write_record

IMAGE, BOI, EOI = 3, 4, 5  # token ids (inside the vocabulary)


@dataclass(frozen=True)
class Case:
    seq: int
    images: int
    batch: int = 2

    @property
    def name(self) -> str:
        return f"S{self.seq // 1024}k-img{self.images}" if self.seq >= 1024 else f"S{self.seq}-img{self.images}"


FULL_CASES = [Case(8192, 8), Case(8192, 16), Case(32768, 16), Case(32768, 32)]
TINY_CASES = [Case(48, 2)]
IMPLS = ["mmsparse", "sdpa", "flex_attention", "eager"]
TINY_IMPLS = ["mmsparse", "sdpa", "eager"]


def model_config(tiny: bool) -> Any:
    from transformers import Gemma3Config

    if tiny:
        text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1, image_size=16,
                      patch_size=4)
        tokens = 16
    else:
        layers = 26
        text = dict(vocab_size=32768, hidden_size=1152, intermediate_size=6912, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                    query_pre_attn_scalar=256, max_position_embeddings=32768 + 1024,
                    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
        vision = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                      image_size=64, patch_size=4)
        tokens = 256
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens, image_token_id=IMAGE,
                          boi_token_id=BOI, eoi_token_id=EOI)
    if tiny:  # larger weights: at the default init a tiny model's loss does not move with its attention
        config.initializer_range = config.text_config.initializer_range = 0.5
    return config


def make_batch(case: Case, config: Any, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, pixel_values and labels (text tokens only): the images evenly spread."""
    g = torch.Generator().manual_seed(seed)
    tokens = config.mm_tokens_per_image
    vocab = config.text_config.vocab_size
    ids = torch.randint(8, vocab, (case.batch, case.seq), generator=g)
    gap = case.seq // case.images
    if gap < tokens + 3:
        raise ValueError(f"{case.images} images of {tokens} tokens do not fit {case.seq} tokens")
    for i in range(case.images):
        start = i * gap + (gap - tokens) // 2
        ids[:, start - 1], ids[:, start + tokens] = BOI, EOI
        ids[:, start : start + tokens] = IMAGE
    token_type_ids = (ids == IMAGE).long()
    size = config.vision_config.image_size
    pixels = torch.randn(case.batch * case.images, 3, size, size, generator=g)
    labels = torch.where(token_type_ids == 0, ids, -100)
    batch = dict(input_ids=ids, token_type_ids=token_type_ids, pixel_values=pixels, labels=labels)
    return {k: v.to(device) for k, v in batch.items()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(model: Any, batch: dict, device: torch.device) -> torch.Tensor:
    """Forward + backward from zeroed gradients, synchronised: the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    synchronize(device)
    return loss


def time_steps(model: Any, batch: dict, device: torch.device, warmup: int, steps: int) -> tuple[list[float], float]:
    """Step times (ms) after ``warmup`` steps, and the first step's loss."""
    loss0 = None
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss = one_step(model, batch, device)
        if loss0 is None:
            loss0 = loss.item()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times, loss0


def run_impl(model: Any, impl: str, batch: dict, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    row: dict[str, Any] = {"impl": impl}
    try:
        model.set_attn_implementation(impl)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times, loss = time_steps(model, batch, device, warmup, steps)
        row.update(step_ms=statistics.median(times), step_ms_all=times, loss=loss)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        modelling = importlib.import_module(type(model).__module__)
        row["breakdown"] = step_breakdown(lambda: one_step(model, batch, device), modelling, impl)
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except Exception as e:  # a backend that cannot run this case: recorded, the others go on
        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict[str, Any]], env: dict[str, str], note: str) -> str:
    lines = [
        "# Gemma-3-like VLM training step: attention backends", "",
        f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
        f"commit {env['commit']}.", "", note, "",
        "| case | backend | step ms | SDPA ms / this | peak GiB | loss - SDPA's | GPU ms | attention fwd / bwd ms "
        "| mask GPU / host ms | rest GPU ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['case']} | {r['impl']} | {r['skipped']} | | | | | | | |")
            continue
        base = r.get("sdpa_ms")
        speed = f"{base / r['step_ms']:.2f}" if base else "-"
        diff = r.get("loss_vs_sdpa")
        lines.append(f"| {r['case']} | {r['impl']} | {fmt(r['step_ms'], 1)} | {speed} | {fmt(r.get('peak_gib'), 2)} "
                     f"| {'-' if diff is None else f'{diff:+.2e}'} | {_breakdown_cells(r.get('breakdown'))} |")
    lines += ["", "GPU ms: the kernels of one profiled step (after the timed ones); attention: the kernels launched by "
              "the backend's attention calls (recomputes included) and its attention backward's autograd nodes "
              "(eager's backward is many small nodes: it counts as the rest); mask: the model's mask functions "
              "(GPU and host time); rest: every other kernel."]
    return "\n".join(lines) + "\n"


def _breakdown_cells(b: dict[str, Any] | None) -> str:
    if b is None:
        return "- | - | - | -"
    bwd = fmt(b["attention_bwd_gpu_ms"], 1) if b["backward_separated"] else "n/a"
    return (f"{fmt(b['gpu_ms'], 1)} | {fmt(b['attention_fwd_gpu_ms'], 1)} / {bwd} | {fmt(b['mask_gpu_ms'], 1)} / "
            f"{fmt(b['mask_host_ms'], 1)} | {fmt(b['rest_gpu_ms'], 1)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_vlm", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="record folder (default benchmarks/results/<gpu>; a "
                        "temporary folder on a CPU or with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short rows: a smoke run (CPU)")
    parser.add_argument("--impls", default=None, help=f"comma-separated backends (default {','.join(IMPLS)})")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per backend (default 2; tiny 0)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per backend (default 3; tiny 1)")
    args = parser.parse_args(argv)

    import transformers

    from mmsparse.integrations import hf

    hf.register()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    impls = args.impls.split(",") if args.impls else (TINY_IMPLS if tiny else IMPLS)
    warmup = args.warmup if args.warmup is not None else (0 if tiny else 2)
    steps = args.steps if args.steps is not None else (1 if tiny else 3)
    dtype = torch.float32 if tiny else torch.bfloat16
    config = model_config(tiny)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(device=device, dtype=dtype)
    model.train()
    if not tiny:
        model.gradient_checkpointing_enable()
    params = sum(p.numel() for p in model.model.language_model.parameters())
    env = {**environment(device), "transformers": transformers.__version__}
    note = (f"Language model {params / 1e9:.2f}B parameters, {config.text_config.num_hidden_layers} layers; images of "
            f"{config.mm_tokens_per_image} tokens; {dtype}; forward + backward"
            f"{' with activation checkpointing' if not tiny else ''}; median of {steps} steps after {warmup}.")
    log(note)
    rows = []
    for case in TINY_CASES if tiny else FULL_CASES:
        batch = make_batch(case, config, device)
        case_rows = []
        for impl in impls:
            row = {"case": case.name, "seq": case.seq, "images": case.images, "batch": case.batch,
                   **run_impl(model, impl, batch, device, warmup, steps)}
            case_rows.append(row)
            log(f"{case.name:<14} {impl:<15} " + (row["skipped"] if row.get("skipped") else
                f"{row['step_ms']:9.1f} ms  loss {row['loss']:.5f}  peak {fmt(row.get('peak_gib'), 2)} GiB"))
        sdpa = next((r for r in case_rows if r["impl"] == "sdpa" and not r.get("skipped")), None)
        for r in case_rows:
            if sdpa is not None and not r.get("skipped"):
                r["sdpa_ms"] = sdpa["step_ms"]
                r["loss_vs_sdpa"] = r["loss"] - sdpa["loss"]
        rows.extend(case_rows)
        del batch
    folder = args.out if args.out is not None else record_dir(env["gpu"], "hf_vlm", smoke=tiny)
    record = {"env": env, "note": note, "rows": rows}
    path = write_record(folder, "hf_vlm", record, markdown(rows, env, note))
    log(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
