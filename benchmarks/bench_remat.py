"""Rematerialisation on real gloo processes: an 8-layer GPT (``tests/toy_models.py``; d=128, 4
heads, 16 sequences of 128 tokens over 2 ranks, FSDP: params ``P("dp")`` on dim 0, gathered again
in the backward) with every block wrapped in torch's activation checkpointing
(``checkpoint_wrapper``, as torchtitan's full AC wraps each block; vsf honours the checkpoint
inside its traced step), measured side by side in one run:

* ``memory``: the peak of heap bytes in use during one step on rank 0 beyond those in use when
  it starts (``bench_torch``'s ``mallinfo2`` reading), vsf with every block rematerialised vs
  vsf without, and vs FSDP2 ``fully_shard`` per block over the same checkpointed blocks;
* ``step``: median step time (slowest rank), remat vs no remat;
* ``estimate``: ``Lowered.cost().peak_bytes`` less the step's inputs (params and optimizer
  state, in use before the step) against the measured peak.

Run::

    python -m benchmarks.bench_remat [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config(quick: bool):
    from benchmarks.bench_torch import _config as base

    return dataclasses.replace(base(quick=True), vocab=512, seq=128, dim=128, heads=4, layers=4 if quick else 8)


def _checkpointed(model):
    """Every block wrapped in torch's non-reentrant activation checkpointing (torchtitan's full AC)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model


def _input_bytes(lowered) -> int:
    from vsf.jit.cost import local_bytes
    from vsf.jit.graph import placeholders_of

    plan = lowered.plan
    return sum(local_bytes(plan.mesh, ph.meta["val"], pl) for ph, pl in zip(placeholders_of(plan.graph), plan.inputs))


def _worker(out: str, quick: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import vsf
    from vsf import P
    from benchmarks.bench_jit import interleaved_times
    from benchmarks.bench_torch import _batch, _fsdp_rules, _model, _peak_bytes, _torch_step, _vsf_step

    cfg = _config(quick)
    idx, tgt = _batch(cfg, sequences=16)
    mesh = vsf.make_mesh((int(os.environ["WORLD_SIZE"]),), ("dp",))
    n, rank = mesh.size, dist.get_rank()
    rows = slice(rank * len(idx) // n, (rank + 1) * len(idx) // n)

    plain_model = _model(cfg)
    plain, low_plain = _vsf_step(plain_model, mesh, _fsdp_rules(plain_model, n), P("dp"), idx, tgt, reshard=True)
    remat_model = _checkpointed(_model(cfg))
    remat, low_remat = _vsf_step(remat_model, mesh, _fsdp_rules(remat_model, n), P("dp"), idx, tgt, reshard=True)
    fsdp = _checkpointed(_model(cfg))
    torch_mesh = init_device_mesh("cpu", (n,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=torch_mesh)
    fully_shard(fsdp, mesh=torch_mesh)
    fsdp_step = _torch_step(fsdp, list(fsdp.parameters()))
    steps = {"plain": plain, "remat": remat, "fsdp2_ac": lambda: fsdp_step(idx[rows], tgt[rows])}
    for run in steps.values():  # warm up (the vsf steps trace their programs on the first call)
        run()
        run()
    times = interleaved_times({"plain": plain, "remat": remat}, 3 if quick else 8)
    result = {
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "peak": {k: _peak_bytes(run) for k, run in steps.items()},
        "estimate": {
            k: low.cost().peak_bytes - _input_bytes(low) for k, low in (("plain", low_plain), ("remat", low_remat))
        },
        "recomputed": "ops recomputed in the backward" in low_remat.as_text(),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def run(quick: bool) -> list[dict]:
    from vsf import launch

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "remat.json")
        launch.run(Path(__file__).resolve(), 2, "--worker", out, *(["--quick"] if quick else []), timeout=1800)
        r = json.loads(Path(out).read_text())
    peak, t, est = r["peak"], r["seconds"], r["estimate"]
    layers = _config(quick).layers
    where = f"{layers}-layer GPT, FSDP, 2 gloo procs"
    rows = [
        {
            "name": f"peak heap bytes, every block rematerialised vs none, {where}",
            "vsf": peak["remat"],
            "ref": peak["plain"],
            "unit": "B",
            "ratio": peak["remat"] / peak["plain"],
            "target": "<= 0.5",
            "met": peak["remat"] / peak["plain"] <= 0.5,
        },
        {
            "name": f"step, every block rematerialised vs none, {where}",
            "vsf": t["remat"],
            "ref": t["plain"],
            "unit": "s",
            "ratio": t["remat"] / t["plain"],
            "target": "<= 1.35",
            "met": t["remat"] / t["plain"] <= 1.35,
        },
        {
            "name": f"peak heap bytes, vsf full remat vs FSDP2 with full activation checkpointing, {where}",
            "vsf": peak["remat"],
            "ref": peak["fsdp2_ac"],
            "unit": "B",
            "ratio": peak["remat"] / peak["fsdp2_ac"],
            "target": "<= 1.0",
            "met": peak["remat"] / peak["fsdp2_ac"] <= 1.0,
        },
    ]
    for k, label in (("remat", "full remat"), ("plain", "no remat")):
        ratio = est[k] / peak[k]
        rows.append(
            {
                "name": f"estimated peak (cost().peak_bytes less the inputs) vs measured, {label}, {where}",
                "vsf": est[k],
                "ref": peak[k],
                "unit": "B",
                "ratio": ratio,
                "target": "0.9-1.1",
                "met": 0.9 <= ratio <= 1.1,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, fewer repetitions")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        sys.path.insert(0, str(ROOT))  # a worker runs this file as a script: this checkout's vsf and benchmarks
        _worker(ns.worker, ns.quick)
        return
    for row in run(ns.quick):
        print(
            f"{row['name']:<100} vsf {row['vsf']:>14.6g}  ref {row['ref']:>14.6g}  ratio {row['ratio']:6.3f}  (target {row['target']})"
        )


if __name__ == "__main__":
    main()
