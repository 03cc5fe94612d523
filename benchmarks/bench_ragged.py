"""Ragged vs padded-even all-gather of one parameter group on 4 gloo processes.

The group is a small transformer block's parameters (odd sizes, so an even split needs
padding). Two ways to gather it, measured side by side in the same processes:

* ``ragged``: the group packed into one flat buffer split in balanced element counts
  (a ``RaggedShard`` over the flat buffer), gathered with one ``vsf.ops.all_gather_v``;
* ``padded``: every tensor as ``Shard(0)`` (``torch.chunk`` rows, padded to the largest chunk
  as DTensor / FSDP2 do), the padded pieces concatenated and gathered with one even
  ``vsf.ops.all_gather``;
* ``gather_group``: the public path end to end, params placed by
  ``vsf.sharding.ragged_plan`` (whole rows, balanced bytes) and gathered by
  ``vsf.sharding.gather_group`` (one ``all_gather_v``, plus packing and unpacking the leaves).

Bytes are what each process's sockets wrote (``/proc/self/io``), summed over ranks; time is the
median over repetitions of the slowest rank. Run::

    python -m benchmarks.bench_ragged [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

NPROC = 4


def group_shapes(quick: bool) -> list[tuple[int, ...]]:
    """Parameter shapes of one transformer block of width ``d`` (odd, as vocabularies and
    head counts often make them), plus its norms and biases."""
    d = 257 if quick else 1031
    return [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (1, d), (5, d)]


def balanced(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def padded_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's Shard(0) piece padded to the largest chunk (ceil-div rows)."""
    return -(-shape[0] // n) * math.prod(shape[1:])


def written_bytes() -> int:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["wchar"])


def _worker(out_dir: str, quick: bool) -> None:
    import torch
    import torch.distributed as dist

    import vsf

    rank = int(os.environ["RANK"])
    mesh = vsf.make_mesh((NPROC,), ("fsdp",), device_type="cpu")
    me = mesh.coordinate(rank)["fsdp"]
    shapes = group_shapes(quick)
    total = sum(math.prod(s) for s in shapes)
    layout = vsf.RaggedShard("fsdp", balanced(total, NPROC))
    counts = layout.row_counts((total,))
    ragged_piece = torch.randn(counts[me])
    padded_piece = torch.randn(sum(padded_numel(s, NPROC) for s in shapes))
    params = {f"p{i:02d}": torch.randn(s) for i, s in enumerate(shapes)}
    placed = vsf.device_put(params, vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh))
    ways = {
        "ragged": lambda: vsf.ops.all_gather_v(ragged_piece, "fsdp", counts, mesh=mesh),
        "padded": lambda: vsf.ops.all_gather(padded_piece, "fsdp", mesh=mesh),
        "gather_group": lambda: vsf.sharding.gather_group(placed),
    }
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in ways}
    for rep in range(3 if quick else 10):
        for name, gather in ways.items():
            dist.barrier()
            before, start = written_bytes(), time.perf_counter()
            gather()
            seconds, wire = time.perf_counter() - start, written_bytes() - before
            if rep:  # the first round warms up
                samples[name].append({"seconds": seconds, "wire": wire})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"samples": samples, "total": total}))
    dist.destroy_process_group()


def measure(quick: bool) -> list[dict]:
    """Launch the 4-process measurement and return one row per way of gathering, with ratios."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from multiproc import results, torchrun

    with tempfile.TemporaryDirectory() as out:
        torchrun(Path(__file__).resolve(), NPROC, "--worker", out, *(["--quick"] if quick else []))
        reports = results(Path(out), NPROC)
    shapes = group_shapes(quick)
    total = reports[0]["total"]
    rows = []
    for name in ("ragged", "padded", "gather_group"):
        reps = len(reports[0]["samples"][name])
        seconds = [max(r["samples"][name][i]["seconds"] for r in reports) for i in range(reps)]
        wire = [sum(r["samples"][name][i]["wire"] for r in reports) for i in range(reps)]
        rows.append(
            {
                "way": name,
                "tensors": len(shapes),
                "data_bytes": total * 4,
                "payload_bytes": (NPROC - 1) * total * 4,  # every rank receives the others' data
                "wire_bytes": int(statistics.median(wire)),
                "median_ms": round(statistics.median(seconds) * 1e3, 3),
            }
        )
    ragged, padded, _ = rows
    for row in rows:
        row["wire_vs_payload"] = round(row["wire_bytes"] / row["payload_bytes"], 4)
        row["time_vs_ragged"] = round(row["median_ms"] / ragged["median_ms"], 3)
    padded["wire_vs_ragged"] = round(padded["wire_bytes"] / ragged["wire_bytes"], 4)
    return rows


def run(quick: bool) -> list[dict]:
    """The measurement as rows of the suite's table (see ``benchmarks``): ragged bytes on the
    wire against the payload and against padded ``Shard``, and times against padded ``Shard``."""
    ragged, padded, group = measure(quick)

    def row(name: str, vsf: float, ref: float, unit: str, target: str = "none set", met: bool | None = None) -> dict:
        return {"name": name, "vsf": vsf, "ref": ref, "unit": unit, "ratio": vsf / ref, "target": target, "met": met}

    wire = ragged["wire_bytes"] / ragged["payload_bytes"]
    return [
        row(
            f"ragged all_gather_v, {NPROC} gloo procs: bytes on the wire vs payload",
            ragged["wire_bytes"],
            ragged["payload_bytes"],
            "B",
            "1 (+1% socket framing)",
            1.0 <= wire <= 1.01,
        ),
        row(
            "ragged vs padded-even Shard all-gather: bytes on the wire", ragged["wire_bytes"], padded["wire_bytes"], "B"
        ),
        row("ragged vs padded-even Shard all-gather: time", ragged["median_ms"] / 1e3, padded["median_ms"] / 1e3, "s"),
        row(
            "gather_group (pack, one all_gather_v, unpack) vs padded Shard: time",
            group["median_ms"] / 1e3,
            padded["median_ms"] / 1e3,
            "s",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller group, fewer repetitions")
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker, args.quick)
    for row in measure(args.quick):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
