"""Tier-3 worker: RaggedShard redistributions on real gloo processes.

Run as ``torchrun --nproc-per-node 4 ops_ragged.py OUT_DIR``. For many random shapes and
layouts (the same on every rank, from a fixed seed) it runs Replicate -> Ragged(u1) -> Shard(d)
-> Ragged(u2) -> Replicate and Partial -> Ragged -> Partial -> Ragged over "fsdp" on a 1D and a
2D mesh, and checks every rank's piece against ops_oracles.expected_piece; for the first
cases it also checks each step's gradient (the transposed redistribution) against autograd.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import vsf
from ops_oracles import all_close, check_on_rank, expected_piece, ragged_case, reshard_case, seeded
from vsf.sharding.ragged import reshard

CASES = 40
GRADIENT_CASES = 8


def run_mesh(mesh: vsf.Mesh, rank: int, seed: int) -> tuple[int, list[str]]:
    """Cases run and failures on ``mesh``; the dp axis (if any) gives each fsdp group its own value."""
    n, me = mesh.axis_size("fsdp"), mesh.coordinate(rank)["fsdp"]
    scale = 1 + mesh.coordinate(rank).get("dp", 0)
    draw, failures = seeded(seed), []
    for case in range(CASES):
        shape, r1, r2, d = ragged_case(draw, n, "fsdp")
        full = torch.randn(shape, generator=torch.Generator().manual_seed(case)) * scale
        with vsf.use_mesh(mesh):
            x, src = full, Replicate()
            for dst in (r1, Shard(d), r2, Replicate()):
                x = reshard(x, shape, src, dst)
                if not torch.equal(x, expected_piece(full, dst, me, n)):
                    failures.append(f"case {case} {shape}: {src} -> {dst}")
                src = dst
            summed = full * sum(range(1, n + 1))
            y = reshard(full * (1 + me), shape, Partial(), r1)
            z = reshard(reshard(y, shape, r1, Partial()), shape, Partial(), r2)
            for got, layout, step in ((y, r1, "Partial -> Ragged"), (z, r2, "Ragged -> Partial -> Ragged")):
                if not all_close(got, expected_piece(summed, layout, me, n)):
                    failures.append(f"case {case} {shape}: {step} {layout}")
            if case < GRADIENT_CASES:
                steps = [(Replicate(), r1), (r1, Shard(d)), (Shard(d), r2), (r2, Replicate()), (Partial(), r1), (r1, Partial())]
                for src, dst in steps:
                    ok = check_on_rank(reshard_case(shape, src, dst, "fsdp", n), mesh, rank)
                    failures += [f"case {case} {shape}: {what} of {src} -> {dst}" for what, good in ok.items() if not good]
    return CASES, failures


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    report = {}
    for name, (sizes, names) in {"1d": ((4,), ("fsdp",)), "2d": ((2, 2), ("dp", "fsdp"))}.items():
        cases, failures = run_mesh(vsf.make_mesh(sizes, names, device_type="cpu"), rank, seed=len(name) + sizes[0])
        report[name] = {"cases": cases, "failures": failures}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
