"""One side of an A/B run (``tools.ab``): mmsparse from one source tree, timed on request.

Started by the A/B parent as ``python <this file> --tree DIR``, never imported. Both sides register the same torch
custom ops, so each has a process of its own. It imports mmsparse from ``--tree`` first and only then this
checkout's ``benchmarks`` package, so that the two sides differ in mmsparse alone and share the harness.

Protocol: one JSON object per line. Requests on stdin: ``{"op": "prepare" | "time", "config": NAME}``. Replies
on the original stdout: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``; a first line ``{"ok": true,
"ready": ...}`` says where mmsparse came from. Everything else printed (by Triton, torch, mmsparse) goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

BENCH_ROOT = Path(__file__).resolve().parent.parent  # the checkout whose harness both sides run


def _protocol_stream() -> TextIO:
    """The original stdout for replies; file descriptor 1 then points at stderr, so that nothing else can write
    into the protocol (C-level prints included)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return proto


def _import_mmsparse(tree: Path) -> Any:
    sys.path.insert(0, str(tree))
    import mmsparse  # before triton: on a machine without CUDA it turns on Triton's interpreter

    where = Path(mmsparse.__file__).resolve()
    if tree.resolve() not in where.parents:
        raise RuntimeError(f"mmsparse came from {where}, not from {tree}")
    sys.path.insert(0, str(BENCH_ROOT))  # after mmsparse is cached: only the harness comes from here
    return mmsparse


def digest(t: Any) -> str:
    """sha256 of a tensor's bytes (bit-for-bit identity, whatever its dtype)."""
    import torch

    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


class Side:
    """The inputs of every prepared config and the call that times them."""

    def __init__(self, mmsparse: Any, device: str, warmup: int, rep: int, cpu_reps: int,
                 deterministic: bool = True, head_dim: int | None = None) -> None:
        from dataclasses import replace

        import torch

        from benchmarks.configs import ALL_CONFIGS
        from benchmarks.timing import Timing

        self.torch, self.mmsparse = torch, mmsparse
        self.configs = {name: replace(cfg, head_dim=head_dim) if head_dim else cfg for name, cfg in ALL_CONFIGS.items()}
        self.device = torch.device(device)
        self.timing = Timing(self.device, warmup, rep, cpu_warmup=1, cpu_reps=cpu_reps)
        self.cases: dict[str, tuple[Any, ...]] = {}
        self.deterministic = deterministic
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # tiny ops: OpenMP threads mostly spin against each other

    def call(self, name: str) -> Any:
        from benchmarks.baselines import mmsparse_fn  # mbs_attention, or mbs_attention_varlen for a pack

        return mmsparse_fn(self.configs[name], self.device, self.deterministic)

    def prepare(self, name: str) -> dict[str, Any]:
        """Make the config's seeded inputs, run forward + backward once (compiles), and digest the results."""
        from benchmarks.inputs import make_inputs

        q, k, v, dout = make_inputs(self.configs[name], self.device)
        out = self.call(name)(q, k, v)
        out.backward(dout)
        digests = {"out": digest(out), "dq": digest(q.grad), "dk": digest(k.grad), "dv": digest(v.grad)}
        if not self.deterministic:
            del digests["dq"]  # the one pass adds dQ in any order: its bits differ from run to run
        q.grad = k.grad = v.grad = None
        self.cases[name] = (q, k, v, dout)
        return {"digests": digests}

    def time(self, name: str) -> dict[str, Any]:
        from benchmarks.timing import time_passes

        if name not in self.cases:
            self.prepare(name)
        return time_passes(self.call(name), *self.cases[name], self.timing)


def serve(side: Side, requests: TextIO, replies: TextIO) -> None:
    for line in requests:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            handler = {"prepare": side.prepare, "time": side.time}[req["op"]]
            reply = {"ok": True, **handler(req["config"])}
        except Exception as e:  # a failing config is reported, and the worker stays up for the next request
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"}
            if side.device.type == "cuda":
                side.torch.cuda.empty_cache()
        replies.write(json.dumps(reply) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tree", type=Path, required=True, help="source tree whose mmsparse this side runs")
    ap.add_argument("--device", required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--rep", type=int, required=True)
    ap.add_argument("--cpu-reps", type=int, default=3)
    ap.add_argument("--nondet", action="store_true", help="call with deterministic=False")
    ap.add_argument("--head-dim", type=int, default=None, help="every config at this head dim")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent  # run as a script, its folder leads sys.path: its modules must not
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # shadow anything by bare name
    replies = _protocol_stream()
    try:
        mmsparse = _import_mmsparse(args.tree)
        side = Side(mmsparse, args.device, args.warmup, args.rep, args.cpu_reps, not args.nondet, args.head_dim)
        from benchmarks.env import versions

        ready = {"mmsparse": str(Path(mmsparse.__file__).resolve().parent), **versions(side.device)}
    except Exception as e:
        traceback.print_exc()
        replies.write(json.dumps({"ok": False, "error": f"start-up: {type(e).__name__}: {e}"}) + "\n")
        return 1
    replies.write(json.dumps({"ok": True, "ready": ready}) + "\n")
    serve(side, sys.stdin, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
