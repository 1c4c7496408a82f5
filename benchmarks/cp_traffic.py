"""What the context-parallel plan predicts for one forward and backward step: the bytes each rank moves and the
speedup over one GPU at a link bandwidth. ``cp_nccl`` holds its measurements against them; ``tools.cp_model``
tabulates them for the long-sequence layouts."""

from __future__ import annotations


def exchange_bytes(summary: dict, dkv_ratio: float = 2.0, fetches: int = 2) -> float:
    """Bytes over one direction of the busiest rank's link in a forward and backward step. Inbound: the K/V it
    fetches, ``fetches`` times (1 where the call keeps the fetched K/V for the backward), and the dK/dV of its own
    chunks coming back at ``dkv_ratio`` times the bytes of what it serves (2: float32 for half-precision inputs; 1
    where every rank's attention is one piece and the return travels in the inputs' dtype,
    ``ContextParallel.kv_grad_dtype``); outbound mirrors it."""
    return max(max(fetches * recv + dkv_ratio * sent, fetches * sent + dkv_ratio * recv)
               for recv, sent in zip(summary["recv_bytes"], summary["sent_bytes"]))


def predicted_speedup(summary: dict, one_gpu_s: float, bandwidth: float,
                      dkv_ratio: float = 2.0, fetches: int = 2) -> tuple[float, float]:
    """(exchange not overlapped, fully overlapped) speedup over one GPU that runs every live pair in
    ``one_gpu_s``: the busiest rank's share of that time, and the exchange (:func:`exchange_bytes`) at
    ``bandwidth`` bytes/s per direction."""
    compute = one_gpu_s * max(summary["live_pairs"]) / sum(summary["live_pairs"])
    moved = exchange_bytes(summary, dkv_ratio, fetches) / bandwidth
    return one_gpu_s / (compute + moved), one_gpu_s / max(compute, moved)


def rank_bytes(summary: dict, rank: int, kv_bytes_per_token: int, dkv_bytes_per_token: int,
               fetches: int = 2) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` in one forward and backward step under the plan (``summary`` with
    ``kv_bytes_per_token=1``: tokens). Received: the K/V it fetches, ``fetches`` times (2: the backward fetches
    again; 1 with ``keep_fetched_kv``), and the dK/dV of the tokens it serves; sent: the K/V it serves as often,
    and the dK/dV of the tokens it fetched."""
    fetched, served = summary["recv_bytes"][rank], summary["sent_bytes"][rank]
    return (fetches * served * kv_bytes_per_token + fetched * dkv_bytes_per_token,
            fetches * fetched * kv_bytes_per_token + served * dkv_bytes_per_token)
