"""Threads: N Python threads call mmsparse at once, each forward + backward with new lengths every call, checked
against the float64 reference.

Every call of a thread draws a topology (bits, pair types, causal), new segment lengths, a sequence length (on a GPU
from below to past SHORT_KEYS, where the backward forks its side stream, and past the one-pass threshold), heads
(GQA), a dtype, an entry point (the functional API, the thread's own ``TritonMBSAttnKernel``, or a module all threads
share) and its own ``use_config``/``use_tuning`` settings (the defaults, the one-pass backward, the two passes
forced, no short tiles). The forward runs inside the settings' blocks and the backward after them, as a training
loop with a scoped setting does. On a GPU every thread runs on its own CUDA stream. A call is *wrong* when its
output or a gradient fails the calibrated float64 check, an *error* when it raises.

    python -m tests.stress.threads --threads 8 --seconds 300      # GPU: writes benchmarks/results/<gpu>/threads.*
    python -m tests.stress.threads --threads 2 --calls 2 --device cpu --out DIR   # CPU: the interpreter, tiny sizes

The record holds one entry per setting (threads, seconds or calls, device): threads, seconds, calls, wrong, errors,
GPU, versions and commit. Exit status 1 when any call was wrong or raised.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import mmsparse  # noqa: F401  (turns on Triton's interpreter without CUDA, before triton is imported)
from benchmarks.env import environment, results_dir
from mmsparse import TritonMBSAttnKernel, mbs_attention, reference_mask, use_config
from mmsparse.tuning import use_tuning
from tests.helpers import check_outputs, make_qkv

TOPIC = "threads"
TOPOLOGIES = {
    "hub": [[1, 1, 1], [1, 1, 0], [1, 0, 1]],
    "cyclic": [[0, 1, 0], [0, 0, 1], [1, 0, 0]],
    "pair_types": [[2, 0, 0], [2, 1, 0], [2, 1, 2]],  # text causal, images full within and causal over the past
    "four": [[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0], [0, 1, 0, 1]],
}
SETTINGS: list[dict[str, Any]] = [
    {},
    {"deterministic": False},
    {"deterministic": False, "one_pass_max_keys": 0, "dq_writer_max_keys": 0},  # the two passes at every length
    {"short_keys": 0},  # no short tiles: the long-list tiles and the side stream at every length
]


@dataclass(frozen=True)
class Sizes:
    seq: tuple[int, int]  # the range of sequence lengths
    head_dim: int
    dtypes: tuple[torch.dtype, ...]


GPU_SIZES = Sizes((256, 3000), 64, (torch.bfloat16, torch.float16))
CPU_SIZES = Sizes((20, 48), 16, (torch.float32,))


def _lengths(total: int, segments: int, rng: random.Random) -> tuple[int, ...]:
    cuts = sorted(rng.randint(0, total) for _ in range(segments - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


class Worker:
    """One thread's loop: calls until the deadline (or ``calls``), counting what was right, wrong and raised."""

    def __init__(self, index: int, device: torch.device, sizes: Sizes, shared: TritonMBSAttnKernel, seed: int) -> None:
        self.index, self.device, self.sizes, self.shared = index, device, sizes, shared
        self.rng = random.Random(seed * 1000 + index)
        self.generator = torch.Generator().manual_seed(seed * 1000 + index)
        self.calls = self.wrong = self.errors = 0
        self.messages: list[str] = []

    def run(self, deadline: float, max_calls: int | None, start: threading.Barrier) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        start.wait()
        while time.monotonic() < deadline and (max_calls is None or self.calls < max_calls):
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self.call()
                    stream.synchronize()
                else:
                    self.call()
            except AssertionError as e:
                self.wrong += 1
                self._note("wrong", e)
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                self.errors += 1
                self._note("error", e)
            self.calls += 1

    def _note(self, kind: str, e: BaseException) -> None:
        if len(self.messages) < 5:
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            self.messages.append(f"thread {self.index} call {self.calls} {kind}: {detail[:2000]}")

    def call(self) -> None:
        rng, sizes = self.rng, self.sizes
        entry = rng.choice(("function", "module", "shared"))
        settings = rng.choice(SETTINGS)
        dtype = rng.choice(sizes.dtypes)
        if entry == "shared":
            topology, lens, causal, window = self.shared.topology.types.tolist(), self.shared.seg_lens, False, None
            heads, kv_heads = 2, 2
        else:
            name = rng.choice(sorted(TOPOLOGIES))
            topology = TOPOLOGIES[name]
            lens = _lengths(rng.randint(*sizes.seq), len(topology), rng)
            causal = rng.random() < 0.3
            window = rng.choice((None, None, max(1, sum(lens) // 3)))
            kv_heads = rng.choice((1, 2))
            heads = kv_heads * rng.choice((1, 2))
        seq = sum(lens)
        q, k, v = make_qkv(1, heads, kv_heads, seq, seq, sizes.head_dim, dtype, self.device, self.generator)
        tuning = {name: value for name, value in settings.items() if name != "deterministic"}
        # the forward inside the blocks, the backward after them
        with use_config(deterministic=settings.get("deterministic")), use_tuning(**tuning):
            if entry == "function":
                out = mbs_attention(q, k, v, topology, lens, causal=causal, window=window)
            elif entry == "module":
                out = TritonMBSAttnKernel(topology, lens, causal_mask=causal, window=window)(q, k, v)
            else:
                out = self.shared(q, k, v)
        grad_out = torch.randn(out.shape, generator=self.generator).to(out)
        out.backward(grad_out)
        mask = reference_mask(topology, lens, seq, seq, causal=causal, window=window)
        check_outputs(q, k, v, out, grad_out, mask.to(self.device))


def run(threads: int, seconds: float, calls: int | None, device: torch.device, seed: int) -> dict[str, Any]:
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    shared = TritonMBSAttnKernel(TOPOLOGIES["hub"], _lengths(sizes.seq[1] // 2, 3, random.Random(seed)))
    workers = [Worker(i, device, sizes, shared, seed) for i in range(threads)]
    start = threading.Barrier(threads)
    began = time.monotonic()
    deadline = began + seconds
    pool = [threading.Thread(target=w.run, args=(deadline, calls, start), name=f"mmsparse-stress-{w.index}")
            for w in workers]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - began
    return {
        "key": f"{device.type}-{threads}x{f'{calls}calls' if calls is not None else f'{seconds:g}s'}",
        "threads": threads, "seconds": round(elapsed, 1), "calls": sum(w.calls for w in workers),
        "calls_per_thread": [w.calls for w in workers], "wrong": sum(w.wrong for w in workers),
        "errors": sum(w.errors for w in workers), "messages": [m for w in workers for m in w.messages][:10],
        **environment(device), "date": datetime.date.today().isoformat(),
    }


def merge_record(old: dict[str, Any] | None, entry: dict[str, Any]) -> dict[str, Any]:
    """The record with ``entry`` in place of the one of the same key (or added after the others)."""
    entries = list((old or {}).get("entries", []))
    keys = [e.get("key") for e in entries]
    if entry["key"] in keys:
        entries[keys.index(entry["key"])] = entry
    else:
        entries.append(entry)
    return {"topic": TOPIC, "entries": entries}


def markdown(record: dict[str, Any]) -> str:
    lines = [
        "Threads calling mmsparse at once (`python -m tests.stress.threads`): forward + backward with new lengths, "
        "topologies, entry points and `use_config`/`use_tuning` settings every call, each thread on its own CUDA "
        "stream, every call checked against the float64 reference.",
        "",
        "| setting | threads | s | calls | wrong | errors | GPU | torch | triton | commit | date |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    notes = []
    for e in record["entries"]:
        lines.append(f"| {e['key']} | {e['threads']} | {e['seconds']:g} | {e['calls']} | {e['wrong']} | "
                     f"{e['errors']} | {e['gpu']} | {e['torch']} | {e['triton']} | {e['commit']} | {e['date']} |")
        notes += [f"- {e['key']}: {m}" for m in e["messages"]]
    if notes:
        lines += ["", "Failures:", "", *notes]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.stress.threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=8, help="threads at once (default 8)")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the threads call (default 60)")
    p.add_argument("--calls", type=int, default=None, help="stop each thread after this many calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder of threads.json and threads.md (default benchmarks/results/<gpu>/; a new temporary "
                        "folder on the CPU)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1; got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import write_record

    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    entry = run(args.threads, args.seconds, args.calls, device, args.seed)
    out = args.out or (results_dir(entry["gpu"]) if device.type == "cuda"
                       else Path(tempfile.mkdtemp(prefix="mmsparse-threads-")))
    path = out / f"{TOPIC}.json"
    record = merge_record(json.loads(path.read_text()) if path.exists() else None, entry)
    write_record(out, TOPIC, record, markdown(record))
    print(f"{entry['key']}: {entry['calls']} calls in {entry['seconds']} s, {entry['wrong']} wrong, "
          f"{entry['errors']} errors -> {path}")
    for message in entry["messages"]:
        print(message)
    return 0 if entry["wrong"] == 0 and entry["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
