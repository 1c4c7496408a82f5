"""Activation checkpointing that recomputes under the forward's settings.

A checkpointed region runs its forward twice: once in the forward pass and again, to recompute the activations,
during the backward, which often runs outside the ``use_config`` / ``use_tuning`` block the forward ran in, or on
autograd's thread. A recompute that read the thread's settings then would plan other tiles (other block lists, and
saved outputs that are not bit-identical to the forward's) or, with ``use_reentrant=True``, record another
backward (the two passes where the forward asked for one). Both helpers here take the settings in force when the
forward runs and apply them to the recompute.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch.utils.checkpoint

from .attention.config import applied_settings, current_settings


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)`` whose recompute runs
    with this thread's mmsparse settings as they are now (``mmsparse.use_config``, ``mmsparse.tuning.use_tuning``),
    with either kind of checkpoint.

    Args:
        function: the region to checkpoint; args, kwargs: as ``torch.utils.checkpoint.checkpoint`` takes them.
        use_reentrant: torch's; False (the default here) is the kind torch recommends.
    Returns:
        ``function(*args)``.
    """
    settings = current_settings()

    def under_forward_settings(*inner: Any, **inner_kwargs: Any) -> Any:
        with applied_settings(settings):
            return function(*inner, **inner_kwargs)

    return torch.utils.checkpoint.checkpoint(under_forward_settings, *args, use_reentrant=use_reentrant, **kwargs)


def settings_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A ``context_fn`` for a non-reentrant ``torch.utils.checkpoint.checkpoint`` (also through Hugging Face's
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn":
    mmsparse.settings_context_fn})``): torch calls it when the forward runs, and the recompute runs under the
    settings in force then.

    Returns:
        (the forward's context, which changes nothing; the recompute's, which applies the forward's settings).
    """
    return contextlib.nullcontext(), applied_settings(current_settings())
