"""Where one kernel's warps stall, instruction by instruction: Nsight Compute's source view of one call.

``tools.profile_ncu`` says how much a kernel stalls and for which reasons; this says at which SASS instructions.
A child process warms the call up and runs one forward (no grad) of a config, or with ``--backward`` one forward +
backward, between ``cudaProfilerStart`` and ``Stop``; ``ncu`` samples the first launch of the kernel named by
``--kernel`` with its SourceCounters section, then exports the SASS source page, and the table lists the
instructions with the most warp stall samples, each with its share of all samples, how many times a warp executed
it and its two largest stall reasons.

    python -m tools.ncu_source --config vlm32k_d256 --kernel attention_fwd_gluon --out DIR
    python -m tools.ncu_source --config mm13k_hub --impl mmsparse_nondet --backward \
        --kernel attention_bwd_dq_writer_gluon --out DIR

Writes ``DIR/ncu_source.{json,md}`` and the ``.ncu-rep`` report. Warps that only wait for the kernel's end (the
idle warps a warp-specialised kernel pads its one-warp partition to a warpgroup with) stall at a barrier for the
whole kernel: their samples are counted like any other's, so read a barrier's row with its execution count.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

from tools.profile_ncu import ncu_binary

TOP = 30


def child(config: str, impl: str, backward: bool) -> None:
    """Warm up, then one profiled forward without grad, or forward + backward (``backward``), of ``impl``."""
    import torch

    from benchmarks.baselines import SETUPS
    from benchmarks.cases import Case
    from benchmarks.configs import ALL_CONFIGS
    from benchmarks.timing import Timing

    dev = torch.device("cuda")
    case = Case.make(ALL_CONFIGS[config], dev, torch.bfloat16)
    fn = SETUPS[impl](case, Timing(dev, 1, 1)).fn

    def call() -> None:
        if backward:
            case.clear_grads()
            fn(case.q, case.k, case.v).backward(case.dout)
        else:
            with torch.no_grad():
                fn(case.q, case.k, case.v)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def stall_rows(source_csv: str, top: int = TOP) -> tuple[float, list[dict]]:
    """(all samples, the ``top`` instructions by samples) from ``ncu --page source --csv --print-source sass``:
    a header row naming Address, Source, the sampling columns and one ``stall_*`` column per reason."""
    table = list(csv.reader(io.StringIO(source_csv)))
    start = next((i for i, row in enumerate(table) if row[:2] == ["Address", "Source"]), None)
    if start is None:
        raise ValueError("no source table (a header row starting 'Address', 'Source') in ncu's output")
    header = table[start]
    column = {name: i for i, name in enumerate(header)}
    samples = column["Warp Stall Sampling (All Samples)"]
    executed = column.get("Instructions Executed")
    reasons = [name for name in header if name.startswith("stall_") and "(Not Issued)" not in name]
    rows = []
    for values in table[start + 1:]:
        if len(values) != len(header):
            continue
        count = _number(values[samples])
        by_reason = sorted(((_number(values[column[r]]), r[len("stall_"):]) for r in reasons), reverse=True)
        rows.append({"address": values[0], "instruction": " ".join(values[1].split()), "samples": count,
                     "executed": _number(values[executed]) if executed is not None else None,
                     "reasons": {name: n for n, name in by_reason[:2] if n > 0}})
    total = sum(r["samples"] for r in rows)
    return total, sorted(rows, key=lambda r: -r["samples"])[:top]


def markdown(total: float, rows: list[dict]) -> str:
    lines = ["| share of samples | executed (warps) | instruction | top stall reasons |", "|---:|---:|---|---|"]
    for r in rows:
        share = 100 * r["samples"] / total if total else 0.0
        reasons = ", ".join(f"{name} {100 * n / r['samples']:.0f}%" for name, n in r["reasons"].items())
        executed = "-" if r["executed"] is None else f"{r['executed']:.0f}"
        lines.append(f"| {share:.1f}% | {executed} | `{r['instruction']}` | {reasons} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ncu_source", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=3, metavar=("CONFIG", "IMPL", "BACKWARD"), help=argparse.SUPPRESS)
    parser.add_argument("--config", default="vlm32k_d256", help="a benchmark config name")
    parser.add_argument("--impl", default="mmsparse", help="a benchmark implementation (mmsparse_nondet: the one pass)")
    parser.add_argument("--backward", action="store_true", help="run forward + backward (to profile a backward kernel)")
    parser.add_argument("--kernel", default="attention_fwd_gluon", help="the kernel's name (a regex)")
    parser.add_argument("--top", type=int, default=TOP, help="instructions listed")
    parser.add_argument("--out", type=Path, default=Path("ncu-source"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the profiled process")
    args = parser.parse_args(argv)
    if args.child:
        config, impl, backward = args.child
        child(config, impl, backward == "1")
        return 0
    ncu = ncu_binary()
    if ncu is None:
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / f"{args.config}-source"
    # --clock-control none: sampling reads the card as it runs, at the clocks it has
    subprocess.run([ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
                    "-k", f"regex:{args.kernel}", "-c", "1", "--section", "SourceCounters", "--section",
                    "WarpStateStats", "--import-source", "yes", "--force-overwrite", "--export", str(report),
                    sys.executable, "-m", "tools.ncu_source", "--child", args.config, args.impl,
                    "1" if args.backward else "0"],
                   check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    source = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source",
                             "sass"], check=True, capture_output=True, text=True).stdout
    total, rows = stall_rows(source, args.top)
    import torch

    from benchmarks.env import environment

    env = environment(torch.device("cuda"))
    record = {"environment": env, "config": args.config, "impl": args.impl, "backward": args.backward,
              "kernel": args.kernel, "samples": total, "top": rows}
    (args.out / "ncu_source.json").write_text(json.dumps(record, indent=1) + "\n")
    run = f"{args.impl}, one forward" + (" + backward" if args.backward else "")
    head = (f"`{args.kernel}` on {args.config} ({run}): the SASS instructions with the most warp stall "
            f"samples ({total:.0f} in all). {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit "
            f"{env['commit']}.\n\n")
    (args.out / "ncu_source.md").write_text(head + markdown(total, rows))
    print(head + markdown(total, rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
