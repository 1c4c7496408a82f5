"""The Gluon forward and dQ pass at D=256 (``config.GLUON_D256``), and with them the Gluon dK/dV pass of those head
dims (``GLUON_D256["dkdv"]``, off by default), against the tl kernels, on one Hopper GPU: a Gemma-3-like mask of
16k tokens (17 texts causal over everything before them, 16 images of 256 tokens, each whole and seeing everything
before it: ``benchmarks.configs.transfusion_layout``), B 1, Hq 16, Hkv 4, D 256, bf16.

    python -m tools.d256_probe              # tl, gluon (fwd + dq), gluon dkdv (fwd + dq + dkdv), 3 rounds (< 3 min)
    python -m tools.d256_probe --sweep                # also other Gluon tiles of the forward and the dQ pass
    python -m tools.d256_probe --rounds 5 --out benchmarks/results/h200
    python -m tools.d256_probe --dropout 0.1          # with attention dropout (the tl kernels at these tiles)

Each setting's forward (autograd on, as in training) and forward + backward are timed by triton.testing.do_bench
(median), the settings in turn within each round, the order alternating; the backward is their difference. TF/s
count live pairs (4 Hq D flops per pair forward, 2.5 times that backward), as the benchmark does. Before timing,
each setting's output and gradients are compared with the tl setting's and with a float32 reference on sampled
rows of one GQA group (``mmsparse.reference.reference_group_rows``; with ``--dropout`` only with the tl setting's,
the same dropout seeds for each); an error past MAX_ERROR makes the exit status 1. The table comes last; ``--out``
also writes ``d256_probe.{json,md}`` with the GPU, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import mmsparse  # before triton: without CUDA it turns on Triton's interpreter
from benchmarks.baselines import mmsparse_fn
from benchmarks.configs import BenchConfig, transfusion_layout
from benchmarks.env import git_commit, versions
from benchmarks.inputs import make_inputs
from mmsparse.attention.config import KernelConfig, Tile, cuda_kernel_config, gluon_tile_problem
from mmsparse.attention.plan import plan_attention

# 16 images of 256 tokens among 17 texts drawn from 256-1280 tokens, scaled to 16384 tokens in all
GEMMA3_16K = BenchConfig("gemma3_16k_d256", 1, 16, 4, 256, *transfusion_layout(16, 256, (256, 1280), seed=0,
                                                                                total=16384))
# --sweep: forward tiles (with the table's dQ tile) and dQ tiles (with the table's forward tile); each
# compiled for sm_90 beside the table's (tests/kernels/test_gluon_compiles.py: the 64-key forward reloads a few
# spilled registers in its loop's masked path).
SWEEP_FWD = {
    "fwd 32x4 pingpong named": Tile(128, 32, num_warps=8, num_stages=2, gluon_stages=4, pingpong=True,
                                    turns="named_release"),
    "fwd 32x4 pingpong mbarrier": Tile(128, 32, num_warps=8, num_stages=2, gluon_stages=4, pingpong=True),
    "fwd 32x3": Tile(128, 32, num_warps=8, num_stages=2, gluon_stages=3),
    "fwd 32x4": Tile(128, 32, num_warps=8, num_stages=2, gluon_stages=4),
    "fwd 64x2 pingpong named": Tile(128, 64, num_warps=8, num_stages=2, gluon_stages=2, pingpong=True,
                                    turns="named_release"),
}
SWEEP_DQ = {"dq 32x2": Tile(128, 32, num_warps=8, num_stages=1, gluon_stages=2)}
# Max |diff| / max |reference| of a bf16 output or gradient past which the exit status is 1 (bf16 rounding of these
# inputs gives about 1e-2 against float32).
MAX_ERROR = 5e-2


def settings(capability: tuple[int, int], sweep: bool) -> dict[str, KernelConfig]:
    """Label -> config: "tl" (every pass tl: ``gluon_d256=False``) first, the reference of the ratios; then "gluon"
    (Gluon forward and dQ, tl dK/dV) and "gluon dkdv" (the Gluon dK/dV pass as well: ``gluon_d256_dkdv=True``);
    with ``sweep``, "gluon" with other forward and dQ tiles."""
    tl = cuda_kernel_config(256, torch.bfloat16, capability, gluon=False)
    gluon = cuda_kernel_config(256, torch.bfloat16, capability, gluon=True, gluon_d256=True, gluon_d256_dkdv=False)
    dkdv = cuda_kernel_config(256, torch.bfloat16, capability, gluon=True, gluon_d256=True, gluon_d256_dkdv=True)
    out = {"tl": tl, "gluon": gluon, "gluon dkdv": dkdv}
    if sweep:
        out.update({label: replace(gluon, fwd=tile) for label, tile in SWEEP_FWD.items()})
        out.update({label: replace(gluon, bwd_dq=tile) for label, tile in SWEEP_DQ.items()})
    for label, cfg in out.items():
        for kind, tile in (("fwd", cfg.fwd), ("dq", cfg.bwd_dq), ("dkdv", cfg.bwd_dkdv)):
            assert not tile.gluon or gluon_tile_problem(kind, tile, 256) is None, (label, kind, tile)
    return out


def _relative_error(actual: torch.Tensor, want: torch.Tensor) -> float:
    """Max |actual - want| over max |want|."""
    actual, want = actual.float(), want.float()
    return ((actual - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def reference_errors(cfg: BenchConfig, q, k, v, dout, results: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    """Each setting's out, dq, dk, dv against a float32 reference on sampled rows of GQA group 0 (query heads
    0 .. group - 1, KV head 0): 512 query rows for out and dq, 256 key rows for dk and dv (every query walked)."""
    from mmsparse import reference_mask
    from mmsparse.reference import reference_group_rows

    group, seq = cfg.heads_q // cfg.heads_kv, cfg.seq_k
    gen = torch.Generator().manual_seed(1)
    rows = torch.randperm(seq, generator=gen)[:512].sort().values
    cols = torch.randperm(seq, generator=gen)[:256].sort().values
    mask = reference_mask(cfg.topology, cfg.seg_lens, seq)[0].to(q.device)
    ref = reference_group_rows(q[0, :group].detach(), k[0, 0].detach(), v[0, 0].detach(), dout[0, :group],
                               lambda idx: mask[idx], rows, cols)
    rows, cols = rows.to(q.device), cols.to(q.device)
    errors = {}
    for label, (out, dq, dk, dv) in results.items():
        got = (out[0, :group][:, rows], dq[0, :group][:, rows], dk[0, 0][cols], dv[0, 0][cols])
        errors[label] = {name: _relative_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    return errors


def _dropout_fn(cfg: BenchConfig, dropout_p: float) -> Any:
    """``mbs_attention`` on ``cfg`` with attention dropout ``dropout_p`` (its seed drawn from torch's generator)."""
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mmsparse.mbs_attention(q, k, v, cfg.topology, cfg.seg_lens, causal=cfg.causal, dropout_p=dropout_p)

    return fn


def run(rounds: int, variants: dict[str, KernelConfig], cfg: BenchConfig = GEMMA3_16K,
        device: torch.device | None = None, bench: Any = None, dropout_p: float = 0.0) -> dict[str, Any]:
    """The record of :func:`main`: ``variants`` (label -> config, the first the reference) on ``cfg``'s bf16 inputs
    on ``device`` (None: the current GPU), timed by ``bench`` (None: ``triton.testing.do_bench``; its keywords),
    with attention dropout ``dropout_p`` (then checked against the first setting only: the float32 reference has
    none)."""
    if bench is None:
        from triton.testing import do_bench as bench

    device = torch.device("cuda") if device is None else device
    q, k, v, dout = make_inputs(cfg, device)
    fn = _dropout_fn(cfg, dropout_p) if dropout_p > 0 else mmsparse_fn(cfg, device)
    results, kernels = {}, {}
    for label, kc in variants.items():  # compiles each setting's kernels before any timing
        q.grad = k.grad = v.grad = None
        torch.manual_seed(0)  # the same dropout seed for every setting
        with mmsparse.tuning.use_tuning(kc):
            out = fn(q, k, v)
            out.backward(dout)
        results[label] = [out.detach(), q.grad, k.grad, v.grad]
        kernels[label] = plan_attention(kc, cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.seq_k, cfg.seq_k,
                                        device, dropout=dropout_p > 0).kernels()
    q.grad = k.grad = v.grad = None
    first = next(iter(variants))
    agree = {label: {name: _relative_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), res,
                                                                       results[first])}
             for label, res in results.items()}
    errors = {label: {} for label in results} if dropout_p > 0 else reference_errors(cfg, q, k, v, dout, results)
    del results

    times: dict[str, dict[str, list[float]]] = {label: {"fwd": [], "fwdbwd": []} for label in variants}
    for r in range(rounds):  # the order alternates, so that slow spells land on every setting
        for label in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            with mmsparse.tuning.use_tuning(variants[label]):
                times[label]["fwd"].append(bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median"))
                # the tl backward takes ~50 ms here: a longer window gives the median a few calls
                times[label]["fwdbwd"].append(bench(lambda: fn(q, k, v).backward(dout), warmup=25, rep=300,
                                                    grad_to_none=[q, k, v], return_mode="median"))
    fwd_flops = 4.0 * cfg.batch * cfg.heads_q * cfg.head_dim * cfg.live_pairs
    rows = {}
    for label in variants:
        fwd = statistics.median(times[label]["fwd"])
        bwd = statistics.median(b - f for f, b in zip(times[label]["fwd"], times[label]["fwdbwd"]))
        bwd_first = [b - f for f, b in zip(times[first]["fwd"], times[first]["fwdbwd"])]
        bwd_label = [b - f for f, b in zip(times[label]["fwd"], times[label]["fwdbwd"])]
        rows[label] = {
            "kernels": kernels[label], "fwd_ms": fwd, "bwd_ms": bwd,
            "fwd_tflops": fwd_flops / fwd / 1e9, "bwd_tflops": 2.5 * fwd_flops / bwd / 1e9,
            "fwd_speedup": statistics.median(a / b for a, b in zip(times[first]["fwd"], times[label]["fwd"])),
            "bwd_speedup": statistics.median(a / b for a, b in zip(bwd_first, bwd_label)),
            "vs_tl": agree[label], "vs_float32": errors[label],
            "fwd_tile": str(variants[label].fwd), "dq_tile": str(variants[label].bwd_dq),
            "dkdv_tile": str(variants[label].bwd_dkdv),
        }
    return {"config": cfg.describe(), "live_pairs": cfg.live_pairs, "rounds": rounds, "reference": first,
            "dropout_p": dropout_p,
            "rows": rows, "versions": versions(device), "commit": git_commit()}


def _dropout_words(record: dict[str, Any]) -> str:
    p = record.get("dropout_p", 0.0)
    return f", attention dropout {p} (no float32 check)" if p else ""


def markdown(record: dict[str, Any]) -> str:
    lines = [f"{record['versions']}, commit {record['commit']}", "",
             f"{record['config']}{_dropout_words(record)}; do_bench medians over {record['rounds']} interleaved "
             "rounds; TF/s of live pairs; "
             f"speedup: the median of the per-round ratios to `{record['reference']}`; err: max |diff| / max |ref| "
             "of out, dq, dk, dv against the tl setting and against a float32 reference (sampled rows)", "",
             "| setting | fwd / dq / dkdv | fwd ms | fwd TF/s | fwd speedup | bwd ms | bwd TF/s | bwd speedup | "
             "err vs tl | err vs fp32 |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for label, row in record["rows"].items():
        kern = "/".join(row["kernels"][p] for p in ("forward", "dq", "dkdv"))
        vs_tl = " ".join(f"{e:.1e}" for e in row["vs_tl"].values())
        vs_ref = " ".join(f"{e:.1e}" for e in row["vs_float32"].values())
        lines.append(f"| {label} | {kern} | {row['fwd_ms']:.3f} | {row['fwd_tflops']:.0f} | {row['fwd_speedup']:.2f}x "
                     f"| {row['bwd_ms']:.3f} | {row['bwd_tflops']:.0f} | {row['bwd_speedup']:.2f}x | {vs_tl} | "
                     f"{vs_ref} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from mmsparse.attention.dispatch import hopper_gluon_available

    ap = argparse.ArgumentParser(prog="python -m tools.d256_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    ap.add_argument("--sweep", action="store_true", help="also time other Gluon tiles of the forward and dQ pass")
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout probability (default 0)")
    ap.add_argument("--out", type=Path, help="folder for d256_probe.{json,md} (d256_probe_dropout.* with --dropout)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools.d256_probe times the Gluon kernels at D=256: it needs a CUDA GPU (a Hopper: H100, H200)")
        return 2
    if not hopper_gluon_available(0):
        print("tools.d256_probe times the Gluon kernels at D=256: it needs a Hopper GPU (H100, H200) and Triton's "
              "Gluon API")
        return 2
    record = run(args.rounds, settings(torch.cuda.get_device_capability(0), args.sweep), dropout_p=args.dropout)
    for label, row in record["rows"].items():
        print(f"{label}: fwd {row['fwd_tile']}, dq {row['dq_tile']}, dkdv {row['dkdv_tile']}")
    off = [f"{label} {check} {name} {err:.2g}" for label, row in record["rows"].items()
           for check in ("vs_tl", "vs_float32") for name, err in row[check].items() if not err <= MAX_ERROR]
    print(f"errors over {MAX_ERROR}: {', '.join(off)}" if off else f"every error is within {MAX_ERROR}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "d256_probe_dropout" if args.dropout else "d256_probe"
        (args.out / f"{name}.json").write_text(json.dumps(record, indent=1))
        (args.out / f"{name}.md").write_text(markdown(record))
    print(markdown(record))
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
