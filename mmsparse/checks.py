"""The checks of a call's arguments: each turns a value the kernels cannot take into a ValueError or TypeError that
says what is wrong and how to fix it, and returns the value in the type the rest of the package reads."""

from __future__ import annotations

from typing import Any

import torch

from .runtime.launch import interpreter_active
from .runtime.limits import check_problem_size

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the innermost active torch.func transform, or None (looked up once: a call checks it on its host path)
_FUNCTION_TRANSFORM = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def check_no_function_transform() -> None:
    """A TypeError under a ``torch.func`` transform (grad, vmap, jacrev, ...): its tensors are wrappers that the
    kernels cannot read, and a mask or table built from them and kept by value would fail every later call of the
    process. Under torch.compile nothing is checked (Dynamo cannot trace the query, and traces the transforms
    itself)."""
    if not torch.compiler.is_compiling() and _FUNCTION_TRANSFORM() is not None:
        raise TypeError("mmsparse's attention does not run under torch.func transforms (grad, vmap, jacrev, jacfwd, "
                        "hessian, functionalize): its kernels take plain tensors. Differentiate it with torch.autograd "
                        "(loss.backward(), torch.autograd.grad) and give it batches along the batch dim")


def check_device(device: Any) -> torch.device:
    """``device`` (a torch.device, a name such as ``'cuda:1'``, or a CUDA index) as the torch.device of a CUDA GPU,
    its index filled in, or of the CPU; else a ValueError that says what it must be."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a name such as 'cuda', 'cuda:1' or 'cpu'; got "
                         f"{device!r}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {device}: the kernels run on CUDA tensors (or on the CPU through "
                         "Triton's interpreter)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device}: this machine has no CUDA device (pass device='cpu' for the "
                             "interpreter)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError/TypeError naming the problem when q, k, v cannot go to the kernels."""
    check_no_function_transform()
    if not (type(q) is type(k) is type(v) is torch.Tensor and q.dim() == k.dim() == v.dim() == 4
            and q.dtype == k.dtype == v.dtype and q.dtype in SUPPORTED_DTYPES):  # else: which argument is wrong
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim]; got shape {tuple(t.shape)}")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32"
                                + (FLOAT64_HINT if t.dtype == torch.float64 else ""))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype} (cast them first)")
    device = q.device
    if not (device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {device}, {k.device}, {v.device}")
    if device.type != "cuda":
        if device.type != "cpu":
            raise ValueError(f"unsupported device {device}: use CUDA tensors (or CPU with TRITON_INTERPRET=1)")
        if not interpreter_active():
            raise ValueError(
                "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton/mmsparse, "
                "or move q, k, v to a CUDA device"
            )
    k_shape = k.shape
    if k_shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k_shape)} and {tuple(v.shape)}")
    bq, hq, sq, d = q.shape
    bk, hk, sk, dk = k_shape
    if bq != bk:
        raise ValueError(f"batch sizes differ: q has {bq}, k/v have {bk}")
    if d != dk:
        raise ValueError(f"head dims differ: q has {d}, k/v have {dk}")
    if not head_dim_supported(d):
        raise ValueError(f"head dim {d} is not supported: use {SUPPORTED_HEAD_DIMS}")
    # k/v in [B, S, H, D] by mistake: more entries in dim 1 than in dim 2, rarely so in [B, H, S, D]
    hint = f" (if q/k/v are [B, S, H, D]: {_LAYOUT_HINT})" if hk > sk else ""
    if hq == 0 or hk == 0:
        raise ValueError(f"heads must be positive: q has {hq} query heads and k/v {hk} key/value heads (dim 1 of "
                         f"[B, H, S, D]){hint}")
    if hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA/MQA{hint}")
    if sq > sk:
        raise ValueError(
            f"q has {sq} positions but k/v only {sk}: queries are the last q_len of the kv positions{hint}"
        )
    check_problem_size(bq, hq, sq, sk)


SUPPORTED_HEAD_DIMS = "a multiple of 8 between 16 and 256"


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernels take this head dim (:data:`SUPPORTED_HEAD_DIMS`)."""
    return 16 <= head_dim <= 256 and head_dim % 8 == 0


def check_flag(name: str, value: Any) -> bool:
    """A yes/no argument as a bool: True/False (0/1 and numpy bools too). Anything else, such as the string "yes"
    (which Python would read as true), is a TypeError."""
    if value is True or value is False:
        return value
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if numpy_bool or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False; got {type(value).__name__} {value!r}")


def check_deterministic(value: Any) -> bool | None:
    """The ``deterministic`` argument: None (the process-wide default, :func:`mmsparse.use_config`) or a bool
    (:func:`check_flag`); anything else is a TypeError."""
    if value is None:
        return None
    try:
        return check_flag("deterministic", value)
    except TypeError:
        raise TypeError(f"deterministic must be True (bitwise repeatable backward), False (one-pass backward, "
                        f"dQ by atomic adds) or None (the default of use_config); got {type(value).__name__} "
                        f"{value!r}") from None


def check_window(window: Any, seq_k: int | None = None) -> int | None:
    """A sliding window as an int or None: a key is kept only when its position is past the query's minus
    ``window``, so ``window=1`` keeps each query's own position and the future, ``window=W`` the W positions up to
    the query. None, or (given the key count ``seq_k``) a window of at least seq_k, which keeps every key, is
    no window."""
    if window is None:
        return None
    numpy_int = type(window).__module__ == "numpy" and hasattr(window, "item") and "int" in type(window).__name__
    if isinstance(window, bool) or not (isinstance(window, int) or numpy_int):
        raise TypeError(f"window must be a positive int (keys within that many positions up to the query) or None; "
                        f"got {type(window).__name__} {window!r}")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be a positive int: a key is kept when its position is past the query's minus "
                         f"the window, so window=1 keeps only the query's own position; got {window}")
    return None if seq_k is not None and window >= seq_k else window


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 sample"``, ``"2 samples"``: a number and its noun, in the plural (default: noun + "s") unless 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def check_dropout(value: Any, name: str = "dropout") -> float:
    """A dropout probability as a float in [0, 1): a TypeError for anything but a real number (a bool or a string
    included), a ValueError outside the range."""
    if type(value) is float and 0.0 <= value < 1.0:  # the common case
        return value
    numpy_float = type(value).__module__ == "numpy" and "float" in type(value).__name__
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or numpy_float):
        raise TypeError(f"{name} must be a float in [0, 1); got {type(value).__name__} {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1); got {value!r}")
    return float(value)


# The smallest softmax scale taken. The Hopper backward kernels add -lse / scale to the scores, which overflows
# float32 for scales below ~1e-37; every score is already ~0 at 1e-30, so nothing smaller is needed.
MIN_SOFTMAX_SCALE = 1e-30


def check_softmax_scale(value: Any) -> float | None:
    """A softmax scale as a float: None (meaning 1/sqrt(head dim)) or a finite number of at least
    :data:`MIN_SOFTMAX_SCALE`."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"softmax_scale must be a positive float or None (for 1/sqrt(head_dim)); got "
                        f"{type(value).__name__} {value!r}")
    try:
        scale = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"softmax_scale must be a positive float or None (for 1/sqrt(head_dim)); got "
                        f"{type(value).__name__} {value!r}") from e
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"softmax_scale must be a finite positive number; got {value!r}")
    if scale < MIN_SOFTMAX_SCALE:
        raise ValueError(f"softmax_scale must be at least {MIN_SOFTMAX_SCALE:g}; got {value!r}. Every score times "
                         f"a scale that small is ~0 (uniform attention, as {MIN_SOFTMAX_SCALE:g} gives), and the "
                         "kernels' exponent arithmetic would overflow")
    return scale


FLOAT64_HINT = (
    ". For float64 checks (gradcheck and the like) use the dense float64 reference instead: "
    "mmsparse.reference_attention(q, k, v, mmsparse.reference_mask(topology, seg_lens, S)); the kernels run in "
    "float32 or below"
)

_LAYOUT_HINT = (
    "mmsparse takes q/k/v as [B, H, S, D], as F.scaled_dot_product_attention does; for [B, S, H, D] tensors pass "
    "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (views, no copy) and transpose the output back"
)


def layout_hint(k: torch.Tensor, seg_lens: Any) -> str | None:
    """The layout hint when k's dim 1 holds the positions the lengths ask for but dim 2 does not: a [B, S, H, D]
    tensor passed by mistake. None otherwise (or when the lengths cannot be read)."""
    try:
        lens = seg_lens.tolist() if isinstance(seg_lens, torch.Tensor) else seg_lens
        rows = lens if len(lens) and isinstance(lens[0], (list, tuple)) else [lens]
        needed = max(sum(int(n) for n in row) for row in rows)
    except (TypeError, ValueError, NotImplementedError, RuntimeError):  # e.g. strings, or a tensor without values
        return None
    if needed > k.shape[2] and needed <= k.shape[1]:
        return f"k/v have {k.shape[1]} in dim 1 and {k.shape[2]} in dim 2: {_LAYOUT_HINT}"
    return None
