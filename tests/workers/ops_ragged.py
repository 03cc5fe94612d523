"""Tier-3 worker: RaggedShard on real gloo processes.

Run as ``torchrun --nproc-per-node 4 ops_ragged.py OUT_DIR``. For many random shapes and
layouts (the same on every rank, from a fixed seed), on a 1D and a 2D mesh:

* ``reshard`` over "fsdp": Replicate -> Ragged(u1) -> Shard(d) -> Ragged(u2) -> Replicate and
  Partial -> Ragged -> Partial -> Ragged, every rank's piece against ops_oracles.expected_piece;
  for the first cases each step's gradient (the transposed redistribution) against autograd;
* the same round trip through the public ``vsf.device_put`` with another axis splitting a later
  dim (unevenly too: real processes allow it), local shards against ops_oracles.expected_local
  and ``vsf.device_get`` exact;
* a few ``vsf.optim.muon`` steps on params packed by ``ragged_plan`` against the same steps on
  plain tensors in this process, recording where each matrix was orthogonalised;
* ``gather_group`` of those params: exact, and how many collectives it took.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import vsf
from ops_oracles import all_close, check_on_rank, expected_local, expected_piece, ragged_case, reshard_case, seeded
from vsf import P, optim
from vsf.ops import backend
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
                steps = [
                    (Replicate(), r1),
                    (r1, Shard(d)),
                    (Shard(d), r2),
                    (r2, Replicate()),
                    (Partial(), r1),
                    (r1, Partial()),
                ]
                for src, dst in steps:
                    ok = check_on_rank(reshard_case(shape, src, dst, "fsdp", n), mesh, rank)
                    failures += [
                        f"case {case} {shape}: {what} of {src} -> {dst}" for what, good in ok.items() if not good
                    ]
    return CASES, failures


PUT_CASES = 16


def run_device_put(mesh: vsf.Mesh, rank: int, seed: int) -> tuple[int, list[str]]:
    """Replicate -> Ragged(u1) -> Shard -> Ragged(u2) -> Replicate through device_put; on the 2D
    mesh "dp" splits a later dim (any size: uneven splits too)."""
    n, draw, failures = mesh.axis_size("fsdp"), seeded(seed), []
    sizes, names = mesh.axis_sizes, mesh.axis_names
    for case in range(PUT_CASES):
        shape, r1, r2, d = ragged_case(draw, n, "fsdp")
        later = max(r1.dims, r2.dims)
        rest = [None] * (len(shape) - 1)
        shard = [None] * len(shape)
        if "dp" in names and later < len(shape):
            rest[later - 1] = "dp"
            shard[later] = "dp"
            d = d if d != later else 0
        shard[d] = "fsdp"
        full = torch.randn(shape, generator=torch.Generator().manual_seed(case))
        x = full
        for spec in (P(r1, *rest), P(*shard), P(r2, *rest), P()):
            x = vsf.device_put(x, vsf.NamedSharding(mesh, spec))
            if not torch.equal(x.to_local(), expected_local(full, sizes, names, list(spec), rank)):
                failures.append(f"case {case} {shape}: local shard of {spec}")
            if not torch.equal(vsf.device_get(x), full):
                failures.append(f"case {case} {shape}: device_get of {spec}")
    return PUT_CASES, failures


MUON_STEPS = 3


def run_muon(mesh: vsf.Mesh) -> dict:
    """Muon on params packed by ragged_plan vs the same steps on plain tensors here; the
    (rank, leaf) of each Newton-Schulz run; gather_group's exactness and collective count."""
    gen = torch.Generator().manual_seed(7)
    params = {
        "a": torch.randn(32, 16, generator=gen),
        "b": torch.randn(16, generator=gen),
        "c": torch.randn(16, 48, generator=gen),
        "d": torch.randn(24, 24, generator=gen),
        "e": torch.randn(8, 40, generator=gen),
    }
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(MUON_STEPS)]
    plan = vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh)
    seen: list[list] = []
    tx = optim.muon(0.02, weight_decay=0.1, on_orthogonalize=lambda r, path: seen.append([r, path]))
    placed = vsf.device_put(params, plan)
    state = tx.init(placed)
    ref, ref_tx = dict(params), optim.muon(0.02, weight_decay=0.1)
    ref_state = ref_tx.init(ref)
    for g in grads:
        updates, state = tx.update(vsf.device_put(g, plan), state, placed)
        placed = optim.apply_updates(placed, updates)
        ref_updates, ref_state = ref_tx.update(g, ref_state, ref)
        ref = optim.apply_updates(ref, ref_updates)
    full = vsf.device_get(placed)
    calls = []
    exchange = backend.exchange
    backend.exchange = lambda *a, **k: (calls.append(1), exchange(*a, **k))[1]
    try:
        gathered = vsf.sharding.gather_group(placed)
    finally:
        backend.exchange = exchange
    return {
        "equal": {k: bool(torch.equal(full[k], ref[k])) for k in params},
        "orthogonalized": seen,
        "gather_exact": all(torch.equal(gathered[k].to_local(), full[k]) for k in params),
        "gather_collectives": len(calls),
    }


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    report = {}
    for name, (sizes, names) in {"1d": ((4,), ("fsdp",)), "2d": ((2, 2), ("dp", "fsdp"))}.items():
        mesh = vsf.make_mesh(sizes, names, device_type="cpu")
        cases, failures = run_mesh(mesh, rank, seed=len(name) + sizes[0])
        put_cases, put_failures = run_device_put(mesh, rank, seed=11 + sizes[0])
        report[name] = {"cases": cases, "failures": failures, "put_cases": put_cases, "put_failures": put_failures}
    report["muon"] = run_muon(vsf.make_mesh((4,), ("fsdp",), device_type="cpu"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
