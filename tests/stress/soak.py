"""Soak: a small multimodal transformer trained for many steps with new per-sample lengths every step, watching
for slow leaks: GPU memory, compiled Triton kernel variants, and the sizes of mmsparse's caches.

Every step draws a total length S from a few buckets and new per-sample (text, vision, audio) lengths for the
padded batch (some rows shorter than S, some without audio), then runs forward, backward and AdamW. The layers
alternate between ``mmsparse.nn.MultimodalSelfAttention`` given the lengths as host lists (the cached mask path:
a new cache key every step) and ``TritonMBSAttnKernel`` given them as a device tensor (built every step, no host
sync), causal. Every ``--every`` steps it records:

- ``torch.cuda.memory_allocated()`` and the peak since the previous record (CUDA only),
- compiled variants of every Triton kernel of mmsparse (``compiled_variants``: Triton's own cache) and the entries
  of every ``FastKernel`` launch cache,
- the size of every module-level dict and ``functools`` cache of the mmsparse modules loaded, of the cached masks'
  own state (call launches, block lists, per-stream copies) and of the model's ``TritonMBSAttnKernel`` caches.

After ``--warmup`` steps everything should be flat. The verdict compares the first and the last quarter of the
records after warm-up: memory (the medians' ratio; the least-squares slope in bytes per step is reported) must not
grow by more than ``--mem-tol`` (or ``--mem-slack-mib``), no cache by more than 10% (or 2 entries), and no kernel
variant may be compiled in the last half of them. It writes ``soak.json`` and ``soak.md`` and exits 1 if the
verdict fails or the loss stops being finite. A run with fewer than 4 records after warm-up is too short to judge:
it reports, and passes.

    python -m tests.stress.soak --steps 2000             # GPU: writes benchmarks/results/<gpu>/soak.{json,md}
    python -m tests.stress.soak --steps 5 --out DIR      # CPU (Triton's interpreter): a smoke run, tiny shapes
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch import nn

import mmsparse  # noqa: F401  (turns on Triton's interpreter without CUDA, before triton is imported)
from benchmarks.env import environment, results_dir
from benchmarks.report import write_record
from mmsparse import TritonMBSAttnKernel
from mmsparse.mask.cache import CACHE, MaskCache
from mmsparse.nn import MultimodalSelfAttention

TOPIC = "soak"
# A leak detector: it reads the package's private caches on purpose, to watch them grow.
# The default warm-up fills the mask cache (one new key a step) twice over before the verdict's window opens.
MIN_WARMUP = 2 * CACHE.max_entries
CACHE_TOL, CACHE_SLACK = 0.10, 2  # a cache's allowed growth after warm-up: relative, or entries if more
TOPOLOGY = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]  # text sees everything; vision and audio see text and themselves


@dataclass(frozen=True)
class SoakConfig:
    buckets: tuple[int, ...]  # the total lengths S a step draws from
    batch: int
    dim: int
    heads: int
    kv_heads: int
    layers: int
    lr: float = 1e-3


GPU_CONFIG = SoakConfig(buckets=(1024, 1536, 2048, 3072), batch=4, dim=512, heads=8, kv_heads=2, layers=2)
CPU_CONFIG = SoakConfig(buckets=(24, 32, 40), batch=2, dim=32, heads=2, kv_heads=1, layers=2)


# ---------------------------------------------------------------------------------------------------------------
# The model


class Block(nn.Module):
    """Pre-norm attention + MLP. ``cached``: MultimodalSelfAttention with host lengths (the mask cache); else
    TritonMBSAttnKernel with device lengths (a new mask every call), causal."""

    def __init__(self, cfg: SoakConfig, cached: bool) -> None:
        super().__init__()
        default_lens = _split(cfg.buckets[0])
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))
        self.cached = cached
        if cached:
            self.attn = MultimodalSelfAttention(cfg.dim, cfg.heads, TOPOLOGY, default_lens, num_kv_heads=cfg.kv_heads)
        else:
            self.head_dim, self.heads, self.kv_heads = cfg.dim // cfg.heads, cfg.heads, cfg.kv_heads
            self.qkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * self.head_dim)
            self.proj = nn.Linear(cfg.dim, cfg.dim)
            self.kernel = TritonMBSAttnKernel(TOPOLOGY, default_lens, causal_mask=True)

    def forward(self, x: torch.Tensor, rows: list[tuple[int, ...]], lens: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.cached:
            y = self.attn(h, seg_lens=rows)
        else:
            d = self.head_dim
            q, k, v = self.qkv(h).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
            q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=d) for t in (q, k, v))
            y = self.kernel(q, k, v, seg_lens=lens, check_lengths=False)
            y = self.proj(rearrange(y, "b h s d -> b s (h d)"))
        x = x + y
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, cfg: SoakConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, cached=i % 2 == 0) for i in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, rows: list[tuple[int, ...]], lens: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, rows, lens)
        return self.head(x)


def _split(total: int) -> tuple[int, int, int]:
    return total // 4, total // 2, total - total // 4 - total // 2


def draw_lengths(cfg: SoakConfig, rng: random.Random) -> tuple[int, list[tuple[int, int, int]]]:
    """S from the buckets, and [B] (text, vision, audio) rows filling 60-100% of it; no audio in some rows."""
    seq = rng.choice(cfg.buckets)
    rows = []
    for _ in range(cfg.batch):
        total = rng.randint(max(2, int(0.6 * seq)), seq)
        text = rng.randint(1, max(1, total // 4))
        audio = 0 if rng.random() < 0.3 else rng.randint(0, total - text)
        rows.append((text, total - text - audio, audio))
    return seq, rows


# ---------------------------------------------------------------------------------------------------------------
# What is counted


def _mmsparse_modules() -> list[tuple[str, Any]]:
    return sorted((name, module) for name, module in list(sys.modules.items())
                  if module is not None and (name == "mmsparse" or name.startswith("mmsparse.")))


def kernel_counts() -> tuple[dict[str, int], dict[str, int]]:
    """(compiled variants per Triton kernel, entries per FastKernel launch cache), keyed ``module.name``: the kernels
    behind every FastKernel, and any other ``@triton.jit`` function named ``*_kernel`` (not the device functions
    they call, which are never compiled alone). Each kernel once, under the first name it is found by."""
    import triton

    from mmsparse.runtime.launch import FastKernel, compiled_variants

    variants: dict[str, int] = {}
    launches: dict[str, int] = {}
    seen: set[int] = set()
    for mod_name, module in _mmsparse_modules():
        for name, obj in list(vars(module).items()):
            if isinstance(obj, FastKernel):
                launches[f"{mod_name}.{name}"] = len(obj._cache)
                obj, name = obj.fn, name + ".fn"
            elif not (isinstance(obj, triton.runtime.jit.KernelInterface) and name.endswith("_kernel")):
                continue
            if id(obj) not in seen:
                seen.add(id(obj))
                variants[f"{mod_name}.{name}"] = compiled_variants(obj)
    return variants, launches


def cache_sizes(model: nn.Module) -> dict[str, int]:
    """Sizes of mmsparse's module-level dicts and functools caches, of the cached masks' own state, and of the
    model's TritonMBSAttnKernel mask caches."""
    sizes: dict[str, int] = {}
    for mod_name, module in _mmsparse_modules():
        for name, obj in list(vars(module).items()):
            if (isinstance(obj, dict) and name.startswith("_") and name[1:2].isupper()) or isinstance(obj, MaskCache):
                sizes[f"{mod_name}.{name}"] = len(obj)
            elif callable(getattr(obj, "cache_info", None)) and getattr(obj, "__module__", None) == mod_name:
                sizes[f"{mod_name}.{name}()"] = obj.cache_info().currsize
    masks = CACHE.masks(copies=True)
    sizes["mmsparse.mask.cache.CACHE (per-stream copies)"] = len(masks) - len(CACHE.masks())
    sizes["mmsparse.mask.cache.CACHE (block lists)"] = sum(len(info._lists) for info in masks)
    sizes["mmsparse.mask.cache.CACHE (call launches)"] = sum(
        len(getattr(info.kernel_args, "calls", ())) for info in masks)
    sizes["model: TritonMBSAttnKernel._infos"] = sum(
        len(m._infos) for m in model.modules() if isinstance(m, TritonMBSAttnKernel))
    return sizes


# ---------------------------------------------------------------------------------------------------------------
# The verdict


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def _bounded(series: list[int], strict: bool) -> dict[str, Any]:
    """Whether a count stays bounded over the records after warm-up. ``strict`` (compiled variants, which only ever
    grow): the last half reaches no new high over the first half, i.e. nothing new compiled. Otherwise (caches,
    whose size may wander within their bound, e.g. block lists per cached mask with the mix of lengths cached): the
    last quarter's mean exceeds the first quarter's by at most CACHE_TOL of it, or CACHE_SLACK entries."""
    half, quarter = len(series) // 2, max(1, len(series) // 4)
    first_q, last_q = statistics.fmean(series[:quarter]), statistics.fmean(series[-quarter:])
    row = {"after_warmup": series[0], "max_first_half": max(series[:half]), "max_last_half": max(series[half:]),
           "mean_first_quarter": first_q, "mean_last_quarter": last_q, "last": series[-1]}
    if strict:
        row["ok"] = row["max_last_half"] <= row["max_first_half"]
    else:
        row["ok"] = last_q - first_q <= max(CACHE_TOL * first_q, CACHE_SLACK)
    return row


def judge(records: list[dict[str, Any]], warmup: int, mem_tol: float = 0.05, mem_slack_mib: float = 16.0
          ) -> dict[str, Any]:
    """The verdict on the records taken after ``warmup`` steps (see the module docstring)."""
    after = [r for r in records if r["step"] > warmup]
    if len(after) < 4:
        return {"judged": False, "ok": True, "records_after_warmup": len(after),
                "reason": f"too short to judge: {len(after)} records after the {warmup} warm-up steps (need 4)"}
    verdict: dict[str, Any] = {"judged": True, "records_after_warmup": len(after)}
    quarter = max(1, len(after) // 4)
    if all(r.get("allocated") is not None for r in after):
        alloc = [float(r["allocated"]) for r in after]
        first, last = statistics.median(alloc[:quarter]), statistics.median(alloc[-quarter:])
        slope = _slope([float(r["step"]) for r in after], alloc)
        growth = last - first
        ok = growth <= max(mem_tol * first, mem_slack_mib * 2**20)
        verdict["memory"] = {
            "allocated_after_warmup": first, "allocated_last": last, "ratio_last_to_after_warmup": last / first
            if first else None, "slope_bytes_per_step": slope,
            "growth_over_run_by_slope": slope * (after[-1]["step"] - after[0]["step"]),
            "peak_after_warmup": max(r["peak"] for r in after[:quarter]), "peak_last": max(r["peak"] for r in
                                                                                           after[-quarter:]),
            "tolerance": {"relative": mem_tol, "slack_mib": mem_slack_mib}, "ok": ok,
        }
    else:
        verdict["memory"] = {"ok": True, "note": "no CUDA memory counters on this device"}
    total_variants = [sum(r["variants"].values()) for r in after]
    total_launch = [sum(r["launch_cache"].values()) for r in after]
    verdict["variants"] = {**_bounded(total_variants, strict=True), "per_kernel_last": after[-1]["variants"]}
    verdict["launch_cache"] = _bounded(total_launch, strict=True)
    caches = {}
    for name in after[-1]["caches"]:
        series = [r["caches"].get(name, 0) for r in after]
        caches[name] = _bounded(series, strict=False)
    verdict["caches"] = caches
    verdict["unbounded"] = sorted([n for n, c in caches.items() if not c["ok"]]
                                  + [n for n in ("variants", "launch_cache") if not verdict[n]["ok"]])
    verdict["ok"] = verdict["memory"]["ok"] and not verdict["unbounded"]
    return verdict


# ---------------------------------------------------------------------------------------------------------------
# The run


def record(step: int, model: nn.Module, device: torch.device, loss: float, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "loss": loss if math.isfinite(loss) else None, "seconds": round(seconds, 3),
                           "allocated": None, "peak": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["allocated"] = torch.cuda.memory_allocated(device)
        row["peak"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # the next record's peak is its own interval's
    row["variants"], row["launch_cache"] = kernel_counts()
    row["caches"] = cache_sizes(model)
    return row


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def markdown(summary: dict[str, Any]) -> str:
    env, v, records = summary["env"], summary["verdict"], summary["records"]
    lines = [f"Run: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}. "
             f"{summary['steps']} steps ({summary['seconds']:.0f} s), warm-up {summary['warmup']}, a record every "
             f"{summary['every']} steps; S from {list(summary['config']['buckets'])}, batch "
             f"{summary['config']['batch']}, {summary['config']['layers']} layers.", ""]
    if not v["judged"]:
        lines += [f"**Not judged**: {v['reason']}.", ""]
    else:
        lines += [f"**Verdict: {'ok' if v['ok'] else 'FAIL'}**" + (f" (unbounded: {', '.join(v['unbounded'])})"
                                                                    if v["unbounded"] else ""), ""]
        m = v["memory"]
        if "allocated_last" in m:
            lines += ["| memory | after warm-up MiB | last MiB | ratio | slope B/step | peak after warm-up MiB | "
                      "peak last MiB | ok |", "|---|---:|---:|---:|---:|---:|---:|---|",
                      f"| allocated | {_mib(m['allocated_after_warmup'])} | {_mib(m['allocated_last'])} | "
                      f"{m['ratio_last_to_after_warmup']:.4f} | {m['slope_bytes_per_step']:.1f} | "
                      f"{_mib(m['peak_after_warmup'])} | {_mib(m['peak_last'])} | {m['ok']} |", ""]
        else:
            lines += [f"Memory: {m['note']}.", ""]
        lines += ["| count | after warm-up | max, first half | max, last half | mean, first quarter | "
                  "mean, last quarter | last | bounded |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for name, c in [("compiled Triton variants", v["variants"]), ("FastKernel launch entries", v["launch_cache"]),
                        *sorted(v["caches"].items())]:
            lines.append(f"| {name} | {c['after_warmup']} | {c['max_first_half']} | {c['max_last_half']} | "
                         f"{c['mean_first_quarter']:.1f} | {c['mean_last_quarter']:.1f} | {c['last']} | {c['ok']} |")
        lines.append("")
    lines += ["| step | loss | allocated MiB | peak MiB | variants | launch entries | mask cache |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    stride = max(1, len(records) // 40)
    for r in records[::stride] + ([records[-1]] if (len(records) - 1) % stride else []):
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        lines.append(f"| {r['step']} | {loss} | {_mib(r['allocated'])} | {_mib(r['peak'])} | "
                     f"{sum(r['variants'].values())} | {sum(r['launch_cache'].values())} | "
                     f"{r['caches'].get('mmsparse.mask.cache.CACHE', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.stress.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=None, help="steps between records (default steps / 50)")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"steps before the verdict's window (default steps / 10, at least {MIN_WARMUP})")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mem-tol", type=float, default=0.05, help="allowed relative growth of allocated memory")
    ap.add_argument("--mem-slack-mib", type=float, default=16.0, help="allowed absolute growth (MiB), if larger")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default benchmarks/results/<gpu>/; a new temporary folder on the CPU)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = GPU_CONFIG if device.type == "cuda" else CPU_CONFIG
    every = args.every or max(1, args.steps // 50)
    warmup = args.warmup if args.warmup is not None else max(args.steps // 10, MIN_WARMUP)
    env = environment(device)
    out = args.out or (results_dir(env["gpu"]) if device.type == "cuda"
                       else Path(tempfile.mkdtemp(prefix="mmsparse-soak-")))

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = Model(cfg).to(device)
    target = nn.Linear(cfg.dim, cfg.dim).to(device).requires_grad_(False)  # a fixed map to learn
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    records: list[dict[str, Any]] = []
    finite = True
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        seq, rows = draw_lengths(cfg, rng)
        lens = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
        x = torch.randn(cfg.batch, seq, cfg.dim, device=device)
        real = (torch.arange(seq, device=device)[None, :] < lens.sum(-1, keepdim=True))[..., None]
        loss = ((model(x, rows, lens) - target(x)).square() * real).sum() / (real.sum() * cfg.dim)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == args.steps:
            value = loss.item()
            finite = finite and math.isfinite(value)
            del x, real, lens, loss  # the record counts what outlives a step, not this step's inputs
            row = record(step, model, device, value, time.perf_counter() - start)
            records.append(row)
            print(f"step {step:5d}  S {seq:5d}  loss {value:.4f}  allocated {_mib(row['allocated'])} MiB  "
                  f"peak {_mib(row['peak'])} MiB  variants {sum(row['variants'].values())}  "
                  f"mask cache {row['caches'].get('mmsparse.mask.cache.CACHE')}", flush=True)
    verdict = judge(records, warmup, args.mem_tol, args.mem_slack_mib)
    if not finite:
        verdict["ok"] = False
        verdict["loss_not_finite"] = True
    summary = {"env": env, "device": str(device), "config": asdict(cfg), "steps": args.steps, "every": every,
               "warmup": warmup, "seconds": time.perf_counter() - start, "verdict": verdict, "records": records}
    path = write_record(out, TOPIC, summary, markdown(summary))
    print(f"verdict: {'ok' if verdict['ok'] else 'FAIL'}" if verdict["judged"] else f"not judged: {verdict['reason']}")
    print(f"wrote {path} and its .md", flush=True)
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
