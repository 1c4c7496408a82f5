"""How one call is timed: ``triton.testing.do_bench`` medians on CUDA, a wall-clock median on CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .devices import sync


@dataclass
class Timing:
    device: torch.device
    warmup: int  # do_bench warmup, ms
    rep: int  # do_bench measuring time, ms
    cpu_warmup: int = 2  # CPU fallback: at least this many warm-up calls
    cpu_reps: int = 3  # CPU fallback: at least this many timed calls
    rounds: int = 1  # timing rounds over the implementations of a config, interleaved; the best is kept

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
        return self._cpu_ms(fn, grad_to_none)

    def _cpu_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor] | None) -> float:
        # Shaped like do_bench: warm up for ~warmup ms, then measure for ~rep ms; the first calls on CPU are slow
        # (lazy init, thread pools).
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
        if self.device.type == "cuda":
            return host_ms(fn, self.device)
        # The CPU fallback's counts: through the interpreter one build of a tiny mask takes seconds.
        return host_ms(fn, self.device, min_reps=max(1, self.cpu_reps), warmup_calls=self.cpu_warmup)


def time_passes(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, timing: Timing) -> dict[str, float]:
    """``fwd_ms`` (the forward with autograd on, as in training) and ``fwdbwd_ms`` (forward + backward) of one
    attention call. The gradients are reset before each backward, so no accumulation is timed."""
    fwd = timing.kernel_ms(lambda: fn(q, k, v))
    fwdbwd = timing.kernel_ms(lambda: fn(q, k, v).backward(dout), grad_to_none=[q, k, v])
    q.grad = k.grad = v.grad = None
    return {"fwd_ms": fwd, "fwdbwd_ms": fwdbwd}


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
