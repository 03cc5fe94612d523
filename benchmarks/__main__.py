"""Run every benchmark and print one table of ratios: ``python -m benchmarks [--quick] [--only NAME]``.

Each row is vsf next to its reference, measured side by side in the same run, the ratio, the
target its issue set, and whether this run met it; the machine's CPU count, load average and
torch version come first, since every figure depends on them. The table is Markdown, ready to
paste into docs/benchmarks.md. ``torch`` and ``jit`` run first: each simulates ranks in this process,
which needs a process without a process group.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import time
from collections.abc import Sequence

import torch

BENCHMARKS = {
    "torch": "benchmarks.bench_torch",
    "jit": "benchmarks.bench_jit",
    "optim": "benchmarks.bench_optim",
    "ragged": "benchmarks.bench_ragged",
    "checkpoint": "benchmarks.bench_checkpoint",
    "random": "benchmarks.bench_random",
    "context_parallel": "benchmarks.bench_context_parallel",
    "pipeline": "benchmarks.bench_pipeline",
    "moe": "benchmarks.bench_moe",
    "remat": "benchmarks.bench_remat",
}


MET = {True: "yes", False: "**no**", None: "-"}


def machine() -> str:
    """Where the figures come from: date, CPUs, load, Python and torch versions."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{datetime.date.today().isoformat()}, {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {load} before the run), Python {platform.python_version()}, torch {torch.__version__}"
    )


def _value(x: float, unit: str) -> str:
    if unit == "":
        return f"{x:.0f}"
    if unit == "%":
        return f"{100 * x:.1f}%"
    if unit == "B":
        for scale, name in ((1 << 20, "MiB"), (1 << 10, "KiB")):
            if x >= scale:
                return f"{x / scale:.2f} {name}"
        return f"{x:.0f} B"
    for scale, name in ((1, "s"), (1e-3, "ms")):
        if x >= scale:
            return f"{x / scale:.3g} {name}"
    return f"{x * 1e6:.3g} us"


def table(rows: Sequence[dict]) -> str:
    """The rows (each with its ``bench``) as a Markdown table."""
    lines = ["| benchmark | measurement | vsf | reference | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['bench']} | {r['name']} | {_value(r['vsf'], r['unit'])} | {_value(r['ref'], r['unit'])} "
            f"| {r['ratio']:.3f} | {r['target']} | {MET[r['met']]} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (about a minute or two)")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    args = parser.parse_args(argv)
    where = machine()
    rows, seconds = [], {}
    for name in args.only or list(BENCHMARKS):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        rows.extend({**row, "bench": name} for row in importlib.import_module(BENCHMARKS[name]).run(args.quick))
        seconds[name] = time.perf_counter() - start
    print(f"{'quick' if args.quick else 'full'} run, {where}\n")
    print(table(rows))
    print("\nbenchmark run times: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))


if __name__ == "__main__":
    main()
