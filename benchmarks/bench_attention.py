"""mmsparse against the attention a user would otherwise reach for, side by side in one process, on the same inputs.

Implementations (``--impls``):
  - ``mmsparse``: ``mmsparse.mbs_attention`` with the config's topology and segment lengths.
  - ``flex``: ``torch.compile(flex_attention)`` with a ``mask_mod`` that looks the topology up on segment ids and a
    block mask from ``create_block_mask``.
  - ``sdpa_mask``: ``F.scaled_dot_product_attention`` with a dense bool mask ``[1, 1, Sq, Sk]``, on the cuDNN
    backend, else the memory-efficient one (never the math backend on CUDA).
  - ``dense_flash``: SDPA's FlashAttention-2 backend with no mask (``is_causal`` on causal configs): the cost of
    ignoring the sparsity.

Method:
  - bf16 inputs ``q [B, Hq, Sq, D]``, ``k, v [B, Hkv, S, D]`` with requires_grad; one ``dout``.
  - Before timing a config, every implementation's output and its dq/dk/dv are compared with a float32 dense
    reference (``mmsparse.reference_attention``) on one (batch, kv-head) slice, in row chunks so that no
    S x S float tensor is made. A mismatch prints a loud FAIL and is recorded in the row (``correct``).
  - ``fwd_ms``: median of ``triton.testing.do_bench`` over the forward with autograd on (the forward of training);
    ``fwdbwd_ms``: forward + backward; ``bwd_ms`` = the difference. ``--rounds`` (default 3) times every
    implementation of a config that many times, interleaved (mmsparse, flex, ..., mmsparse, flex, ...), and each
    row keeps its best round: a slow spell of the machine then does not land on one implementation alone. The
    rounds are in ``fwd_ms_rounds`` / ``fwdbwd_ms_rounds``.
  - TFLOP/s count live (allowed) pairs only: fwd 4·B·Hq·D·live, bwd 2.5x that. dense_flash is credited with the
    same live pairs (useful work); ``*_tflops_computed`` give its rate over the pairs it actually computes.
  - ``peak_mib``: peak CUDA memory of one forward + backward above what was allocated before it (inputs and the
    implementation's mask state excluded; dq/dk/dv included). ``state_mib``: memory held by the mask state (block
    lists, block mask, dense mask).
  - ``build_ms``: host wall time (with syncs) to build the mask metadata from scratch: ``build_mask_info`` +
    ``MaskInfo.prepare`` for mmsparse, ``create_block_mask`` for Flex.

Usage::

    python benchmarks/bench_attention.py                      # all configs, all implementations
    python benchmarks/bench_attention.py --quick              # seed, mm13k_cyclic, mm13k_hub, fewer reps
    python benchmarks/bench_attention.py --configs mm13k_hub,mm43k_cyclic --impls mmsparse,flex
    python benchmarks/bench_attention.py --isolate            # one subprocess per (config, impl)
    python benchmarks/plot_results.py benchmarks/results/latest.json

Writes ``latest.json`` (a list of rows), ``latest.csv``, ``latest.md`` and, when matplotlib imports, ``latest.png``
under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from configs import ALL_CONFIGS, CONFIGS, DECODE_CONFIGS, QUICK, TINY, BenchConfig, live_pairs

import mmsparse  # before triton: on a machine without CUDA it turns on Triton's interpreter

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
IMPLS = ("mmsparse", "flex", "sdpa_mask", "dense_flash")

RTOL_OUT = 2e-2  # max |out - ref| / max |ref|: outputs here are ~1e-2 in size, so an absolute 2e-2 would pass zeros
RTOL_GRAD = 5e-2  # the same for dq, dk, dv (bf16 backward: dS from bf16 P and dP)
REF_CHUNK_BYTES = 2 << 30  # float32 reference: query rows per chunk so that one [g, rows, S] score tensor ~ this / 8
SDPA_MASK_BYTES_PER_PAIR = 5  # bool mask + the bf16 bias SDPA makes from it on each call (+ alignment copies)
SDPA_MASK_MEM_FRACTION = 0.6  # skip sdpa_mask when that estimate exceeds this share of free memory

ROW_KEYS = (
    "config", "impl", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "peak_mib", "build_ms",
    "gpu", "torch", "triton", "commit",
)
TensorFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Skip(Exception):
    """An implementation that cannot run this config by design (recorded with its reason, not as a failure)."""


class DeviceLost(Exception):
    """The CUDA context is unusable (e.g. after an illegal memory access): nothing more can run in this process."""


def log(message: str = "") -> None:
    print(message, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:
        return False


def short_error(exc: BaseException, limit: int = 400) -> str:
    first = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {first[0] if first else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Timers


@dataclass
class Timing:
    device: torch.device
    warmup: int  # do_bench warmup, ms
    rep: int  # do_bench measuring time, ms
    cpu_warmup: int = 2  # CPU fallback: calls
    cpu_reps: int = 3
    rounds: int = 1  # timing rounds over all implementations of a config, interleaved; the best is kept

    @property
    def method(self) -> str:
        rounds = f"; best of {self.rounds} interleaved rounds" if self.rounds > 1 else ""
        if self.device.type == "cuda":
            return f"triton do_bench median (warmup {self.warmup} ms, rep {self.rep} ms){rounds}"
        return (f"wall-clock median (CPU fallback; warmup {self.warmup} ms, rep {self.rep} ms, >= {self.cpu_reps} "
                f"calls){rounds}")

    def kernel_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        """Median time of ``fn`` in ms: do_bench on CUDA, a wall-clock median on CPU."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup, rep=self.rep, grad_to_none=grad_to_none,
                                  return_mode="median"))
        # CPU fallback, shaped like do_bench: warm up for ~warmup ms (at least cpu_warmup calls), then measure for
        # ~rep ms (at least cpu_reps calls); the first calls on CPU are slow (lazy init, thread pools).
        def call() -> float:
            for t in grad_to_none or ():
                t.grad = None
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        start, warm = time.perf_counter(), 0
        while warm < self.cpu_warmup or ((time.perf_counter() - start) * 1e3 < self.warmup and warm < 1000):
            call()
            warm += 1
        times: list[float] = []
        while len(times) < self.cpu_reps or (sum(times) < self.rep and len(times) < 1000):
            times.append(call())
        return statistics.median(times)

    def host_ms(self, fn: Callable[[], Any]) -> float:
        return host_ms(fn, self.device)


def host_ms(fn: Callable[[], Any], device: torch.device, min_reps: int = 5, max_reps: int = 50,
            budget_s: float = 0.5, warmup_calls: int = 2) -> float:
    """Median wall time in ms of a host-heavy ``fn`` (metadata builds), synchronising around each call."""
    for _ in range(warmup_calls):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - start < budget_s):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------------
# One config's inputs, masks and float32 reference


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
        torch.manual_seed(0)
        b, hq, hkv, d = cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim
        q = torch.randn(b, hq, cfg.q_len, d, device=device, dtype=dtype).requires_grad_()
        k = torch.randn(b, hkv, cfg.seq_k, d, device=device, dtype=dtype).requires_grad_()
        v = torch.randn(b, hkv, cfg.seq_k, d, device=device, dtype=dtype).requires_grad_()
        dout = torch.randn(b, hq, cfg.q_len, d, device=device, dtype=dtype)
        return cls(cfg, device, q, k, v, dout)

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


# ---------------------------------------------------------------------------------------------------------------
# Implementations: each setup returns the attention call plus its metadata cost, or raises Skip


@dataclass
class Impl:
    fn: TensorFn  # (q, k, v) -> out, autograd-capable
    reference: str = "topology"  # the mask kind its output must match
    build_ms: float | None = None
    state_mib: float | None = None
    info: dict[str, Any] = field(default_factory=dict)  # extra row keys (backend, tiles, ...)


def _build_state(case: Case, timing: Timing, build: Callable[[], Any]) -> tuple[Any, float | None, float]:
    """Build once (keeping the result), report the memory it holds, then time fresh builds."""
    base = allocated(case.device)
    state = build()
    sync(case.device)
    state_mib = (allocated(case.device) - base) / 2**20 if case.device.type == "cuda" else None
    return state, state_mib, timing.host_ms(build)


def setup_mmsparse(case: Case, timing: Timing) -> Impl:
    from mmsparse.functional import build_mask_info
    from mmsparse.ops.config import kernel_config

    cfg, dev = case.cfg, case.device
    tiles = kernel_config(cfg.head_dim, case.q.dtype, dev)
    lens = torch.tensor(cfg.seg_lens, device=dev)[None]  # a [1, k] tensor is not cached: every call rebuilds

    def build() -> Any:
        return build_mask_info(cfg.topology, lens, cfg.q_len, cfg.seq_k, cfg.causal, dev).prepare(tiles)

    state, state_mib, build_ms = _build_state(case, timing, build)
    del state

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mmsparse.mbs_attention(q, k, v, cfg.topology, cfg.seg_lens, causal=cfg.causal)

    t = tiles
    fwd = t.forward_tile(cfg.q_len, cfg.seq_k)
    desc = "; ".join(f"{n} {x.block_m}x{x.block_n} w{x.num_warps} s{x.num_stages}"
                     + (f" (gluon s{x.gluon_stages})" if x.gluon else "")
                     for n, x in (("fwd", fwd), ("dkdv", t.bwd_dkdv), ("dq", t.dq_tile(cfg.seq_k))))
    return Impl(fn, build_ms=build_ms, state_mib=state_mib, info={"backend": "triton", "tiles": desc})


_FLEX: Any = None


def _compiled_flex() -> Any:
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def setup_flex(case: Case, timing: Timing) -> Impl:
    from torch.nn.attention.flex_attention import create_block_mask

    cfg, dev = case.cfg, case.device
    nseg = len(cfg.seg_lens)
    seg = torch.repeat_interleave(torch.arange(nseg, dtype=torch.int32), torch.tensor(cfg.seg_lens)).to(dev)
    topo = torch.tensor(cfg.topology, dtype=torch.bool, device=dev)
    past, causal = cfg.seq_k - cfg.q_len, cfg.causal

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_pos = q_idx + past
        allowed = topo[seg[q_pos], seg[kv_idx]]
        if causal:
            allowed = allowed & (kv_idx <= q_pos)
        return allowed

    def build() -> Any:
        return create_block_mask(mask_mod, None, None, cfg.q_len, cfg.seq_k, device=dev)

    block_mask, state_mib, build_ms = _build_state(case, timing, build)
    flex, gqa = _compiled_flex(), cfg.heads_q != cfg.heads_kv

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    info: dict[str, Any] = {"backend": "flex (torch.compile)", "tiles": f"block {block_mask.BLOCK_SIZE}"}
    try:
        info["flex_block_sparsity"] = round(float(block_mask.sparsity()), 2)
    except Exception:
        pass
    return Impl(fn, build_ms=build_ms, state_mib=state_mib, info=info)


def _sdpa(backend: Any, mask: torch.Tensor | None, is_causal: bool, group: int, repeat_kv: bool) -> TensorFn:
    from torch.nn.attention import sdpa_kernel

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if repeat_kv:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  enable_gqa=group > 1 and not repeat_kv)

    return fn


def _first_sdpa_that_runs(case: Case, candidates: list[tuple[str, Any]], mask: torch.Tensor | None,
                          is_causal: bool, reference: str) -> tuple[TensorFn, str]:
    """The first backend (and, for GQA, native GQA before repeated k/v) whose forward + backward runs and whose
    output matches the reference; failing that, the first one that runs (its row will then say FAIL)."""
    reasons, fallback = [], None
    b, _, hs = case.check_slice()
    for name, backend in candidates:
        for repeat_kv in (False, True) if case.group > 1 else (False,):
            fn = _sdpa(backend, mask, is_causal, case.group, repeat_kv)
            label = name + (" + repeat_interleave k/v" if repeat_kv else " + enable_gqa" if case.group > 1 else "")
            try:
                out = fn(case.q, case.k, case.v)
                out.backward(case.dout)
                sync(case.device)
                _, rel, ok = compare(out.detach()[b, hs], case.reference(reference)["out"], RTOL_OUT)
                del out
                if ok:
                    return fn, label
                reasons.append(f"{label}: output rel err {rel:.1e}")
                fallback = fallback or (fn, label)
            except Exception as e:
                if not device_alive(case.device):
                    raise DeviceLost(f"{label}: {short_error(e)}") from e
                reasons.append(f"{label}: {short_error(e, 200)}")
            finally:
                case.clear_grads()
                free_memory(case.device)
    if fallback is not None:
        return fallback[0], f"{fallback[1]} (tried: {' | '.join(reasons)})"
    raise RuntimeError("no SDPA backend ran: " + " | ".join(reasons))


def setup_sdpa_mask(case: Case, timing: Timing) -> Impl:
    from torch.nn.attention import SDPBackend

    cfg, dev = case.cfg, case.device
    if dev.type == "cuda":
        need = SDPA_MASK_BYTES_PER_PAIR * cfg.q_len * cfg.seq_k
        free, _ = torch.cuda.mem_get_info(dev)
        if need > SDPA_MASK_MEM_FRACTION * free:
            raise Skip(f"dense mask path needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
        candidates = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    else:  # CPU smoke test only: the math backend materialises the scores, never used on CUDA
        candidates = [("math", SDPBackend.MATH)]
    mask = case.mask("topology")[None, None]  # [1, 1, Sq, Sk] view of the cached device mask
    fn, label = _first_sdpa_that_runs(case, candidates, mask, is_causal=False, reference="topology")
    return Impl(fn, state_mib=mask.numel() * mask.element_size() / 2**20 if dev.type == "cuda" else None,
                info={"backend": label})


def setup_dense_flash(case: Case, timing: Timing) -> Impl:
    from torch.nn.attention import SDPBackend

    candidates = ([("flash", SDPBackend.FLASH_ATTENTION)] if case.device.type == "cuda"
                  else [("math", SDPBackend.MATH)])
    fn, label = _first_sdpa_that_runs(case, candidates, None, is_causal=case.cfg.causal, reference="dense")
    return Impl(fn, reference="dense", info={"backend": label + (" (is_causal)" if case.cfg.causal else "")})


SETUPS: dict[str, Callable[[Case, Timing], Impl]] = {
    "mmsparse": setup_mmsparse,
    "flex": setup_flex,
    "sdpa_mask": setup_sdpa_mask,
    "dense_flash": setup_dense_flash,
}


# ---------------------------------------------------------------------------------------------------------------
# Check and measure


def compare(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> tuple[float, float, bool]:
    """(max abs error, that over max |ref|, pass). NaN anywhere fails."""
    got = got.float()
    if bool(torch.isnan(got).any()):
        return math.inf, math.inf, False
    err = float((got - ref).abs().max())
    rel = err / max(float(ref.abs().max()), 1e-6)
    return err, rel, rel <= rtol


def check(case: Case, impl: Impl, grads: bool) -> dict[str, Any]:
    """Compare one (batch, kv-head group) of out and dq/dk/dv with the float32 reference."""
    b, kh, hs = case.check_slice()
    res: dict[str, Any] = {}
    case.clear_grads()
    try:
        out = impl.fn(case.q, case.k, case.v)
        autograd_error = None
    except Exception as e:  # e.g. Flex on CPU has no backward: still check the forward
        if not device_alive(case.device):
            raise DeviceLost(short_error(e)) from e
        autograd_error = short_error(e)
        with torch.no_grad():
            out = impl.fn(case.q.detach(), case.k.detach(), case.v.detach())
    ref = case.reference(impl.reference)
    res["max_err"], res["rel_err"], out_ok = compare(out.detach()[b, hs], ref["out"], RTOL_OUT)
    grad_ok = True
    if autograd_error is not None:
        res["grad_error"] = f"forward with autograd: {autograd_error}"
    elif grads:
        try:
            out.backward(case.dout)
            got = {"dq": case.q.grad[b, hs], "dk": case.k.grad[b, kh], "dv": case.v.grad[b, kh]}
            errs = {n: compare(g, ref[n], RTOL_GRAD) for n, g in got.items()}
            res["grad_max_err"] = max(e[0] for e in errs.values())
            res["grad_rel_err"] = max(e[1] for e in errs.values())
            grad_ok = all(e[2] for e in errs.values())
            if not grad_ok:
                res["grad_fail"] = ", ".join(f"{n} rel {e[1]:.2e}" for n, e in errs.items() if not e[2])
        except Exception as e:
            if not device_alive(case.device):
                raise DeviceLost(short_error(e)) from e
            res["grad_error"] = f"backward: {short_error(e)}"
    res["grads_checked"] = "grad_max_err" in res
    res["correct"] = out_ok and grad_ok
    if not res["correct"]:
        res["check"] = "FAIL"
    else:
        res["check"] = "ok" if res["grads_checked"] or not grads else "ok (fwd only)"
    del out
    case.clear_grads()
    return res


def peak_mib(case: Case, impl: Impl) -> float | None:
    if case.device.type != "cuda":
        return None
    case.clear_grads()
    free_memory(case.device)
    sync(case.device)
    base = torch.cuda.memory_allocated(case.device)
    torch.cuda.reset_peak_memory_stats(case.device)
    impl.fn(case.q, case.k, case.v).backward(case.dout)
    sync(case.device)
    peak = torch.cuda.max_memory_allocated(case.device) - base
    case.clear_grads()
    return peak / 2**20


def time_round(case: Case, impl: Impl, timing: Timing, row: dict[str, Any]) -> None:
    """One timing round: append this round's fwd and fwd+bwd medians to the row's ``*_rounds`` lists. A stage that
    fails is recorded and not timed again."""
    q, k, v, dout = case.q, case.k, case.v, case.dout

    def fwd() -> torch.Tensor:
        return impl.fn(q, k, v)

    def fwd_bwd() -> None:
        impl.fn(q, k, v).backward(dout)

    for key, fn, grad_to_none in (("fwd_ms", fwd, None), ("fwdbwd_ms", fwd_bwd, [q, k, v])):
        rounds = row.setdefault(f"{key}_rounds", [])
        if rounds is None:  # failed in an earlier round
            continue
        try:
            rounds.append(timing.kernel_ms(fn, grad_to_none))
        except Exception as e:
            row[f"{key}_rounds"] = None
            add_error(row, key.removesuffix("_ms"), e, case.device)
            free_memory(case.device)
        finally:
            case.clear_grads()


def finish_row(case: Case, impl: Impl, row: dict[str, Any]) -> None:
    """Times from the rounds (the best of each stage: every implementation gets the same rounds, interleaved, so a
    slow spell of the machine does not land on one of them), TFLOP/s and peak memory."""
    for key in ("fwd_ms", "fwdbwd_ms"):
        rounds = row.get(f"{key}_rounds")
        row[key] = min(rounds) if rounds else None
    if row.get("fwd_ms") is not None and row.get("fwdbwd_ms") is not None:
        row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    try:
        row["peak_mib"] = peak_mib(case, impl)
    except Exception as e:
        add_error(row, "peak", e, case.device)
    cfg = case.cfg
    fwd_flops = 4.0 * cfg.batch * cfg.heads_q * cfg.head_dim * cfg.live_pairs
    for key, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
        ms = row.get(f"{key}_ms")
        if ms is not None and ms > 0:
            row[f"{key}_tflops"] = flops / ms / 1e9
            if impl.reference == "dense":  # the pairs dense_flash really computes
                row[f"{key}_tflops_computed"] = row[f"{key}_tflops"] / cfg.density * _dense_density(cfg)


def _dense_density(cfg: BenchConfig) -> float:
    return live_pairs([[1]], (cfg.seq_k,), cfg.q_len, cfg.causal) / (cfg.q_len * cfg.seq_k)


def add_error(row: dict[str, Any], stage: str, exc: BaseException, device: torch.device) -> None:
    """Record a stage's failure in the row; raise DeviceLost if it took the CUDA context with it."""
    message = f"{stage}: {short_error(exc)}"
    row["error"] = f"{row['error']} | {message}" if row.get("error") else message
    if os.environ.get("BENCH_VERBOSE"):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    if not device_alive(device):
        raise DeviceLost(message) from exc


# ---------------------------------------------------------------------------------------------------------------
# Running configs


def environment(device: torch.device) -> dict[str, str]:
    import triton

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"cpu ({platform.machine()}, Triton interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit()}


def git_commit() -> str:
    """HEAD of the checkout; MMSPARSE_COMMIT overrides it for copies without .git (e.g. a GPU machine)."""
    if os.environ.get("MMSPARSE_COMMIT"):
        return os.environ["MMSPARSE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_DIR, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_DIR,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def base_row(cfg: BenchConfig, impl: str, env: dict[str, str], timing: Timing) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(config=cfg.name, impl=impl, **env)
    row.update(
        fwdbwd_ms=None, state_mib=None, correct=None, max_err=None, rel_err=None, check=None, backend=None,
        error=None, batch=cfg.batch, heads_q=cfg.heads_q, heads_kv=cfg.heads_kv, head_dim=cfg.head_dim,
        seq_len=cfg.seq_k, seq_q=cfg.q_len, seg_lens=list(cfg.seg_lens), topology=cfg.topology_name,
        causal=cfg.causal, density=round(cfg.density, 4), live_pairs=cfg.live_pairs, dtype="bf16",
        timer=timing.method,
    )
    return row


def fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def progress_line(index: int, total: int, row: dict[str, Any]) -> str:
    head = f"[{index}/{total}] {row['config']:<18} {row['impl']:<11}"
    if row.get("skipped"):
        return f"{head} skipped: {row['skipped']}"
    parts = [
        f"fwd {fmt(row['fwd_ms']):>8} ms {fmt(row['fwd_tflops'], 1):>6} TF/s",
        f"bwd {fmt(row['bwd_ms']):>8} ms {fmt(row['bwd_tflops'], 1):>6} TF/s",
        f"peak {fmt(row['peak_mib'], 0):>6} MiB",
        f"build {fmt(row['build_ms'])} ms",
        f"check {row.get('check') or '-'}",
    ]
    if row.get("error"):
        parts.append(f"ERROR {row['error']}")
    return f"{head} " + " | ".join(parts)


def check_line(row: dict[str, Any], seconds: float) -> str:
    grads = (f"grads max_err {row['grad_max_err']:.2e} rel {row['grad_rel_err']:.2e}"
             if row.get("grad_max_err") is not None else row.get("grad_error", "grads not checked"))
    return (f"    check {row['impl']:<11} {row['check']:<4} out max_err {row['max_err']:.2e} rel {row['rel_err']:.2e}"
            f" | {grads} | backend {row.get('backend')} ({seconds:.1f} s)")


def loud_fail(row: dict[str, Any]) -> None:
    bar = "!" * 100
    what = row.get("grad_fail") or f"out rel err {row['rel_err']:.2e} > {RTOL_OUT}"
    log(f"{bar}\n!!! FAIL {row['config']} / {row['impl']}: does not match the float32 reference ({what})\n{bar}")


class Runner:
    """Runs configs in this process, appending finished rows to ``rows`` and saving after each one."""

    def __init__(self, args: argparse.Namespace, device: torch.device, timing: Timing, env: dict[str, str],
                 total: int, save: Callable[[list[dict[str, Any]]], None]) -> None:
        self.args, self.device, self.timing, self.env = args, device, timing, env
        self.rows: list[dict[str, Any]] = []
        self.emitted: set[int] = set()
        self.total, self.save = total, save

    def emit(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.emitted.add(id(row))
        log(progress_line(len(self.rows), self.total, row))
        self.save(self.rows)

    def run_config(self, cfg: BenchConfig, impls: Sequence[str]) -> None:
        rows = {name: base_row(cfg, name, self.env, self.timing) for name in impls}
        log(f"== {cfg.name}: {cfg.describe()}")
        case: Case | None = None
        try:
            case = Case.make(cfg, self.device, torch.bfloat16)
            setups = self.setup_and_check(case, rows)
            for _ in range(self.timing.rounds):
                for name, impl in setups.items():
                    time_round(case, impl, self.timing, rows[name])
            for name, row in rows.items():
                impl = setups.pop(name, None)
                if impl is not None:
                    finish_row(case, impl, row)
                    del impl
                    free_memory(self.device)
                self.emit(row)
        except DeviceLost:
            for row in rows.values():
                if id(row) not in self.emitted:
                    row["error"] = row["error"] or "not run: CUDA context lost"
                    self.emit(row)
            raise
        except Exception as e:  # inputs or reference failed (e.g. out of memory): every row of the config says so
            log(traceback.format_exc() if os.environ.get("BENCH_VERBOSE") else f"    config failed: {short_error(e)}")
            for row in rows.values():
                if id(row) not in self.emitted:
                    row["error"] = row["error"] or f"config: {short_error(e)}"
                    self.emit(row)
            if not device_alive(self.device):
                raise DeviceLost(short_error(e)) from e
        finally:
            del case
            free_memory(self.device)
            torch._dynamo.reset()

    def setup_and_check(self, case: Case, rows: dict[str, dict[str, Any]]) -> dict[str, Impl]:
        """Set up every implementation and check it against the reference before anything is timed."""
        cfg = case.cfg
        counted = int(torch.count_nonzero(case.mask("topology")))
        if counted != cfg.live_pairs:  # the TFLOP/s basis must be right
            raise RuntimeError(f"live pair count {cfg.live_pairs} != reference mask count {counted}")
        setups: dict[str, Impl] = {}
        for name, row in rows.items():
            t0 = time.perf_counter()
            try:
                impl = SETUPS[name](case, self.timing)
            except Skip as s:
                row["skipped"] = str(s)
                row["error"] = f"skipped: {s}"
                continue
            except DeviceLost:
                raise
            except Exception as e:
                add_error(row, "setup", e, self.device)
                log(f"    setup {name:<11} ERROR {row['error']}")
                continue
            row.update(build_ms=impl.build_ms, state_mib=impl.state_mib, **impl.info)
            try:
                row.update(check(case, impl, grads=self.args.grad_check))
            except DeviceLost:
                raise
            except Exception as e:
                add_error(row, "check", e, self.device)
                log(f"    check {name:<11} ERROR {row['error']}")
                continue
            log(check_line(row, time.perf_counter() - t0))
            if not row["correct"]:
                loud_fail(row)
            setups[name] = impl
            free_memory(self.device)
        return setups


def run_isolated(args: argparse.Namespace, configs: list[BenchConfig], impls: list[str], env: dict[str, str],
                 timing: Timing, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """One subprocess per (config, impl): a crash (illegal address, segfault) costs only its own row."""
    rows: list[dict[str, Any]] = []
    for cfg in configs:
        for impl in impls:
            with tempfile.TemporaryDirectory(prefix="mmsparse-bench-") as tmp:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--no-plot", "--configs", cfg.name,
                       "--impls", impl, "--out", tmp, "--device", args.device, "--warmup", str(timing.warmup),
                       "--rep", str(timing.rep), "--cpu-reps", str(timing.cpu_reps), "--rounds", str(timing.rounds)]
                if not args.grad_check:
                    cmd.append("--no-grad-check")
                proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
                result = Path(tmp) / "latest.json"
                child_rows = json.loads(result.read_text()) if result.exists() else []
                if proc.returncode != 0 or not child_rows:
                    tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-400:]
                    sys.stderr.write(proc.stderr[-4000:])
                    if not child_rows:
                        row = base_row(cfg, impl, env, timing)
                        row["error"] = f"subprocess exited with {proc.returncode}: {tail}"
                        child_rows = [row]
                rows.extend(child_rows)
                save(rows)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Outputs


def ordered_keys(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(ROW_KEYS)
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    return keys


def write_json_csv(rows: list[dict[str, Any]], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    tmp = out_dir / "latest.json.tmp"
    tmp.write_text(json.dumps(clean, indent=1) + "\n")
    tmp.replace(out_dir / "latest.json")
    keys = ordered_keys(clean)
    with open(out_dir / "latest.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in clean:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in r.items()})


def _ratio(base: float | None, ours: float | None) -> str:
    return f"{base / ours:.2f}x" if base and ours and ours > 0 and base > 0 else "-"


def _status(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "skipped"
    if row.get("check") == "FAIL":
        what = row.get("grad_fail") or f"out rel {row['rel_err']:.1e}"
        return f"**FAIL** ({what})"
    if row.get("error"):
        return "error"
    return row.get("check") or "-"


def markdown(rows: list[dict[str, Any]], timing_method: str) -> str:
    """Two tables: mmsparse vs Flex per config, then every (config, impl) row; plus the run's provenance."""
    by = {(r["config"], r["impl"]): r for r in rows}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    first = rows[0] if rows else {}
    lines = [
        f"Run: {first.get('gpu')}, torch {first.get('torch')}, triton {first.get('triton')}, commit "
        f"{first.get('commit')}, {datetime.date.today().isoformat()}. bf16; {timing_method}; bwd = (fwd+bwd) - fwd; "
        "TF/s count live pairs only (4·B·Hq·D·live fwd, 2.5x bwd), also for dense_flash, which computes every pair.",
        "",
        "| config | S | density | mmsparse fwd ms | flex fwd ms | fwd speedup | mmsparse bwd ms | flex bwd ms "
        "| bwd speedup | build ms mmsparse / flex |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        m, f = by.get((c, "mmsparse"), {}), by.get((c, "flex"), {})
        any_row = m or f or next(r for r in rows if r["config"] == c)
        lines.append(
            f"| {c} | {any_row.get('seq_len')} | {fmt(any_row.get('density'), 2)} | {fmt(m.get('fwd_ms'))} | "
            f"{fmt(f.get('fwd_ms'))} | {_ratio(f.get('fwd_ms'), m.get('fwd_ms'))} | {fmt(m.get('bwd_ms'))} | "
            f"{fmt(f.get('bwd_ms'))} | {_ratio(f.get('bwd_ms'), m.get('bwd_ms'))} | "
            f"{fmt(m.get('build_ms'), 2)} / {fmt(f.get('build_ms'), 2)} |"
        )
    lines += [
        "",
        "| config | impl | fwd ms | bwd ms | fwd TF/s | bwd TF/s | peak MiB | build ms | fwd vs flex | bwd vs flex "
        "| check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        f = by.get((r["config"], "flex"), {})
        lines.append(
            f"| {r['config']} | {r['impl']} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('bwd_ms'))} | "
            f"{fmt(r.get('fwd_tflops'), 0)} | {fmt(r.get('bwd_tflops'), 0)} | {fmt(r.get('peak_mib'), 0)} | "
            f"{fmt(r.get('build_ms'), 2)} | {_ratio(f.get('fwd_ms'), r.get('fwd_ms'))} | "
            f"{_ratio(f.get('bwd_ms'), r.get('bwd_ms'))} | {_status(r)} |"
        )
    notes = [f"- {r['config']} / {r['impl']}: {r['error']}" for r in rows if r.get("error")]
    if notes:
        lines += ["", "Errors and skips:", "", *notes]
    return "\n".join(lines) + "\n"


def write_final(rows: list[dict[str, Any]], out_dir: Path, timing_method: str, plot: bool) -> str:
    write_json_csv(rows, out_dir)
    table = markdown(rows, timing_method)
    (out_dir / "latest.md").write_text(table)
    if plot and rows:
        try:
            from plot_results import plot as plot_rows

            log(f"plot: {plot_rows(rows, out_dir / 'latest.png')}")
        except ImportError:
            log(f"plot: matplotlib not available; later: python benchmarks/plot_results.py {out_dir / 'latest.json'}")
        except Exception as e:
            log(f"plot failed: {short_error(e)}")
    return table


# ---------------------------------------------------------------------------------------------------------------


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"configs {', '.join(QUICK)} and shorter timing")
    p.add_argument("--configs", default=None, help=f"comma-separated, from: {', '.join(CONFIGS)}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from: {', '.join(IMPLS)}")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results)")
    p.add_argument("--device", default="cuda", help="default cuda")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warmup in ms (default 25, quick 10)")
    p.add_argument("--rep", type=int, default=None, help="do_bench measuring time in ms (default 200, quick 50)")
    p.add_argument("--rounds", type=_at_least_one, default=None,
                   help="timing rounds over the implementations of a config, interleaved; each row keeps its best "
                        "(default 3, quick 1)")
    p.add_argument("--no-grad-check", dest="grad_check", action="store_false",
                   help="check only the outputs, not dq/dk/dv")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    p.add_argument("--isolate", action="store_true",
                   help="run each (config, impl) in its own subprocess, so a CUDA crash costs one row")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of recorded errors")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test of the whole flow
    p.add_argument("--cpu-reps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one --isolate subprocess
    return p.parse_args(argv)


def select(args: argparse.Namespace) -> tuple[list[BenchConfig], list[str]]:
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
    else:
        names = list(TINY if args.tiny else QUICK if args.quick else {**CONFIGS, **DECODE_CONFIGS})
    unknown = [n for n in names if n not in ALL_CONFIGS]
    impls = [n.strip() for n in args.impls.split(",") if n.strip()]
    unknown += [n for n in impls if n not in IMPLS]
    if unknown:
        raise SystemExit(f"unknown config/impl: {', '.join(unknown)}; configs: {', '.join(ALL_CONFIGS)}; "
                         f"impls: {', '.join(IMPLS)}")
    return [ALL_CONFIGS[n] for n in names], impls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verbose:
        os.environ["BENCH_VERBOSE"] = "1"
    configs, impls = select(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device here; for a CPU smoke test of the harness: --device cpu --tiny")
        return 2
    torch.set_float32_matmul_precision("highest")  # the float32 reference must not run in TF32
    if device.type == "cpu":  # smoke test: tiny ops, where OpenMP threads mostly spin against each other
        torch.set_num_threads(1)
    if device.type == "cpu" and not mmsparse.interpreter_active():
        log("warning: Triton's interpreter is off, so mmsparse cannot run on CPU tensors (set TRITON_INTERPRET=1)")
    out_dir = args.out
    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="mmsparse-bench-tiny-")) if args.tiny else BENCH_DIR / "results"
    timing = Timing(device, args.warmup or (10 if args.quick else 25), args.rep or (50 if args.quick else 200),
                    cpu_reps=args.cpu_reps, rounds=args.rounds or (1 if args.quick or args.tiny else 3))
    for name in ("recompile_limit", "cache_size_limit"):  # one Flex compile per config and grad mode
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    env = environment(device)
    log(f"mmsparse benchmark: {env}; {timing.method}; out {out_dir}")
    log(f"configs {', '.join(c.name for c in configs)}; impls {', '.join(impls)}")

    def save(rows: list[dict[str, Any]]) -> None:
        write_json_csv(rows, out_dir)

    status = 0
    start = time.perf_counter()
    if args.isolate:
        rows = run_isolated(args, configs, impls, env, timing, save)
    else:
        runner = Runner(args, device, timing, env, len(configs) * len(impls), save)
        remaining = list(configs)
        try:
            while remaining:
                runner.run_config(remaining[0], impls)
                remaining.pop(0)
        except DeviceLost as e:
            log(f"CUDA context lost ({e}); the remaining rows were not run. Rerun them with --isolate.")
            for cfg in remaining[1:]:
                for name in impls:
                    row = base_row(cfg, name, env, timing)
                    row["error"] = "not run: CUDA context lost earlier in this process"
                    runner.emit(row)
            status = 3
        except KeyboardInterrupt:
            log("interrupted: writing what was measured")
            status = 130
        rows = runner.rows
    if args.child:
        save(rows)
        return status
    table = write_final(rows, out_dir, timing.method, args.plot)
    log("")
    log(table)
    failed = [f"{r['config']}/{r['impl']}" for r in rows if r.get("check") == "FAIL"]
    if failed:
        log(f"!!! FAIL: {', '.join(failed)} do not match the reference")
    log(f"wrote {out_dir}/latest.{{json,csv,md}} in {time.perf_counter() - start:.0f} s")
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
