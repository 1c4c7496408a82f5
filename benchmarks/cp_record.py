"""The ``cp_nccl`` record: ``cp_nccl.json`` (rows, links, dropout checks) merged over runs of one commit, its
tables (``cp_nccl.md``) and console lines.

Runs on different numbers of GPUs fill one record: a run replaces the rows of the (config, GPUs) it measured,
the links and dropout check of its GPU count, and keeps the others of the same commit; entries of another commit
are dropped. Records made on different machines merge the same way afterwards, later files winning:

    python -m benchmarks.cp_record two_gpus/cp_nccl.json four_gpus/cp_nccl.json --out benchmarks/results/h100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .cp_cases import ALL_CASES
from .report import fmt, write_record

TOPIC = "cp_nccl"
SECTIONS = {"rows": ("config", "gpus"), "links": ("gpus",), "dropout": ("config", "gpus")}  # merge keys
IMPLS = ("mmsparse_cp", "mmsparse_cp_keep", "mmsparse_cp_refetch", "mmsparse_cp_p2p", "all_gather")


def merge(folder: Path, new: dict[str, list[dict]], commit: str) -> dict[str, list[dict]]:
    """``new`` over the record in ``folder``, if there is one (:func:`merge_records`)."""
    path = folder / f"{TOPIC}.json"
    return merge_records(json.loads(path.read_text()) if path.exists() else {}, new, commit)


def merge_records(old: dict[str, list[dict]], new: dict[str, list[dict]], commit: str) -> dict[str, list[dict]]:
    """Per section, the entries of ``old`` from ``commit`` whose key ``new`` does not have, then ``new``'s, sorted
    by config order and GPU count."""
    order = {name: i for i, name in enumerate(ALL_CASES)}
    merged = {}
    for section, key in SECTIONS.items():
        fresh = new.get(section, [])
        taken = {tuple(r[k] for k in key) for r in fresh}
        kept = [r for r in old.get(section, []) if r.get("commit") == commit and tuple(r[k] for k in key) not in taken]
        merged[section] = sorted(kept + fresh, key=lambda r: (order.get(r.get("config"), len(order)),
                                                              str(r.get("config")), r["gpus"],
                                                              IMPLS.index(r["impl"]) if "impl" in r else 0))
    return merged


def write(folder: Path, record: dict[str, list[dict]]) -> str:
    """``folder/cp_nccl.{json,md}``; returns the markdown."""
    table = markdown(record)
    folder.mkdir(parents=True, exist_ok=True)
    write_record(folder, TOPIC, record, table)
    return table


def _mib(values: list[int] | None) -> str:
    return "-" if not values else " / ".join(f"{v / 2**20:.4g}" for v in values)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _yes(value: bool | None) -> str:
    return {True: "yes", False: "**no**"}.get(value, "-")


def console_line(row: dict) -> str:
    head = f"   {row['impl']:<12} {row['gpus']} GPUs"
    if row.get("skipped"):
        return f"{head}: skipped: {row['skipped']}"
    errors = ", ".join(f"{n} {row[f'{n}_rel_l2']:.1e}" for n in ("out", "dq", "dk", "dv"))
    parts = [f"step {row['step_ms']:.2f} ms, one GPU {row['one_gpu_step_ms']:.2f} ms: {row['speedup']:.2f}x"]
    if row.get("step_b2b_ms") is not None:
        parts.append(f"back to back {row['step_b2b_ms']:.2f} ms, one GPU {row['one_gpu_step_b2b_ms']:.2f} ms: "
                     f"{row['speedup_b2b']:.2f}x")
    if row.get("model_speedup") is not None:
        parts.append(f"model {row['model_speedup']:.2f}x / {row['model_speedup_overlap']:.2f}x")
        parts.append(f"compute {row['compute_ms']:.2f} ms, exchange {row['exchange_ms']:.2f} ms, hidden "
                     f"{row['hidden_ms']:.2f} ms")
        parts.append(f"bytes as planned: {row['bytes_match']}")
    parts.append(f"rel L2 {errors}; repeatable {row['repeatable']}; {'ok' if row['correct'] else 'FAIL'}")
    return f"{head}: " + " | ".join(parts)


def dropout_line(row: dict) -> str:
    errors = ", ".join(f"{n} {row[f'{n}_rel_l2']:.1e}" for n in ("out", "dq", "dk", "dv"))
    return (f"dropout {row['dropout_p']} with pair types ({row['config']}): mask mismatches {row['mask_mismatches']} "
            f"over {row['probes']} probes ({row['other_seed_mismatches']} against another seed's mask), kept "
            f"{row['kept_fraction']:.4f} of the visible pairs; rel L2 {errors}; {'ok' if row['ok'] else 'FAIL'}")


def markdown(record: dict[str, list[dict]]) -> str:
    rows, links, dropout = record["rows"], record["links"], record["dropout"]
    first = (rows or links or dropout or [{}])[0]
    commits = sorted({r.get("commit") for r in rows + links + dropout})
    lines = [f"Run: {first.get('gpu')}, torch {first.get('torch')}, triton {first.get('triton')}, NCCL "
             f"{first.get('nccl_version')}, commit {', '.join(map(str, commits))}; {first.get('dtype')}; NCCL "
             f"environment {first.get('nccl')}. torchrun, one process a GPU.", "",
             "Links: all-gather bus bandwidth ((P - 1) / P x gathered bytes / time) and send/recv from rank 0 to "
             "rank 1, one direction.", "",
             "| GPUs | message MiB a rank | all-gather bus GB/s | send/recv GB/s |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['gpus']} | {r['message_mib']} | {r['all_gather_busbw_gbs']:.1f} | {r['send_recv_gbs']:.1f} |"
              for r in links]
    lines += ["", "Forward + backward step. `one-GPU ms`: the whole problem on one GPU in the same run; speedup = "
              "one-GPU / step; model: `cp_model` from this run's one-GPU step and send/recv bandwidth (exchange not "
              "overlapped / fully hidden). compute: the rank's pieces alone, the gathered K/V already there; "
              "exchange: K/V fetched as the step fetches it (twice, once where it keeps the fetched K/V) and dK/dV "
              "returned, no compute; hidden = compute + exchange - step "
              "(slowest rank each). Each step starts at a barrier and ends with a sync, so the host's time counts; "
              "`back to back`: the same steps with no sync between them (the GPU's own time), and its speedup.", "",
              "| config | GPUs | impl | step ms | one-GPU ms | speedup | back to back ms / one-GPU ms | speedup | "
              "model | compute ms | exchange ms | hidden ms | peak GiB |",
              "|---|---:|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    done = [r for r in rows if not r.get("skipped")]
    for r in done:
        model = (f"{_x(r.get('model_speedup'))} / {_x(r.get('model_speedup_overlap'))}"
                 if r.get("model_speedup") is not None else "-")
        lines.append(f"| {r['config']} | {r['gpus']} | {r['impl']} | {fmt(r['step_ms'])} | "
                     f"{fmt(r['one_gpu_step_ms'])} | {_x(r['speedup'])} | {fmt(r.get('step_b2b_ms'))} / "
                     f"{fmt(r.get('one_gpu_step_b2b_ms'))} | {_x(r.get('speedup_b2b'))} | {model} | "
                     f"{fmt(r.get('compute_ms'))} | "
                     f"{fmt(r.get('exchange_ms'))} | {fmt(r.get('hidden_ms'))} | {fmt(r.get('peak_gib'), 1)} |")
    lines += ["", "Correctness: out, dq, dk, dv put together from the ranks' shards against `mbs_attention` on the "
              "whole sequence (same inputs, one GPU): relative L2 and max abs; repeatable: a second run bitwise "
              "equal on every rank.", "",
              "| config | GPUs | impl | rel L2 out / dq / dk / dv | max abs out / dq / dk / dv | repeatable | "
              "correct |", "|---|---:|---|---|---|---|---|"]
    for r in done:
        rel = " / ".join(f"{r[f'{n}_rel_l2']:.1e}" for n in ("out", "dq", "dk", "dv"))
        mx = " / ".join(f"{r[f'{n}_max_abs']:.1e}" for n in ("out", "dq", "dk", "dv"))
        lines.append(f"| {r['config']} | {r['gpus']} | {r['impl']} | {rel} | {mx} | {_yes(r['repeatable'])} | "
                     f"{_yes(r['correct'])} |")
    lines += ["", "Bytes a rank sent and received in one step, per rank (MiB): measured (`ContextParallel.bytes_sent` "
              "/ `bytes_received`) and the plan's prediction; the all-gather baseline's are computed (ring "
              "all-gather of K/V, ring reduce-scatter of float32 dK/dV).", "",
              "| config | GPUs | impl | sent | planned sent | received | planned received | as planned |",
              "|---|---:|---|---|---|---|---|---|"]
    for r in done:
        lines.append(f"| {r['config']} | {r['gpus']} | {r['impl']} | {_mib(r.get('bytes_sent'))} | "
                     f"{_mib(r.get('plan_bytes_sent'))} | {_mib(r.get('bytes_received'))} | "
                     f"{_mib(r.get('plan_bytes_received'))} | {_yes(r.get('bytes_match'))} |")
    if dropout:
        lines += ["", "Dropout with pair types: the keep mask of the ranks against the single-GPU call with the same "
                  "seed, compared on every (head, query, key) by one-hot probes; out / dq / dk / dv relative L2.", "",
                  "| config | GPUs | dropout | mask mismatches | another seed's mismatches (block 0) | kept / visible "
                  "| rel L2 out / dq / dk / dv | ok |", "|---|---:|---:|---:|---:|---:|---|---|"]
        for d in dropout:
            rel = " / ".join(f"{d[f'{n}_rel_l2']:.1e}" for n in ("out", "dq", "dk", "dv"))
            lines.append(f"| {d['config']} | {d['gpus']} | {d['dropout_p']} | {d['mask_mismatches']} | "
                         f"{d['other_seed_mismatches']} | {d['kept_fraction']:.4f} | {rel} | {_yes(d['ok'])} |")
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {r['config']} on {r['gpus']} GPUs: {r['skipped']}" for r in skipped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cp_record", description=__doc__.split("\n\n")[0])
    parser.add_argument("records", type=Path, nargs="+", help="cp_nccl.json files of one commit, later ones win")
    parser.add_argument("--out", type=Path, required=True, help="folder of the merged cp_nccl.{json,md}")
    args = parser.parse_args(argv)
    records = [json.loads(path.read_text()) for path in args.records]
    commits = {r.get("commit") for record in records for section in SECTIONS for r in record.get(section, [])}
    if len(commits) != 1:
        raise SystemExit(f"the records come from several commits ({sorted(map(str, commits))}): rerun on one")
    (commit,) = commits
    merged: dict[str, list[dict]] = {}
    for record in records:
        merged = merge_records(merged, record, commit)
    print(write(args.out, merged), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
