"""The op boundary: one forward and one backward, and the torch custom ops over them.

``torch.ops.mmsparse.fwd_v3`` / ``.bwd_v3`` (registered here, with fake implementations) make the kernels opaque to
torch.compile, so ``fullgraph=True`` traces through mmsparse without graph breaks. Their names carry the version of
their signature (:data:`OP_VERSION`): Inductor's on-disk cache of compiled graphs does not key on a custom op's
schema, so a graph cached by an older mmsparse would call a changed op with its old arguments. Eager calls run the same
implementations directly: a call through the op dispatcher costs 25-35 us, which a small host-bound call feels.
:class:`mmsparse.attention.autograd.MBSAttentionFunction` is the one autograd definition over both.
"""

from __future__ import annotations

import torch

from ..mask.info import MaskInfo, mask_from_tuple
from .call import CallLaunch, call_launch
from .config import Settings, current_settings, intern_settings, kernel_config, settings_from_text
from .forward import kernel_layout


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float,
    seed: torch.Tensor | None, settings: Settings, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CallLaunch]:
    """(out, lse, the call's launches) of q, k, v in any layout (:func:`kernel_layout` copies only what the kernels
    cannot read). The config is read here, from ``settings``, once for the forward and its backward."""
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    launch = _launch_of(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, settings)
    out, lse = launch.forward(q, k, v, seed)
    return out, lse, launch


def _backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    info: MaskInfo, softmax_scale: float, dropout_p: float, seed: torch.Tensor | None, deterministic: bool,
    settings: Settings, launch: CallLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the forward's inputs, with the forward's launches (``launch``): nothing is planned again.
    Without them (the custom op, a backward called alone) the launches are found again from the arguments."""
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    if launch is None:
        launch = _launch_of(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, settings)
    return launch.backward(info, q, k)(kernel_layout(grad_out.contiguous()), q, k, v, out, lse, seed)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float, dropout_p: float,
    seed: torch.Tensor | None, settings: Settings | None = None, deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CallLaunch | None]:
    """The forward: ``(out [B, Hq, Sq, D], lse [B, Hq, Sq] float32, log2 units, launch)``: ``launch`` is the call's
    plan and launches, for :func:`attention_backward` (None when traced: the op plans inside).

    Args:
        q: ``[B, Hq, Sq, D]``; k, v: ``[B, Hkv, Sk, D]``.
        info: the mask; softmax_scale: multiplies q.k; dropout_p, seed: dropout and its int64 ``[3]`` seed
            (``new_dropout_seed``).
        settings: ``use_config``'s, as read when the call began (None: this thread's now); the backward must
            get the same.
        deterministic: the backward the call plans (False: the one-pass backward, dQ by atomic adds).
    """
    settings = current_settings() if settings is None else settings
    if torch.compiler.is_compiling():  # traced: the kernels must be an opaque op on tensors
        mask, mode, causal, num_segments, short, window = info.as_tuple(_short_samples(q, settings))
        out, lse = _fwd_op(q, k, v, mask, mode, causal, num_segments, short, seed, softmax_scale, dropout_p, window,
                           _text(settings))
        return out, lse, None
    return _forward(q, k, v, info, softmax_scale, dropout_p, seed, settings, deterministic)


def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    info: MaskInfo, softmax_scale: float, dropout_p: float, seed: torch.Tensor | None, deterministic: bool = True,
    settings: Settings | None = None, launch: CallLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`attention_forward`: ``(dq, dk, dv)``, dk and dv summed over each GQA group.
    ``deterministic`` False: the one-pass backward (dQ by atomic adds, not bitwise repeatable). ``settings``: the
    forward's (None: this thread's now). ``launch``: the forward's (None: found again from the arguments)."""
    settings = current_settings() if settings is None else settings
    if torch.compiler.is_compiling():  # traced: as in attention_forward
        mask, mode, causal, num_segments, short, window = info.as_tuple(_short_samples(q, settings))
        return _bwd_op(grad_out, q, k, v, out, lse, mask, mode, causal, num_segments, short, seed, softmax_scale,
                       dropout_p, window, deterministic, _text(settings))
    return _backward(grad_out, q, k, v, out, lse, info, softmax_scale, dropout_p, seed, deterministic, settings,
                     launch)


def _launch_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: MaskInfo, softmax_scale: float,
               dropout_p: float, seed: torch.Tensor | None, deterministic: bool, settings: Settings) -> CallLaunch:
    """The launches a forward with these arguments (q, k, v laid out by :func:`kernel_layout`) made, or makes
    now."""
    config = kernel_config(q.shape[-1], q.dtype, q.device, settings)
    return call_launch(q, k, v, info, softmax_scale, dropout_p, seed, deterministic, config)


OP_VERSION = 3  # bump with any change to the ops' signatures (tests/api/test_compile.py pins them)


def _text(settings: Settings) -> str:
    """The settings' value as the ops take it (a Settings made without ``use_config`` is interned first)."""
    return settings.text or intern_settings(settings).text


def _short_samples(q: torch.Tensor, settings: Settings) -> int:
    """The config's longest mean sample length that takes the short-samples tile."""
    return kernel_config(q.shape[-1], q.dtype, q.device, settings).short_samples


@torch.library.custom_op(f"mmsparse::fwd_v{OP_VERSION}", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: list[torch.Tensor], mode: int, causal: bool,
    num_segments: int, short_samples: bool, seed: torch.Tensor | None, softmax_scale: float, dropout_p: float,
    window: int, settings: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    values = settings_from_text(settings)
    info = mask_from_tuple(mask, mode, causal, num_segments, short_samples, window, _short_samples(q, values))
    out, lse, _ = _forward(q, k, v, info, softmax_scale, dropout_p, seed, values)
    return out, lse


@_fwd_op.register_fake
def _(q, k, v, mask, mode, causal, num_segments, short_samples, seed, softmax_scale, dropout_p, window, settings):
    batch, heads, seq_q, head_dim = q.shape
    return q.new_empty((batch, heads, seq_q, head_dim)), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


@torch.library.custom_op(f"mmsparse::bwd_v{OP_VERSION}", mutates_args=())
def _bwd_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    mask: list[torch.Tensor], mode: int, causal: bool, num_segments: int, short_samples: bool,
    seed: torch.Tensor | None, softmax_scale: float, dropout_p: float, window: int, deterministic: bool,
    settings: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = settings_from_text(settings)
    info = mask_from_tuple(mask, mode, causal, num_segments, short_samples, window, _short_samples(q, values))
    return _backward(grad_out, q, k, v, out, lse, info, softmax_scale, dropout_p, seed, deterministic, values)


@_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, mask, mode, causal, num_segments, short_samples, seed, softmax_scale, dropout_p,
      window, deterministic, settings):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
