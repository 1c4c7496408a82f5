"""The implementations a benchmark compares: mmsparse and what a user would otherwise reach for.

  - ``mmsparse``: ``mmsparse.mbs_attention`` with the config's topology, segment lengths and window; for a pack
    ``mmsparse.mbs_attention_varlen`` with its ``[N, k]`` lengths (:func:`mmsparse_fn`).
  - ``mmsparse_nondet``: the same with ``deterministic=False``, the one-pass backward (not in the default list).
  - ``flex``: ``torch.compile(flex_attention)`` with :func:`benchmarks.flex_mask.flex_mask_mod` and a block mask
    from ``create_block_mask``.
  - ``flex_flash``: the same with ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4 CuTe-DSL kernels;
    torch >= 2.11, Hopper, the ``flash_attn.cute`` and ``cutlass`` packages), the ``mask_mod`` with int32 captures
    and 128 x 128 blocks. Its row adds ``first_call_s`` and ``deterministic_bwd``. Skipped, with the reason, where
    it cannot run (:func:`flex_flash_unavailable`, or a first call that fails to compile).
  - ``sdpa_mask``: ``F.scaled_dot_product_attention`` with a dense bool mask ``[1, 1, Sq, Sk]`` (the config's
    reference mask, window included), on the cuDNN backend, else the memory-efficient one (never the math backend
    on CUDA).
  - ``dense_flash``: SDPA's FlashAttention-2 backend with no mask (``is_causal`` on configs with causal pairs,
    ``cfg.dense_causal``; never a window): the cost of ignoring the sparsity. A speed reference only: it computes
    another mask.
  - ``fa4_dense``: FlashAttention-4's own kernel (``flash_attn.cute.flash_attn_func``, Hopper; not in the default
    list) with no mask, causal as ``dense_flash``: the fastest dense kernel there is, the bar for a config that is
    one causal segment (``dense_causal_d256``), a speed reference elsewhere.

Each ``setup_*`` returns an :class:`Impl` (the call plus the cost of its mask state) or raises :class:`Skip`.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

import mmsparse

from .cases import Case
from .check import RTOL_OUT, compare
from .configs import BenchConfig
from .devices import allocated, device_alive, free_memory, sync
from .errors import DeviceLost, Skip, short_error
from .flex_mask import flex_mask_mod, packed_ids, segment_ids
from .impl import Impl, TensorFn
from .timing import Timing

IMPLS = ("mmsparse", "mmsparse_nondet", "flex", "flex_flash", "sdpa_mask", "dense_flash", "fa4_dense")
# The opt-in backward, and FlashAttention-4's dense kernel (its own install), only when asked for
DEFAULT_IMPLS = tuple(n for n in IMPLS if n not in ("mmsparse_nondet", "fa4_dense"))
# Left out of a CPU run's default list, with why: they cannot be timed there (named in --impls they still run, and
# flex then checks its forward's mask).
NOT_ON_CPU = {"flex": "FlexAttention has no backward on a CPU", "flex_flash": "its FLASH backend needs a Hopper GPU"}
SDPA_MASK_BYTES_PER_PAIR = 5  # bool mask + the bf16 bias SDPA makes from it on each call (+ alignment copies)
SDPA_MASK_MEM_FRACTION = 0.6  # skip sdpa_mask when that estimate exceeds this share of free memory

BIG_TOPOLOGY = 16  # segments: above this, mmsparse is given an mmsparse.Topology built once (see mmsparse_fn)
FLASH_BLOCK = 128  # FLASH's sparse block size is fixed: its BlockMask must be built with it
FLASH_MIN_TORCH = (2, 11)  # the oldest torch this benchmark runs FLASH on (the one its install steps target)
FLASH_ARCH = (9, 0)  # the FlashAttention-4 kernels this benchmark compares with are Hopper's
FLASH_SETUP_HINT = "to install it: benchmarks/README.md, 'Installing the FLASH backend'"

def _build_state(case: Case, timing: Timing, build: Callable[[], Any]) -> tuple[Any, float | None, float]:
    """Build once (keeping the result), report the memory it holds, then time fresh builds."""
    base = allocated(case.device)
    state = build()
    sync(case.device)
    state_mib = (allocated(case.device) - base) / 2**20 if case.device.type == "cuda" else None
    return state, state_mib, timing.host_ms(build)


def call_topology(cfg: BenchConfig) -> Any:
    """The topology as mmsparse is given it: the config's tuples, or above ``BIG_TOPOLOGY`` segments an
    ``mmsparse.Topology`` (validated and hashed once)."""
    return mmsparse.Topology(cfg.topology) if cfg.num_segments > BIG_TOPOLOGY else cfg.topology


def mmsparse_fn(cfg: BenchConfig, device: torch.device, deterministic: bool = True) -> TensorFn:
    """mmsparse as a user calls it for ``cfg`` (``deterministic=False``: the one-pass backward).

    ``mbs_attention`` with host lengths (its mask is built once and cached); a topology of more than
    ``BIG_TOPOLOGY`` segments goes in as an ``mmsparse.Topology`` built once, as a caller of such a topology would
    hold it (a nested tuple is keyed by its repr, ~10 ms a call at 257 segments). A pack: ``mbs_attention_varlen``
    with its ``[N, k]`` host lengths, cached the same way (the build from device lengths is ``build_ms``).
    """
    topology = call_topology(cfg)
    if cfg.packed:
        rows = [list(r) for r in cfg.seg_lens]

        def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return mmsparse.mbs_attention_varlen(q, k, v, topology, rows, causal=cfg.causal, window=cfg.window,
                                                 deterministic=deterministic)

        return varlen

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mmsparse.mbs_attention(q, k, v, topology, cfg.seg_lens, causal=cfg.causal, window=cfg.window,
                                      deterministic=deterministic)

    return fn


def mmsparse_build(cfg: BenchConfig, device: torch.device, tiles: Any) -> Callable[[], Any]:
    """The metadata build of one call for new lengths, from a device length tensor, validated (one host sync):
    ``build_mask_info`` with ``[1, k]`` lengths (a tensor is never cached) + the block lists of every kernel; for a
    pack what ``mbs_attention_varlen`` does, ``packed_lens_tensor`` + ``MaskInfo.from_segments(packed=True)``, + the
    block lists."""
    from mmsparse.attention.kernel_args import prepare
    from mmsparse.checks import check_window
    from mmsparse.mask.build import build_mask_info

    if cfg.packed:
        from mmsparse.mask.info import MaskInfo
        from mmsparse.mask.lengths import packed_lens_tensor

        topo = mmsparse.Topology(cfg.topology)  # mbs_attention_varlen's is validated once and kept, too
        rows = torch.tensor(cfg.seg_lens, dtype=torch.int32, device=device)
        total = cfg.seq_k
        window = check_window(cfg.window, total)  # as build_mask_info has it: a window covering every key is None

        def build_packed() -> Any:
            lens = packed_lens_tensor(rows, topo.num_segments, total, device, check_lengths=True)
            info = MaskInfo.from_segments(topo, lens, total, total, cfg.causal, packed=True, window=window)
            return prepare(info, tiles)

        return build_packed

    lens = torch.tensor(cfg.seg_lens, device=device)[None]  # a [1, k] tensor is not cached: every call rebuilds
    topology = call_topology(cfg)

    def build() -> Any:
        info = build_mask_info(topology, lens, cfg.q_len, cfg.seq_k, cfg.causal, device, window=cfg.window)
        return prepare(info, tiles)

    return build


def setup_mmsparse(case: Case, timing: Timing, deterministic: bool = True) -> Impl:
    from mmsparse.attention.config import kernel_config

    cfg, dev = case.cfg, case.device
    tiles = kernel_config(cfg.head_dim, case.q.dtype, dev)
    state, state_mib, build_ms = _build_state(case, timing, mmsparse_build(cfg, dev, tiles))
    del state

    fwd = tiles.forward_tile(cfg.q_len, cfg.seq_k, cfg.seq_k // len(cfg.seg_lens) if cfg.packed else None)
    desc = "; ".join(f"{n} {x.block_m}x{x.block_n} w{x.num_warps} s{x.num_stages}"
                     + (f" (gluon s{x.gluon_stages})" if x.gluon else "")
                     for n, x in ((("fwd", fwd), ("dkdv", tiles.bwd_dkdv), ("dq", tiles.dq_tile(cfg.seq_k)))
                                  if deterministic else (("fwd", fwd), ("one-pass", tiles.one_pass_kernel_tile()))))
    backend = "triton, mbs_attention_varlen" if cfg.packed else "triton"
    if not deterministic:
        backend += ", deterministic=False (one-pass backward)"
    return Impl(mmsparse_fn(cfg, dev, deterministic), build_ms=build_ms, state_mib=state_mib,
                info={"backend": backend, "tiles": desc})


def setup_mmsparse_nondet(case: Case, timing: Timing) -> Impl:
    return setup_mmsparse(case, timing, deterministic=False)


_FLEX: Any = None
_FLEX_FLASH: Any = None


def compiled_flex() -> Any:
    """``torch.compile(flex_attention)``, compiled once per process."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def compiled_flex_flash() -> Any:
    """``torch.compile(flex_attention)`` on the FLASH backend, compiled once per process."""
    global _FLEX_FLASH
    if _FLEX_FLASH is None:
        from torch.nn.attention.flex_attention import flex_attention

        # fullgraph: a graph break would time flex_attention's eager fallback, not the FLASH kernels
        _FLEX_FLASH = torch.compile(functools.partial(flex_attention, kernel_options={"BACKEND": "FLASH"}),
                                    dynamic=False, fullgraph=True)
    return _FLEX_FLASH


def config_mask_mod(cfg: BenchConfig, device: torch.device, index_dtype: torch.dtype = torch.int64) -> Any:
    """The config's Flex ``mask_mod`` (:func:`benchmarks.flex_mask.flex_mask_mod`): its topology, causal flag,
    decode offset or pack documents, and window, with captures of ``index_dtype``."""
    if cfg.packed:
        doc, seg = packed_ids(cfg.rows, device)
        return flex_mask_mod(cfg.topology, seg, cfg.causal, doc=doc, index_dtype=index_dtype, window=cfg.window)
    seg, _ = segment_ids(cfg.seg_lens, cfg.seq_k, device)  # type: ignore[arg-type]
    return flex_mask_mod(cfg.topology, seg, cfg.causal, past=cfg.seq_k - cfg.q_len, index_dtype=index_dtype,
                         window=cfg.window)


def _flex_impl(case: Case, timing: Timing, flex: Any, backend: str, index_dtype: torch.dtype = torch.int64,
               block_size: int | None = None) -> Impl:
    """Flex on the config's ``mask_mod``: the block mask built (and its build timed) with ``block_size`` (Flex's
    default when None) from a ``mask_mod`` whose captured tensors are ``index_dtype``."""
    from torch.nn.attention.flex_attention import create_block_mask

    cfg, dev = case.cfg, case.device
    mask_mod = config_mask_mod(cfg, dev, index_dtype)

    # Past 32k positions the eager build materialises S x S index tensors (32 GiB at 64k): the compiled build, as a
    # user at that size runs it.
    compiled_build = cfg.q_len * cfg.seq_k > 2**30
    sizes = {} if block_size is None else {"BLOCK_SIZE": block_size}

    def build() -> Any:
        return create_block_mask(mask_mod, None, None, cfg.q_len, cfg.seq_k, device=dev, _compile=compiled_build,
                                 **sizes)

    block_mask, state_mib, build_ms = _build_state(case, timing, build)
    gqa = cfg.heads_q != cfg.heads_kv

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    info: dict[str, Any] = {"backend": backend, "tiles": f"block {block_mask.BLOCK_SIZE}"}
    try:
        info["flex_block_sparsity"] = round(float(block_mask.sparsity()), 2)
    except Exception:
        pass
    return Impl(fn, build_ms=build_ms, state_mib=state_mib, info=info)


def setup_flex(case: Case, timing: Timing) -> Impl:
    return _flex_impl(case, timing, compiled_flex(), "flex (torch.compile)")


def flex_flash_unavailable(device: torch.device) -> str | None:
    """Why FlexAttention's FLASH backend cannot run here (every unmet requirement, ``; ``-joined), or None."""
    reasons = []
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None or (int(found[1]), int(found[2])) < FLASH_MIN_TORCH:
        reasons.append(f"needs torch >= {'.'.join(map(str, FLASH_MIN_TORCH))}, this is {torch.__version__}")
    for module in ("cutlass", "flash_attn.cute"):  # nvidia-cutlass-dsl; flash-attn-4
        try:
            importlib.import_module(module)  # an import, not find_spec: a half-installed DSL fails only here
        except Exception as e:
            reasons.append(f"{module} not importable ({short_error(e, 120)})")
    if device.type != "cuda":
        reasons.append(f"needs a CUDA device, not {device.type}")
    elif torch.cuda.get_device_capability(device) != FLASH_ARCH:
        major, minor = torch.cuda.get_device_capability(device)
        reasons.append(f"needs sm_{FLASH_ARCH[0]}{FLASH_ARCH[1]} (Hopper), this GPU is sm_{major}{minor}")
    return f"{'; '.join(reasons)} ({FLASH_SETUP_HINT})" if reasons else None


def _root_error(exc: BaseException) -> str:
    """The innermost cause of a compile error, which names what failed to lower (dynamo's wrapper says only
    ``backend='inductor' raised:``), and the wrapper's type."""
    root: BaseException = exc
    for _ in range(20):  # dynamo keeps the backend's error in inner_exception, others chain it as the cause
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if not isinstance(inner, BaseException):
            break
        root = inner
    text = short_error(root, 300)
    return text if root is exc else f"{text} (raised as {type(exc).__name__})"


def _grads_bits(case: Case) -> list[torch.Tensor]:
    """dq, dk, dv as raw bits (a bitwise comparison: NaN == NaN, -0 != +0)."""
    grads = [t.grad for t in (case.q, case.k, case.v)]
    if any(g is None for g in grads):
        raise RuntimeError("backward left a gradient unset")
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return [g.detach().view(bits[g.element_size()]).clone() for g in grads]


def deterministic_backward(case: Case, fn: TensorFn) -> bool:
    """Whether two backward passes on the same inputs give bit-equal dq, dk and dv."""
    runs = []
    for _ in range(2):
        case.clear_grads()
        fn(case.q, case.k, case.v).backward(case.dout)
        sync(case.device)
        runs.append(_grads_bits(case))
    case.clear_grads()
    return all(torch.equal(a, b) for a, b in zip(*runs))


def setup_flex_flash(case: Case, timing: Timing) -> Impl:
    reason = flex_flash_unavailable(case.device)
    if reason is not None:
        raise Skip(reason)
    impl = _flex_impl(case, timing, compiled_flex_flash(), "flex FLASH (torch.compile, FlashAttention-4)",
                      index_dtype=torch.int32, block_size=FLASH_BLOCK)
    # The first call compiles forward and backward (dynamo, inductor, the CuTe-DSL kernels): it is timed whole. A
    # config the backend cannot lower fails here, and is skipped with the reason, not counted as a wrong result.
    case.clear_grads()
    sync(case.device)
    t0 = time.perf_counter()
    try:
        impl.fn(case.q, case.k, case.v).backward(case.dout)
        sync(case.device)
    except torch.cuda.OutOfMemoryError:  # not a lowering problem: a setup error, as for the other impls
        raise
    except Exception as e:
        if not device_alive(case.device):
            raise DeviceLost(f"first call: {short_error(e)}") from e
        if os.environ.get("BENCH_VERBOSE"):
            traceback.print_exception(type(e), e, e.__traceback__)
        raise Skip(f"FLASH first call (compile) failed: {_root_error(e)}") from e
    finally:
        case.clear_grads()
    impl.info["first_call_s"] = time.perf_counter() - t0
    impl.info["deterministic_bwd"] = deterministic_backward(case, impl.fn)
    return impl


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
    causal = case.cfg.dense_causal
    fn, label = _first_sdpa_that_runs(case, candidates, None, is_causal=causal, reference="dense")
    return Impl(fn, reference="dense", info={"backend": label + (" (is_causal)" if causal else "")})


def fa4_unavailable(device: torch.device) -> str | None:
    """Why FlashAttention-4's dense kernel cannot run here, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != FLASH_ARCH:
        return f"FlashAttention-4's kernels here are Hopper's (sm_90): not {device} ({FLASH_SETUP_HINT})"
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as e:
        return f"flash_attn.cute not importable ({short_error(e, 120)}; {FLASH_SETUP_HINT})"
    return None


def setup_fa4_dense(case: Case, timing: Timing) -> Impl:
    reason = fa4_unavailable(case.device)
    if reason is not None:
        raise Skip(reason)
    from flash_attn.cute import flash_attn_func

    causal = case.cfg.dense_causal

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # FlashAttention takes [B, S, H, D]: the transposed views, as a model holding that layout passes them
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return Impl(fn, reference="dense", info={"backend": "flash_attn.cute" + (" (causal)" if causal else "")})


SETUPS: dict[str, Callable[[Case, Timing], Impl]] = {
    "mmsparse": setup_mmsparse,
    "mmsparse_nondet": setup_mmsparse_nondet,
    "flex": setup_flex,
    "flex_flash": setup_flex_flash,
    "sdpa_mask": setup_sdpa_mask,
    "dense_flash": setup_dense_flash,
    "fa4_dense": setup_fa4_dense,
}
