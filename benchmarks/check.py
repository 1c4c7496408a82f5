"""Correctness before speed: an implementation's output and dq/dk/dv against the float32 dense reference."""

from __future__ import annotations

import math
from typing import Any

import torch

from .cases import Case
from .devices import device_alive
from .errors import DeviceLost, short_error
from .impl import Impl

RTOL_OUT = 2e-2  # max |out - ref| / max |ref|: outputs here are ~1e-2 in size, so an absolute 2e-2 would pass zeros
RTOL_GRAD = 5e-2  # the same for dq, dk, dv (bf16 backward: dS from bf16 P and dP)


def compare(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> tuple[float, float, bool]:
    """(max abs error, that over max |ref|, pass). NaN anywhere fails."""
    got = got.float()
    if bool(torch.isnan(got).any()):
        return math.inf, math.inf, False
    err = float((got - ref).abs().max())
    rel = err / max(float(ref.abs().max()), 1e-6)
    return err, rel, rel <= rtol


def check(case: Case, impl: Impl, grads: bool) -> dict[str, Any]:
    """Compare one (batch, kv-head group) of out and dq/dk/dv with the float32 reference.

    Returns:
        Row keys: ``max_err``, ``rel_err``, ``grad_max_err``, ``grad_rel_err``, ``grads_checked``, ``correct``,
        ``check`` ("ok", "ok (fwd only)" or "FAIL"), and ``grad_fail`` / ``grad_error`` when they apply.
    """
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
