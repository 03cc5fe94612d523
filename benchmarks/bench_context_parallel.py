"""Context parallelism against data parallelism, the ring against gathered keys, and the balanced
causal layout against the contiguous one, measured side by side in one run of 4 gloo processes
(one thread each).

The model is the test GPT with causal SDPA (``tests/toy_models.py``; d=64, 4 heads, 1 layer,
vocab 256), 4 sequences of 4096 tokens per AdamW step (``--quick``: 1024), so every layout
processes the same tokens per step and every rank 4096 of them:

* ``step``: median step time (slowest rank) of ``cp=4`` (each sequence split over the 4 ranks,
  tokens ``P(None, "cp")``, the default ``"auto"`` mode) against ``dp=4`` (one whole sequence per
  rank, ``P("dp")``); of the ring (``vsf.config.context_parallel = "ring"``) against ``"auto"``
  (here: keys and values fit the gather budget, so each rank gathers them and runs attention on
  its own queries; a cost model that counted only bytes gathered the queries too, and every rank
  computed the whole attention); of the balanced layout (``P(None, vsf.balanced("cp"))``) against the contiguous
  one, on the ring (where attention runs on the shards).
* ``spread``: per rank, the time its attention kernels take in one step (the profiler's CPU
  time of the SDPA kernel and its backward), max over min across the ranks, contiguous and
  balanced, on the ring (causal: with contiguous shards rank ``i`` attends to ``i + 1`` blocks of
  keys; the balanced layout gives every rank the same work).

Run::

    python -m benchmarks.bench_context_parallel [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
ATTENTION = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)


def _config(quick: bool):
    sys.path.insert(0, str(ROOT / "tests"))
    from toy_models import GPTConfig

    return GPTConfig(vocab=256, seq=1024 if quick else 4096, dim=64, heads=4, layers=1, tied=False, sdpa=True)


def _attention_seconds(step: Callable[[], None]) -> float:
    """CPU seconds this process's attention kernels (forward and backward) take in one ``step``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.cpu_time_total for e in prof.key_averages() if e.key in ATTENTION) / 1e6


def _worker(out: str, quick: bool) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))  # (a worker runs this file as a script)
    from benchmarks.bench_jit import interleaved_times
    from benchmarks.bench_torch import _batch, _model, _vsf_step

    import vsf
    from vsf import P

    torch.set_num_threads(1)
    cfg = _config(quick)
    idx, tgt = _batch(cfg, sequences=RANKS)
    everything = [(r".*", ())]
    dp = vsf.make_mesh((RANKS,), ("dp",))
    cp = vsf.make_mesh((RANKS,), ("cp",))
    variants = {
        "dp": (dp, P("dp"), "auto"),
        "cp_auto": (cp, P(None, "cp"), "auto"),
        "cp_ring": (cp, P(None, "cp"), "ring"),
        "cp_balanced_ring": (cp, P(None, vsf.balanced("cp")), "ring"),
    }
    steps = {}
    for name, (mesh, spec, mode) in variants.items():
        vsf.config.context_parallel = mode  # read when the step is planned
        steps[name], _ = _vsf_step(_model(cfg), mesh, everything, spec, idx, tgt)
        steps[name]()  # warm up: the step traces its program on the first call
    times = interleaved_times(steps, 2 if quick else 3)
    spread = {}
    for name in ("cp_ring", "cp_balanced_ring"):
        dist.barrier()
        mine = torch.tensor(_attention_seconds(steps[name]))
        every = [torch.zeros(()) for _ in range(RANKS)]
        dist.all_gather(every, mine)
        spread[name] = [t.item() for t in every]
    if dist.get_rank() == 0:
        Path(out).write_text(
            json.dumps({"seconds": {k: statistics.median(v) for k, v in times.items()}, "attention": spread})
        )


def run(quick: bool) -> list[dict]:
    """The measurements as rows of the suite's table (see ``benchmarks``)."""
    from vsf import launch

    cfg = _config(quick)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "cp.json")
        launch.run(Path(__file__).resolve(), RANKS, "--worker", out, *(["--quick"] if quick else []), timeout=1800)
        r = json.loads(Path(out).read_text())
    t, where = r["seconds"], f"GPT seq {cfg.seq}, {RANKS} sequences, {RANKS} gloo procs"
    rows = []
    for mine, theirs, label in (
        ("cp_auto", "dp", "cp=4 (auto: all gathered) vs dp=4, equal tokens"),
        ("cp_ring", "dp", "cp=4 ring vs dp=4, equal tokens"),
        ("cp_ring", "cp_auto", "cp=4 ring vs auto (all gathered)"),
        ("cp_balanced_ring", "cp_ring", "cp=4 ring, balanced vs contiguous"),
    ):
        rows.append(
            {
                "name": f"step, {label}, {where}",
                "vsf": t[mine],
                "ref": t[theirs],
                "unit": "s",
                "ratio": t[mine] / t[theirs],
                "target": "-",
                "met": None,
            }
        )
    for name, label, target in (("cp_ring", "contiguous", None), ("cp_balanced_ring", "balanced", 1.2)):
        per_rank = r["attention"][name]
        ratio = max(per_rank) / min(per_rank)
        rows.append(
            {
                "name": f"per-rank attention time max / min, {label} causal layout (ring), {where}",
                "vsf": max(per_rank),
                "ref": min(per_rank),
                "unit": "s",
                "ratio": ratio,
                "target": "-" if target is None else f"<= {target}",
                "met": None if target is None else ratio <= target,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequences of 1024 tokens and fewer repetitions")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _worker(ns.worker, ns.quick)
        return
    for row in run(ns.quick):
        print(
            f"{row['name']:<100} vsf {row['vsf']:>10.4g}  ref {row['ref']:>10.4g}  ratio {row['ratio']:6.3f}  (target {row['target']})"
        )


if __name__ == "__main__":
    main()
