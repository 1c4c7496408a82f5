"""Where one training step's GPU time goes, per attention backend: ``python -m benchmarks.hf_vlm`` profiles one
step of each backend after timing it (:func:`step_breakdown`).

One step runs under ``torch.profiler`` with two kinds of labelled ranges:
- ``attention``: each call of the backend's attention function (transformers' ``AttentionInterface``, looked up
  through ``ALL_ATTENTION_FUNCTIONS.get_interface``; with activation checkpointing the recomputed forwards too),
  and each autograd node of the backend's attention backward (:data:`BACKWARD_NODES`);
- ``mask``: the model's mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``,
  ``create_masks_for_generate`` as the Gemma 3 modelling module calls them).
A range's GPU time is that of every kernel launched inside it (its own and its children's). A range inside another
of the same kind counts once. The rest is every other kernel: the projections, MLPs, norms, loss and the optimizer
of none (the step has none). Where a backend builds its block lists inside its attention calls (mmsparse, on the
first layer of a step, cached for the others), that build counts as attention.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable

import torch

# The autograd nodes whose kernels are a backend's attention backward: mmsparse's autograd function, SDPA's
# backends, and the compiled flex_attention of transformers' flex backend (its only compiled function).
BACKWARD_NODES = {
    "mmsparse": ("MBSAttentionFunctionBackward",),
    "sdpa": ("ScaledDotProduct",),  # its flash, efficient, cuDNN and CPU backends' nodes
    "flex_attention": ("CompiledFunctionBackward", "FlexAttentionBackward"),
}
MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
ATTENTION, MASK = "hf_breakdown.attention", "hf_breakdown.mask"


def _labelled(fn: Callable, label: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def labelled_ranges(modelling: Any) -> Iterator[None]:
    """Within: the model's attention functions and mask functions run inside labelled profiler ranges.
    ``modelling``: the model's modelling module (its globals are the names the model calls)."""
    interfaces = modelling.ALL_ATTENTION_FUNCTIONS
    lookup = interfaces.get_interface
    saved = {name: getattr(modelling, name) for name in MASK_FUNCTIONS if hasattr(modelling, name)}

    def get_interface(name: str, default: Callable) -> Callable:
        return _labelled(lookup(name, default), ATTENTION)

    interfaces.get_interface = get_interface  # an instance attribute over the class's method, deleted after
    for name, fn in saved.items():
        setattr(modelling, name, _labelled(fn, MASK))
    try:
        yield
    finally:
        del interfaces.get_interface
        for name, fn in saved.items():
            setattr(modelling, name, fn)


def _is_annotation(event: Any) -> bool:
    """A labelled range's span on the GPU timeline (no kernel of its own)."""
    return bool(getattr(event, "is_user_annotation", False))


def _is_kernel(event: Any) -> bool:
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA and not _is_annotation(event)


def _device_us(event: Any, spans: set[str]) -> float:
    """GPU time (µs) of the kernels launched inside ``event`` and its children; ``spans``: the names of labelled
    ranges, whose GPU-timeline spans the profiler may attach like kernels."""
    own = sum(k.duration for k in event.kernels if k.name not in spans)
    return own + sum(_device_us(child, spans) for child in event.cpu_children)


def _outermost_us(events: Any, matches: Callable[[str], bool], spans: set[str]) -> tuple[float, float, int]:
    """(GPU µs, CPU µs, count) of the events whose name ``matches``, each counted once: an event inside another
    match is left out."""
    gpu = cpu = 0.0
    count = 0
    for event in events:
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CPU or not matches(event.name):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = matches(parent.name), parent.cpu_parent
        if not nested:
            gpu, cpu, count = gpu + _device_us(event, spans), cpu + event.cpu_time_total, count + 1
    return gpu, cpu, count


def summarize(events: Any, impl: str) -> dict[str, Any]:
    """The breakdown of a profiled step's ``events`` (``profiler.events()``) for backend ``impl``."""
    nodes = BACKWARD_NODES.get(impl, ())
    spans = {e.name for e in events if _is_annotation(e)}
    total = sum(e.time_range.elapsed_us() for e in events if _is_kernel(e))
    fwd_gpu, _, calls = _outermost_us(events, lambda n: n == ATTENTION, spans)
    bwd_gpu, _, backwards = _outermost_us(
        events, lambda n: n.startswith("autograd::engine::evaluate_function: ") and any(node in n for node in nodes),
        spans)
    mask_gpu, mask_cpu, masks = _outermost_us(events, lambda n: n == MASK, spans)
    attention = fwd_gpu + bwd_gpu
    return {
        "gpu_ms": total / 1e3, "attention_fwd_gpu_ms": fwd_gpu / 1e3, "attention_bwd_gpu_ms": bwd_gpu / 1e3,
        "attention_gpu_ms": attention / 1e3, "mask_gpu_ms": mask_gpu / 1e3, "mask_host_ms": mask_cpu / 1e3,
        "rest_gpu_ms": (total - attention - mask_gpu) / 1e3, "attention_calls": calls,
        "attention_backwards": backwards, "mask_calls": masks, "backward_separated": bool(nodes),
    }


def step_breakdown(step: Callable[[], None], modelling: Any, impl: str) -> dict[str, Any]:
    """Profile one ``step()`` (forward + backward, synchronised inside) with the labelled ranges of ``modelling``
    and summarise it for backend ``impl``. The attention backward of a backend without :data:`BACKWARD_NODES`
    (eager: many small autograd nodes) is not separated: it counts as the rest, which the record says."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with labelled_ranges(modelling), profile(activities=activities) as prof:
        step()
    return summarize(prof.events(), impl)
