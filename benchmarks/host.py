"""The user's step, not the kernels alone: host time per call, the kernels' GPU time, and forward + backward wall
time eager, CUDA-graphed and compiled, beside dense cuDNN attention of the same shapes, in one run.

- ``seed`` (B 8, H 16, D 64, segments (50, 375, 500), cyclic): ``host_us_fwd`` and ``host_us_fwd_bwd``, the median
  host time of one call (no sync; cached lengths), ``host_us_fwd_bwd_one_thread`` (the same with the backward
  on the calling thread, ``torch.autograd.set_multithreading_enabled(False)``, instead of autograd's thread for the
  device: what handing the backward to that thread and back costs), ``host_us_fwd_bwd_nondet`` (the same with
  ``deterministic=False``), ``host_us_fwd_bwd_new_lengths`` (device lengths new every call,
  ``check_lengths=False``), ``host_us_bwd`` (the backward alone, ``autograd.grad`` of a kept forward),
  ``host_us_autograd_floor`` (a forward + backward through one autograd node that only allocates its outputs),
  ``host_us_fwd_op`` and ``host_us_bwd_op`` (one call of the forward and of the backward custom op as a compiled
  graph makes it: the lengths host values, q, k, v and dO strided as a layer's projections give them),
  ``gpu_kernel_ms`` (the kernels' GPU time in one forward + backward, from the profiler),
  ``fwd_bwd_ms`` (do_bench: what a loop of calls takes), ``cudnn_dense_fwd_bwd_ms`` (SDPA's cuDNN backend, no
  mask) and ``cudnn_gpu_kernel_ms`` (its kernels' GPU time: what the seed's step could reach if no host work
  showed), ``graph_fwd_bwd_ms`` (a CUDA graph of the forward + backward, replayed), and a step of four calls (four
  layers) over device lengths new every step, ``layers_new_lengths_ms`` with the lengths given to every call (each
  builds the mask) and ``layers_prepared_ms`` with one ``mmsparse.prepare_mask`` a step given to every call
  (do_bench, side by side; None with an mmsparse without it);
- ``small_2k`` (B 4, H 16, D 128, segments (256, 1024, 768), hub): ``fwd_bwd_ms``, ``cudnn_dense_fwd_bwd_ms``;
- ``block`` (two ``MultimodalSelfAttention`` layers at the seed's lengths, E 1024, H 16, B 8, bf16): forward +
  backward ``eager_ms``, ``compile_ms`` (``torch.compile``), ``reduce_overhead_ms``
  (``torch.compile(mode="reduce-overhead")``), and the same block with dense SDPA in place of mmsparse (the
  layers' ``attention`` overridden: torch's own eager and compiled step on that host, ``sdpa_eager_ms``,
  ``sdpa_compile_ms``), taking turns in 5 rounds (:func:`interleaved_ms`).

    python -m benchmarks.host                  # GPU: benchmarks/results/<gpu>/host.{json,md}
    python -m benchmarks.host --device cpu --out DIR   # CPU smoke run (the interpreter; tiny shapes, no cuDNN,
                                                       # graphs or compile rows)
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import mmsparse  # noqa: F401  (turns on Triton's interpreter without CUDA, before triton is imported)
from mmsparse import mbs_attention
from mmsparse.nn import MultimodalSelfAttention

from .env import environment, record_dir
from .report import fmt, write_record

TOPIC = "host"
CYCLIC = [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
HUB = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    head_dim: int
    seg_lens: tuple[int, ...]
    topology: list[list[int]]

    @property
    def seq(self) -> int:
        return sum(self.seg_lens)


GPU_SHAPES = {"seed": Shape(8, 16, 64, (50, 375, 500), CYCLIC), "small_2k": Shape(4, 16, 128, (256, 1024, 768), HUB)}
CPU_SHAPES = {"seed": Shape(1, 2, 16, (5, 12, 15), CYCLIC), "small_2k": Shape(1, 2, 16, (8, 16, 12), HUB)}
BLOCK_GPU = dict(embed_dim=1024, heads=16, batch=8)
BLOCK_CPU = dict(embed_dim=32, heads=2, batch=1)


def _inputs(shape: Shape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    def make() -> torch.Tensor:
        return torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, device=device, dtype=dtype)

    q, k, v = (make().requires_grad_() for _ in range(3))
    return q, k, v, make()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(step: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Median host time of one ``step()`` in microseconds, the GPU queue kept short (a sync every 10 calls, outside
    the timed region) so that no call waits for the device."""
    step()
    _sync(device)
    times = []
    for i in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if i % 10 == 9:
            _sync(device)
    _sync(device)
    return statistics.median(times) * 1e6


def one_thread_host_us(step: Callable[[], Any], device: torch.device, calls: int) -> float:
    """:func:`host_us` with autograd running backwards on the calling thread (on a GPU it otherwise hands each to a
    thread of its own for the device and waits for it)."""
    with torch.autograd.set_multithreading_enabled(False):
        return host_us(step, device, calls)


def wall_ms(step: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Median time of ``step()`` in ms: do_bench on a GPU, a wall-clock median on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(step, warmup=50, rep=300, return_mode="median"))
    step()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gpu_kernel_ms(step: Callable[[], Any], steps: int = 10) -> float:
    """The GPU time of the kernels one ``step()`` launches, from the profiler (the sum of their durations)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages())
    return total_us / steps / 1e3


def graph_ms(step: Callable[[], Any]) -> float:
    """Replay time of a CUDA graph of ``step()`` (captured after warm-up on a side stream)."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return float(do_bench(graph.replay, warmup=50, rep=300, return_mode="median"))


def _fwd_bwd(q, k, v, grad, **kwargs) -> Callable[[], None]:
    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        mbs_attention(q, k, v, **kwargs).backward(grad)

    return step


class _Empty(torch.autograd.Function):
    """One autograd node whose forward and backward only allocate their outputs: what any attention call's forward
    + backward costs the host before its own work."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[override]
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


def _autograd_floor(q, k, v, grad) -> Callable[[], None]:
    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        _Empty.apply(q, k, v).backward(grad)

    return step


def _dense_cudnn(q, k, v, grad) -> Callable[[], None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v).backward(grad)

    return step


def op_calls(shape: Shape, device: torch.device, dtype: torch.dtype, calls: int) -> dict[str, float]:
    """Host time of one call of the compiled graph's forward op and of its backward op (:func:`host_us`), called as a
    traced graph calls them: the plan's text, the mask's kernel tensors and host values, q, k, v and dO views of
    ``[B, S, H * D]`` projections."""
    from mmsparse.attention import custom_ops
    from mmsparse.attention.config import current_settings
    from mmsparse.mask.build import build_mask_info, host_values_key

    batch, heads, seq, head_dim = shape.batch, shape.heads, shape.seq, shape.head_dim
    q, k, v, grad = (torch.randn(batch, seq, heads * head_dim, device=device, dtype=dtype)
                     .view(batch, seq, heads, head_dim).transpose(1, 2) for _ in range(4))
    info = build_mask_info(shape.topology, shape.seg_lens, seq, seq, False, device)
    host_values = host_values_key(shape.topology, list(shape.seg_lens), seq, seq, False, False, None)
    scale = head_dim**-0.5
    traced = custom_ops.traced_plan(q, k, info, scale, 0.0, True, current_settings())
    plan = traced.text
    # the mask tensors a traced call of these host values hands its ops (none where they read the kept mask)
    traced_info = copy.copy(info)  # the cached mask itself is left as eager calls read it
    traced_info.host_values = host_values
    mask = custom_ops.TracedCall.of(traced, traced_info).mask
    out, lse = custom_ops._fwd_op(q, k, v, mask, [], None, scale, 0.0, plan, host_values)
    return {
        "host_us_fwd_op": host_us(lambda: custom_ops._fwd_op(q, k, v, mask, [], None, scale, 0.0, plan, host_values),
                                  device, calls),
        "host_us_bwd_op": host_us(lambda: custom_ops._bwd_op(grad, q, k, v, out, lse, mask, [], None, scale, 0.0, plan,
                                                             host_values), device, calls),
    }


def new_lengths_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, shape: Shape,
                     calls: int) -> Callable[[], None]:
    """Forward + backward with the shape's lengths as a new device tensor every call (``check_lengths=False``): the
    mask and its lists are built in the call. ``calls + 1`` tensors, made now and taken in turn: none comes back
    within one timing of ``calls`` calls and its warm-up."""
    lens = [torch.tensor(shape.seg_lens, device=q.device) for _ in range(calls + 1)]
    fresh = itertools.cycle(lens)

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        mbs_attention(q, k, v, shape.topology, next(fresh), check_lengths=False).backward(grad)

    return step


def layers_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, shape: Shape,
                 layers: int = 4) -> dict[str, Callable[[], None]]:
    """A step of ``layers`` calls (the layers of a model) over device lengths new every step (``check_lengths=False``,
    a few tensors taken in turn: a tensor's mask is never kept, so each is as new as any): ``layers_new_lengths_ms``
    gives the lengths to every call, ``layers_prepared_ms`` one ``prepare_mask`` of them a step (absent with an
    mmsparse without it: the A/B tools run this harness over older trees)."""
    lens = itertools.cycle([torch.tensor(shape.seg_lens, device=q.device) for _ in range(8)])
    prepare = getattr(mmsparse, "prepare_mask", None)

    def step(prepared: bool) -> None:
        lengths = next(lens)
        seg = prepare(shape.topology, lengths, shape.seq, check_lengths=False) if prepared else lengths
        for t in (q, k, v):
            t.grad = None
        outs = [mbs_attention(q, k, v, shape.topology, seg, check_lengths=False) for _ in range(layers)]
        torch.stack(outs).sum(0).backward(grad)

    steps = {"layers_new_lengths_ms": lambda: step(False)}
    if prepare is not None:
        steps["layers_prepared_ms"] = lambda: step(True)
    return steps


def seed_row(shape: Shape, device: torch.device, dtype: torch.dtype, calls: int) -> dict[str, float | None]:
    q, k, v, grad = _inputs(shape, device, dtype)
    kw = dict(topology=shape.topology, seg_lens=shape.seg_lens)
    fwd_bwd = _fwd_bwd(q, k, v, grad, **kw)
    row: dict[str, float | None] = {
        "host_us_fwd": host_us(lambda: mbs_attention(q.detach(), k.detach(), v.detach(), **kw), device, calls),
        "host_us_fwd_bwd": host_us(fwd_bwd, device, calls),
        "host_us_fwd_bwd_one_thread": one_thread_host_us(fwd_bwd, device, calls),
        "host_us_fwd_bwd_nondet": host_us(_fwd_bwd(q, k, v, grad, deterministic=False, **kw), device, calls),
    }
    row["host_us_fwd_bwd_new_lengths"] = host_us(new_lengths_step(q, k, v, grad, shape, calls), q.device, calls)
    layer_steps = layers_steps(q, k, v, grad, shape)
    for name in ("layers_new_lengths_ms", "layers_prepared_ms"):
        row[name] = wall_ms(layer_steps[name], device, calls) if name in layer_steps else None
    row["fwd_bwd_ms"] = wall_ms(fwd_bwd, device, calls)
    cuda = device.type == "cuda"
    row["gpu_kernel_ms"] = gpu_kernel_ms(fwd_bwd) if cuda else None
    row["cudnn_dense_fwd_bwd_ms"] = wall_ms(_dense_cudnn(q, k, v, grad), device, calls) if cuda else None
    row["cudnn_gpu_kernel_ms"] = gpu_kernel_ms(_dense_cudnn(q, k, v, grad)) if cuda else None
    row["graph_fwd_bwd_ms"] = graph_ms(fwd_bwd) if cuda else None
    out = mbs_attention(q, k, v, **kw)  # after the capture: a kept graph's backward is not captured

    def backward_only() -> None:
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    row["host_us_bwd"] = host_us(backward_only, device, calls)
    row["host_us_autograd_floor"] = host_us(_autograd_floor(q, k, v, grad), device, calls)
    row.update(op_calls(shape, device, dtype, calls))
    return row


def small_row(shape: Shape, device: torch.device, dtype: torch.dtype, calls: int) -> dict[str, float | None]:
    q, k, v, grad = _inputs(shape, device, dtype)
    cuda = device.type == "cuda"
    return {
        "fwd_bwd_ms": wall_ms(_fwd_bwd(q, k, v, grad, topology=shape.topology, seg_lens=shape.seg_lens), device,
                              calls),
        "cudnn_dense_fwd_bwd_ms": wall_ms(_dense_cudnn(q, k, v, grad), device, calls) if cuda else None,
    }


class _DenseBlockLayer(MultimodalSelfAttention):
    """The block's layer with dense SDPA for its attention (same projections and layout): what the host costs torch
    alone."""

    def attention(self, q, k, v, seg_lens, causal):  # type: ignore[override]
        return F.scaled_dot_product_attention(q, k, v)


def block_steps(seg_lens: tuple[int, ...], device: torch.device, dtype: torch.dtype, embed_dim: int, heads: int,
                batch: int) -> tuple[dict[str, Callable[[], None]], Callable[[], list[float]]]:
    """The block's steps by mode (eager only off the GPU) and a checksum of its compiled step (its output's and its
    input gradient's absolute sums in float64; the eager step's where nothing compiles): equal checksums across two
    trees mean equal outputs and gradients."""
    def two_layers(layer: type[MultimodalSelfAttention]) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(layer(embed_dim, heads, CYCLIC, seg_lens, device=device, dtype=dtype)
                                     for _ in range(2)))

    layers, dense = two_layers(MultimodalSelfAttention), two_layers(_DenseBlockLayer)
    torch.manual_seed(1)
    x = torch.randn(batch, sum(seg_lens), embed_dim, device=device, dtype=dtype, requires_grad=True)

    def stepper(layers: torch.nn.Module, model: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        params = list(layers.parameters())

        def step() -> None:
            x.grad = None
            for p in params:
                p.grad = None
            model(x).sum().backward()

        return step

    if device.type != "cuda":
        return {"eager_ms": stepper(layers, layers)}, lambda: _checksum(layers, x)
    torch._dynamo.reset()
    compiled = torch.compile(layers)
    steps = {"eager_ms": stepper(layers, layers), "compile_ms": stepper(layers, compiled),
             "reduce_overhead_ms": stepper(layers, torch.compile(layers, mode="reduce-overhead")),
             "sdpa_eager_ms": stepper(dense, dense), "sdpa_compile_ms": stepper(dense, torch.compile(dense))}
    return steps, lambda: _checksum(compiled, x)


def _checksum(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[float]:
    x.grad = None
    out = model(x)
    out.sum().backward()
    return [float(out.detach().double().abs().sum()), float(x.grad.double().abs().sum())]


def block_row(seg_lens: tuple[int, ...], device: torch.device, dtype: torch.dtype, calls: int, embed_dim: int,
              heads: int, batch: int) -> dict[str, float | None]:
    steps, _ = block_steps(seg_lens, device, dtype, embed_dim, heads, batch)
    if device.type != "cuda":
        return {"eager_ms": wall_ms(steps["eager_ms"], device, calls), "compile_ms": None,
                "reduce_overhead_ms": None, "sdpa_eager_ms": None, "sdpa_compile_ms": None}
    return interleaved_ms(steps, device)


def interleaved_ms(steps: dict[str, Callable[[], None]], device: torch.device, rounds: int = 5,
                   calls: int = 50, warmup: int = 10) -> dict[str, float | None]:
    """Median over ``rounds`` of each step's mean time in ms over ``calls`` calls, the steps taking turns in each
    round (a host-bound step's time drifts with the machine: turns keep the ratios fair), after ``warmup`` calls of
    each (they compile, warm up and capture)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                step()
            _sync(device)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def markdown(record: dict[str, Any]) -> str:
    seed, small, block = record["seed"], record["small_2k"], record["block"]
    lines = [
        f"Host time and the user's step (`python -m benchmarks.host`). {record['gpu']}; torch {record['torch']}, "
        f"triton {record['triton']}; commit {record['commit']}. Host times are medians of one call without a "
        "sync; the block's are medians of 5 rounds in which its modes take turns; the other times are do_bench "
        "medians, side by side in one run.",
        "",
        "| row | measure | value |",
        "|---|---|---:|",
    ]
    for name, row in (("seed", seed), ("small_2k", small), ("block", block)):
        lines += [f"| {name} | {key} | {fmt(value)} |" for key, value in row.items()]
    if seed.get("cudnn_dense_fwd_bwd_ms"):
        seed_ratio = seed["fwd_bwd_ms"] / seed["cudnn_dense_fwd_bwd_ms"]
        lines += ["", f"Seed forward + backward / dense cuDNN: {seed_ratio:.2f}; "
                  f"small_2k: {small['fwd_bwd_ms'] / small['cudnn_dense_fwd_bwd_ms']:.2f}; block compiled / eager: "
                  f"{block['compile_ms'] / block['eager_ms']:.2f} (with dense SDPA: "
                  f"{block['sdpa_compile_ms'] / block['sdpa_eager_ms']:.2f}), reduce-overhead / eager: "
                  f"{block['reduce_overhead_ms'] / block['eager_ms']:.2f}. Seed host forward + backward "
                  f"{seed['host_us_fwd_bwd']:.0f} us against {seed['gpu_kernel_ms'] * 1e3:.0f} us of kernels "
                  f"({seed['host_us_fwd_bwd_one_thread']:.0f} us with the backward on the calling thread); an "
                  f"autograd node that only allocates takes {seed['host_us_autograd_floor']:.0f} us. Dense cuDNN's "
                  f"step runs {seed['cudnn_gpu_kernel_ms'] * 1e3:.0f} us of kernels."]
        if seed.get("layers_prepared_ms"):
            lines[-1] += (f" Four calls over new device lengths: a mask prepared once a step "
                          f"{seed['layers_new_lengths_ms'] / seed['layers_prepared_ms']:.2f}x faster than the "
                          "lengths given to every call.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--calls", type=int, default=None, help="timed calls per host measure (GPU 200, CPU 3)")
    p.add_argument("--out", type=Path, default=None, help="folder of host.json and host.md (default "
                                                          "benchmarks/results/<gpu>/; a temporary folder on the CPU)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    calls = args.calls or (200 if cuda else 3)
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    dtype = torch.bfloat16 if cuda else torch.float32
    record = {
        **environment(device),
        "seed": seed_row(shapes["seed"], device, dtype, calls),
        "small_2k": small_row(shapes["small_2k"], device, dtype, calls),
        "block": block_row(shapes["seed"].seg_lens, device, dtype, calls, **(BLOCK_GPU if cuda else BLOCK_CPU)),
    }
    out = args.out or record_dir(record["gpu"], TOPIC)
    path = write_record(out, TOPIC, record, markdown(record))
    print(markdown(record))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
