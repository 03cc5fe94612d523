"""vsf.jit against eager DTensor, the cost of a cached call, and planning time at scale.

Three measurements, each a ratio taken side by side in one run:

* ``step``: one SGD train step of a small GPT, ``vsf.jit`` against the same step run eagerly on
  DTensors with the same shardings (``vsf.value_and_grad`` on DTensor params), on 2 gloo processes
  (data parallel) and 4 (data x Megatron tensor parallel). Median per step, slowest rank.
* ``call``: a cached call of a trivial jitted function against the same op run eagerly on a
  DTensor (the target is under 100 microseconds per call).
* ``plan``: tracing, propagating and planning a GPT train step of 6, 24 and 96 layers on a
  planning-only 5D mesh of 1024 ranks against 8 ranks (issue 33: 24 layers in <= 3 s on 8 ranks
  and <= 5 s on 1024, growing at most 20%), and 96 layers against 24 (at most 2x). Each case is
  planned in a fresh interpreter, as a user's first plan is: in one process a later plan finds
  torch's and vsf's per-signature caches warm, and the figures would depend on the cases' order.

Run::

    python -m benchmarks.bench_jit [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FSDP_TP = [
    (r".*(qkv|fc1)\.weight", ("tp",)),
    (r".*(qkv|fc1)\.bias", ("tp",)),
    (r".*(proj|fc2)\.weight", (None, "tp")),
    (r".*", ()),
]


def _gpt(layers: int, dim: int, seq: int, vocab: int, meta: bool = False):
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from toy_models import GPT, GPTConfig

    cfg = GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=4, layers=layers)
    if meta:
        with torch.device("meta"):
            return GPT(cfg), cfg
    return gpt(cfg), cfg


def gpt(cfg):
    """The test GPT of ``cfg`` (``tests/toy_models.py``), seeded, with GPT-2's init (matrices
    N(0, 0.02)): with torch's default N(0, 1) embedding the tied head's logits are so peaked that
    the loss gradient is mostly subnormal floats, and the two head matmuls of the backward pass
    then take most of the step on a CPU, for vsf and its reference alike."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from toy_models import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def _step_fn(model):
    import vsf

    def loss_fn(p, idx, tgt):
        return vsf.tree.apply(model, p, idx, tgt)

    def step(p, idx, tgt):
        loss, g = vsf.value_and_grad(loss_fn)(p, idx, tgt)
        return vsf.tree.map(lambda a, b: a - 0.01 * b, p, g), loss

    return step


def _rules():
    from vsf import P

    return [(rx, P(*spec)) for rx, spec in FSDP_TP]


def _step_worker(out: str, quick: bool) -> None:
    import torch
    import torch.distributed as dist

    import vsf
    from vsf import P

    world = int(os.environ["WORLD_SIZE"])
    model, cfg = _gpt(layers=2, dim=64 if quick else 128, seq=32 if quick else 64, vocab=256)
    params = vsf.tree.from_module(model)
    shape, names = ((2,), ("dp",)) if world == 2 else ((2, world // 2), ("dp", "tp"))
    mesh = vsf.make_mesh(shape, names)
    rules = _rules() if "tp" in names else [(r".*", P())]
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    idx = torch.randint(0, cfg.vocab, (16, cfg.seq))
    batch = vsf.device_put((idx, idx.roll(1, 1)), vsf.NamedSharding(mesh, P("dp")))
    step = _step_fn(model)
    jitted = vsf.jit(step)
    shardings = vsf.tree.map(vsf.sharding.sharding_of, p)

    def eager() -> None:  # the same step on DTensors, its new params laid out like the old ones
        new, loss = step(p, *batch)
        vsf.device_put(new, shardings)
        vsf.device_get(loss)

    def jit() -> None:
        _, loss = jitted(p, *batch)
        vsf.device_get(loss)

    runners = {"eager": eager, "jit": jit}
    for run in runners.values():  # warm up (plans and traces the jitted step)
        run()
    times = interleaved_times(runners, 5 if quick else 20)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in times.items()}))


def bench_steps(quick: bool) -> list[dict]:
    from vsf import launch

    rows = []
    for nproc in (2, 4):
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "step.json")
            launch.run(Path(__file__).resolve(), nproc, "--worker", out, *(["--quick"] if quick else []), timeout=1200)
            t = json.loads(Path(out).read_text())
        ratio = t["jit"] / t["eager"]
        rows.append(
            {
                "name": f"jit step vs eager DTensor, small GPT, {nproc} gloo procs",
                "vsf": t["jit"],
                "ref": t["eager"],
                "unit": "s",
                "ratio": ratio,
                "target": "<= 0.5",
                "met": ratio <= 0.5,
            }
        )
    return rows


PLAN_SHAPES = {
    8: (1, 2, 2, 1, 2),
    1024: (2, 8, 4, 4, 4),
}  # (pp, dp, fsdp, cp, tp): every axis of 1024 ranks larger than 1


def plan_seconds(layers: int, ranks: int) -> float:
    """CPU seconds of ``vsf.jit(step).lower(...)`` (tracing, planning, lowering) of issue 33's step:
    an AdamW train step of a ``layers``-layer GPT (d=128, separate qkv/proj/fc1/fc2 linears, tp and
    fsdp on the weights, batch over dp x fsdp) on a planning-only 5D mesh of ``ranks``
    (:data:`PLAN_SHAPES`). CPU time, not wall: planning runs on one thread, and other work on the
    machine then does not count (on a quiet machine the two are equal)."""
    import gc

    import torch

    import vsf
    from vsf import P, optim

    model, cfg = _gpt(layers=layers, dim=128, seq=64, vocab=256, meta=True)
    opt = optim.adamw(1e-3)

    def step(p, s, idx, tgt):
        loss, g = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(p)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, loss

    with vsf.simulate(ranks, compute=False):
        mesh = vsf.make_mesh(PLAN_SHAPES[ranks], ("pp", "dp", "fsdp", "cp", "tp"))
        params = {k: torch.empty(v.shape) for k, v in vsf.tree.from_module(model).items()}
        p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, _rules())))
        idx = vsf.device_put(torch.zeros(64, cfg.seq, dtype=torch.long), vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
        s = opt.init(p)
        gc.collect()
        t0 = time.process_time()
        vsf.jit(step).lower(p, s, idx, idx)
        return time.process_time() - t0


def fresh_plan_seconds(layers: int, ranks: int) -> float:
    """:func:`plan_seconds` in a fresh interpreter (``python -m benchmarks.bench_jit --plan LAYERS RANKS``)."""
    import subprocess

    argv = [sys.executable, "-m", "benchmarks.bench_jit", "--plan", str(layers), str(ranks)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"planning {layers} layers on {ranks} ranks failed:\n{done.stderr[-4000:]}")
    return float(done.stdout.split()[-1])


def bench_planning(quick: bool) -> list[dict]:
    """Planning time against depth (6, 24, 96 layers; 6 and 24 with ``quick``) and ranks (8 and
    1024): per depth 1024 ranks against 8 (issue 33's targets for 24 layers: <= 3 s on 8 ranks,
    <= 5 s on 1024, ratio <= 1.2), then the deepest against 24 layers on each (<= 2: repeated
    blocks are decided once)."""
    depths = (6, 24) if quick else (6, 24, 96)
    t = {(n, r): fresh_plan_seconds(n, r) for n in depths for r in PLAN_SHAPES}
    rows = []
    for n in depths:
        ratio = t[(n, 1024)] / t[(n, 8)]
        target, met = (
            ("<= 5 s (8 ranks <= 3 s), ratio <= 1.2", t[(n, 1024)] <= 5 and t[(n, 8)] <= 3 and ratio <= 1.2)
            if n == 24
            else ("ratio <= 1.2", ratio <= 1.2)
        )
        rows.append(
            {
                "name": f"planning a {n}-layer GPT step, 1024 vs 8 ranks (5D)",
                "vsf": t[(n, 1024)],
                "ref": t[(n, 8)],
                "unit": "s",
                "ratio": ratio,
                "target": target,
                "met": met,
            }
        )
    deep = depths[-1]
    if deep != 24:
        for r in PLAN_SHAPES:
            ratio = t[(deep, r)] / t[(24, r)]
            rows.append(
                {
                    "name": f"planning a {deep}-layer vs a 24-layer GPT step, {r} ranks",
                    "vsf": t[(deep, r)],
                    "ref": t[(24, r)],
                    "unit": "s",
                    "ratio": ratio,
                    "target": "<= 2",
                    "met": ratio <= 2,
                }
            )
    return rows


def interleaved_times(steps: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    """Each step's wall time in each of ``reps`` rounds, the steps taken in turn within a round so
    that all see the same machine load, in their order in even rounds and in reverse in odd ones:
    over an even ``reps`` every step runs as often after each neighbour as before it, at the same
    mean position (in a fixed order one step always ran after the same other one). Every rank starts a step together
    (a barrier), and a time is the slowest rank's (an all-reduce MAX), on every rank."""
    import torch
    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            run = steps[name]
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(dt.item())
    return times


def bench_call(quick: bool) -> list[dict]:
    import torch

    import vsf
    from vsf import P

    mesh = vsf.make_mesh((1,), ("x",), device_type="cpu")
    x = vsf.device_put(torch.ones(8), vsf.NamedSharding(mesh, P()))
    f = vsf.jit(lambda a: a + 1)
    f(x)
    n = 2000 if quick else 20000

    def per_call(fn) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x)
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    jit_s, eager_s = per_call(f), per_call(lambda a: a + 1)
    return [
        {
            "name": "cached call of a trivial jitted function vs the eager DTensor op",
            "vsf": jit_s,
            "ref": eager_s,
            "unit": "s",
            "ratio": jit_s / eager_s,
            "target": "< 100 us per call",
            "met": jit_s < 100e-6,
        }
    ]


def run(quick: bool) -> list[dict]:
    """All jit measurements as rows of the suite's table (see ``benchmarks``)."""
    return bench_planning(quick) + bench_call(quick) + bench_steps(quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer repetitions")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan", nargs=2, type=int, metavar=("LAYERS", "RANKS"), help="print plan_seconds of one case")
    ns = parser.parse_args()
    if ns.plan:
        print(plan_seconds(*ns.plan))
        return
    if ns.worker:
        _step_worker(ns.worker, ns.quick)
        return
    for row in run(ns.quick):
        print(
            f"{row['name']:<72} vsf {row['vsf'] * 1e3:10.3f} ms  ref {row['ref'] * 1e3:10.3f} ms  ratio {row['ratio']:6.3f}  (target {row['target']})"
        )


if __name__ == "__main__":
    main()
