"""vsf.pipeline's bubble and activation memory on real gloo processes, against the schedule's theory.

A GPT (``examples/gpt.py``: d=256, 4 heads, 8 blocks, vocab 256, microbatches of 4 sequences of 64
tokens; ``--quick``: 4 blocks, microbatches of 2 sequences, pp=4 only) is cut into ``pp`` stages of equal blocks (``pipeline_stages``) on
``pp`` gloo processes with one thread each, and ``pipe.value_and_grad`` runs torch's
``ScheduleGPipe`` / ``Schedule1F1B``, and ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` (two stages a rank, stage ``s`` on rank ``s % pp``),
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (two a rank in a V: stages ``s`` and
``2pp - 1 - s`` on rank ``s``) with ``2 pp`` stages, where the model has that many blocks (not
with ``--quick``).
The microbatch size is fixed, so ``m`` microbatches are a batch of ``4m`` (``2m``) sequences and a
stage's work per microbatch is the same for every ``m``.

* **Idle fraction per stage.** Each rank times its stage's compute inside the step: every
  ``PipelineStage.forward_one_chunk`` (the stage program's forward), ``backward_one_chunk``
  (its backward) and, on the last stage, the schedule's ``_maybe_compute_loss`` (the loss
  forward), wall clock. The step's span is from the first rank entering the schedule's
  ``step`` to the last rank leaving it (``time.monotonic``, one clock for every process of the
  machine). Stage ``s``'s idle fraction is ``1 - busy_s / span``, the median over the timed steps,
  against :func:`vsf.pipeline.bubble` of the schedule's actions (``(p-1)/(m+p-1)`` for every
  stage; interleaved: ``(p-1)/(2m+p-1)`` for every rank, and its span against 1F1B's: with equal
  work, ``(m+(p-1)/2)/(m+p-1)``; zero-bubble, which runs each backward's input part (``I``, what
  the previous stage waits for) and its weight part (``W``, timed on its own) apart: ZB-H1's
  ``(p-1)(F+B-2W)`` idle in ``2m(F+B)`` of work, ``(p-1)/(6m+p-1)`` with ``B = 2F = 2W``; the
  V-shaped ones: their actions' replay with ``B = 2F = 2W``, no closed form here). What the fraction counts as idle: waiting for a neighbour's activation or gradient, the
  sends, and the schedule's own bookkeeping. ``replayed from the measured compute times``: the
  idle fraction :func:`vsf.pipeline.bubble` gives when each action takes the time it was measured
  to take and nothing else takes time: above the theory by what the stages' unequal (and, on
  oversubscribed cores, contention-stretched) compute times add; the measured idle fraction less
  it is what the sends and the bookkeeping add. ``the part with the input there``: the time a stage is free and the input of its
  next action is there (the previous stage's forward of that microbatch has ended, or the next
  stage's backward) but the action has not started: the sends, the receive, waking the process,
  the schedule's bookkeeping; the idle fraction less this part is the time spent waiting for an
  input (the bubble, and a neighbour computing slower). ``pipelined step vs schedule span``: the whole
  ``value_and_grad`` (it also builds the stages, lends the tied embedding, sums its gradient and
  broadcasts the loss).
* **Against torch's own pipelining.** For GPipe and 1F1B at m = 4 and 8, each rank also runs its
  stage the way a user without vsf would: the same stage function over plain tensors in an
  ``nn.Module`` (its own copy of the params; the output layer not tied to the embedding) on
  torch's ``PipelineStage`` and the same schedule class, timed the same way, each repetition next
  to one of vsf's. Its idle fraction against vsf's says what vsf adds to the bubble (its stage
  programs, DTensor wrapping, the loss program); against the theory, what torch's schedules over
  gloo reach on this machine at all.
* **Peak activation memory per stage.** While one step runs, ``torch.autograd.graph.
  saved_tensors_hooks`` count the bytes of the tensors autograd saves for the backward (the stage
  programs save theirs with ``save_for_backward``), each storage once, params' storages excluded,
  from when it is saved until autograd frees it (its backward ran): the peak of that sum over the
  step. The theory beside it: the schedule's most microbatches in flight at once on the stage
  (forwards run whose backward has not, from ``stage_actions``: 1F1B ``min(m, p - s)``, GPipe
  ``m``) times one microbatch's saved bytes (measured the same way across its first forward; the
  last stage's loss saves a little more after it). What is not counted: torch's
  ``PipelineStage`` allocates the receive buffers of all ``m`` microbatches up front (one
  activation and one gradient each), and the stage outputs it keeps until their backward.

Each worker has glibc's malloc keep the memory a step frees (:func:`_keep_freed_memory`), as a
caching allocator would: otherwise the configuration timed first faults its heap back in every
step. The machine has 2 cores shared with other work: 4 processes oversubscribe them, so a stage whose
neighbours compute at the same time computes slower (in 1F1B's steady state every stage computes
at once), which stretches ``busy`` and shrinks the measured idle fraction. ``pp=2`` on 2
processes is run too (not with ``--quick``).

Run::

    python -m benchmarks.bench_pipeline [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMED = (
    ("gpipe", 4),
    ("gpipe", 8),
    ("1f1b", 4),
    ("1f1b", 8),
    ("interleaved", 4),
    ("interleaved", 8),
    ("zb", 4),
    ("zb", 8),
    ("zbv", 4),
    ("zbv", 8),
    ("dualpipev", 8),
)
MEMORY = (("1f1b", 4), ("1f1b", 8), ("1f1b", 16), ("gpipe", 4), ("gpipe", 8), ("gpipe", 16))
PLAIN = (
    ("gpipe", 4),
    ("gpipe", 8),
    ("1f1b", 4),
    ("1f1b", 8),
)  # also run as plain torch stages (:func:`_plain_step`; one stage a rank)


def _config(quick: bool):
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # (a worker runs this file as a script)
    from gpt import GPTConfig

    return GPTConfig(vocab=256, seq=64, dim=256, heads=4, layers=4 if quick else 8, period=8)


class _Clock:
    """Each forward ("F"), backward ("B") and loss forward ("L": the schedule calls it after every
    forward; it computes on the last stage only) this rank's stages run, ``(kind, stage,
    microbatch, start, end)``, and when the rank enters and leaves the schedule's ``step`` (while
    :func:`_timing` is active)."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, int, float, float]] = []
        self.enter = self.leave = 0.0

    def timed(self, fn: Callable, what: str) -> Callable:
        def wrapper(stage, *args, **kwargs):
            t0 = time.monotonic()
            try:
                return fn(stage, *args, **kwargs)
            finally:
                t1 = time.monotonic()
                if what == "step":
                    self.enter, self.leave = t0, t1
                else:  # (forward_one_chunk(mb, ...), backward_one_chunk(mb, ..., full_backward=), backward_weight_one_chunk(mb, ...),
                    #  _maybe_compute_loss(stage, output, targets, mb))
                    index = (args[0] if what == "L" else stage).stage_index
                    kind = "I" if what == "B" and kwargs.get("full_backward") is False else what
                    self.actions.append((kind, index, args[3] if what == "L" else args[0], t0, t1))

        return wrapper


@contextmanager
def _patched(owner: type, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextmanager
def _timing(clock: _Clock) -> Iterator[None]:
    from torch.distributed.pipelining import PipelineStage

    from vsf.pipeline.schedule import SCHEDULES

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(PipelineStage, "forward_one_chunk", lambda f: clock.timed(f, "F")))
        stack.enter_context(_patched(PipelineStage, "backward_one_chunk", lambda f: clock.timed(f, "B")))
        stack.enter_context(_patched(PipelineStage, "backward_weight_one_chunk", lambda f: clock.timed(f, "W")))
        for schedule in SCHEDULES:
            stack.enter_context(_patched(SCHEDULES[schedule], "step", lambda f: clock.timed(f, "step")))
            stack.enter_context(_patched(SCHEDULES[schedule], "_maybe_compute_loss", lambda f: clock.timed(f, "L")))
        yield


class _Saved:
    """Bytes of the tensors autograd holds for the backward right now (each storage once, params'
    storages excluded), their peak, and one microbatch's share (across the stage's first forward)."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage address -> [holders, bytes]
        self.params: set[int] = set()
        self.now = self.peak = 0
        self.per_microbatch = None

    def pack(self, t):
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        if key in self.params or local.device.type == "meta":
            return t
        entry = self.live.setdefault(key, [0, local.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Holder(self, key, t)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]

    def forward(self, fn: Callable) -> Callable:
        def wrapper(stage, chunk, *args, **kwargs):
            self.params.update(w.to_local().untyped_storage().data_ptr() for w in stage.submod.parameters())
            before = self.now
            out = fn(stage, chunk, *args, **kwargs)
            if chunk == 0:
                self.per_microbatch = self.now - before
            return out

        return wrapper


class _Holder:
    """A saved tensor as autograd keeps it; its storage leaves the count when autograd drops it."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: _Saved, key: int, tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner.release(self.key)


def _saved_bytes(step: Callable[[], None]) -> dict[str, int]:
    import torch
    from torch.distributed.pipelining import PipelineStage

    saved = _Saved()
    with _patched(PipelineStage, "forward_one_chunk", saved.forward):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda h: h.tensor if isinstance(h, _Holder) else h):
            step()
    return {"peak": saved.peak, "per_microbatch": saved.per_microbatch or 0}


def _worker(out: str, quick: bool) -> None:
    import os

    import torch
    import torch.distributed as dist

    cfg = _config(quick)
    import vsf
    from gpt import GPT, batch_at, pipeline_stages

    torch.set_num_threads(1)
    _keep_freed_memory()
    pp = int(os.environ["WORLD_SIZE"])
    mesh = vsf.make_mesh((pp,), ("pp",))
    rank = dist.get_rank()
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    repeats = 2 if quick else 5
    result: dict = {"timed": {}, "memory": {}}
    for schedule, m in dict.fromkeys(TIMED + MEMORY):
        if _stages(schedule, pp) > cfg.layers:
            continue
        fns, loss_fn, prefixes = pipeline_stages(model, _stages(schedule, pp))
        pipe = vsf.pipeline.Pipeline(
            fns, loss_fn, prefixes, mesh=mesh, microbatches=m, schedule=schedule, tied=("wte.weight",)
        )
        p, layout = pipe.place(params)
        batch = batch_at(0, (2 if quick else 4) * m, cfg)
        step = lambda: vsf.device_get(pipe.value_and_grad(p, *batch, layout=layout)[0])  # noqa: E731
        step()  # plans the stage programs
        key = f"{schedule},{m}"
        if (schedule, m) in TIMED:
            runs = {key: step}
            if (schedule, m) in PLAIN:
                runs[f"plain,{key}"] = _plain_step(
                    fns[rank],
                    loss_fn,
                    {k: v for k, v in params.items() if k.startswith(tuple(prefixes[rank]))},
                    cfg.dim,
                    schedule,
                    m,
                    batch,
                )
            for run in [*runs.values()] * 2:  # (warm: the plans made, the heap grown)
                run()
            for _ in range(
                repeats
            ):  # (each repetition of vsf's step next to one of the plain step's: the same load on both)
                for name, run in runs.items():
                    result["timed"].setdefault(name, []).append(_timed(run, pp))
        if (schedule, m) in MEMORY:
            dist.barrier()
            result["memory"][key] = _saved_bytes(step)
    gathered = [None] * pp
    dist.all_gather_object(gathered, result["memory"])
    if rank == 0:
        result["memory"] = gathered
        Path(out).write_text(json.dumps(result))


def _keep_freed_memory() -> None:
    """Have glibc's malloc keep the memory a step frees for the next step, as a caching allocator
    (CUDA's, jemalloc, tcmalloc) does. By default it hands a freed heap top back to the OS, and
    whichever schedule ran first here faulted 7,000-25,000 fresh pages back in every step (pp=2,
    1F1B, m=8: a 0.818 s span against 0.725 s for the plain stages timed beside it, and 0.748 s
    against 0.737 s with this), so the order of the configurations decided the figures."""
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(
        libc, "mallopt"
    ):  # glibc: M_TRIM_THRESHOLD never reached; M_MMAP_THRESHOLD fixed at its most (no dynamic change)
        libc.mallopt(-1, 2**31 - 1)
        libc.mallopt(-3, 32 * 2**20)


def _timed(step: Callable[[], None], pp: int) -> list:
    """One run of ``step`` with every rank's actions timed (:class:`_Clock`), gathered from all
    ranks: ``[(actions, entered step, left step, whole call)]`` by rank."""
    import torch.distributed as dist

    clock = _Clock()
    dist.barrier()
    t0 = time.monotonic()
    with _timing(clock):
        step()
    whole = time.monotonic() - t0
    gathered = [None] * pp
    dist.all_gather_object(gathered, (clock.actions, clock.enter, clock.leave, whole))
    return gathered


def _plain_step(
    fn: Callable, loss_fn: Callable, params: dict, dim: int, schedule: str, m: int, batch: tuple
) -> Callable[[], None]:
    """What a user would write without vsf: this rank's stage function over plain tensors (its own
    copy of the stage's params: the last stage's output layer is not tied to the first stage's
    embedding) in an ``nn.Module``, on torch's ``PipelineStage`` and the same schedule class,
    over the world group (``dim``: the activations' width); a call runs one step (the gradients
    accumulate, as vsf's do)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from vsf.pipeline.schedule import SCHEDULES

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.names = list(params)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(v.detach().clone()) for v in params.values())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(dict(zip(self.names, self.weights)), x)

    rank, pp = dist.get_rank(), dist.get_world_size()
    idx, targets = batch
    one = idx.shape[0] // m
    x = (
        idx[:one] if rank == 0 else torch.zeros(one, idx.shape[1], dim, requires_grad=True)
    )  # (the shapes it receives and sends)
    with torch.no_grad():
        example_out = torch.empty_like(fn(dict(params), x)).requires_grad_(True)
    stage = PipelineStage(
        Stage(), rank, pp, torch.device("cpu"), input_args=(x,), output_args=example_out, group=dist.group.WORLD
    )
    runner = SCHEDULES[schedule](stage, m, loss_fn=loss_fn, scale_grads=False)
    if rank == 0:
        return lambda: runner.step(idx)
    if rank == pp - 1:
        return lambda: runner.step(target=targets, losses=[])
    return lambda: runner.step()


def _stages(schedule: str, pp: int) -> int:
    """The stages a schedule cuts the model into on ``pp`` ranks: two a rank for the interleaved and V-shaped ones."""
    from vsf.pipeline import INTERLEAVED

    return 2 * pp if schedule in INTERLEAVED else pp


def _idle(rows: list[list]) -> tuple[list[float], list[float], list[float], float, float]:
    """Each stage's median idle fraction of the schedule's span, the median part of it that is
    not waiting for an input, and its median idle fraction replayed from the measured compute
    times alone (:func:`_replayed`), the median span, and the median whole step (slowest rank)."""
    fractions, excess, replayed, spans, wholes = [], [], [], [], []
    for ranks in rows:
        span = max(r[2] for r in ranks) - min(r[1] for r in ranks)
        spans.append(span)
        wholes.append(max(r[3] for r in ranks))
        fractions.append([1 - sum(t1 - t0 for *_, t0, t1 in r[0]) / span for r in ranks])
        excess.append([_not_waiting(ranks, s) / span for s in range(len(ranks))])
        replayed.append(_replayed(ranks))
    med = lambda xs: [statistics.median(x[s] for x in xs) for s in range(len(rows[0]))]  # noqa: E731
    return med(fractions), med(excess), med(replayed), statistics.median(spans), statistics.median(wholes)


def _replayed(ranks: list) -> list[float]:
    """Each stage's idle fraction if every action took the time it was measured to take (the last
    stage's loss forward counted with its forward) and started as soon as its stage and its input
    were free: the bubble of these stages' real, unequal compute times, without the sends, the
    receives, waking the process or the schedule's bookkeeping (:func:`vsf.pipeline.bubble`)."""
    from vsf.pipeline import bubble

    durations: dict[tuple[int, str, int], float] = {}
    for r in ranks:
        for kind, stage, mb, t0, t1 in r[0]:
            key = (stage, "F" if kind == "L" else kind, mb)
            durations[key] = durations.get(key, 0.0) + t1 - t0
    return bubble(
        [[(stage, kind, mb) for kind, stage, mb, _, _ in r[0] if kind != "L"] for r in ranks], durations=durations
    )


def _not_waiting(ranks: list, s: int) -> float:
    """Rank ``s``'s time, between its step's start and its last action, with the rank free and
    the input of its next action there but that action not started (the sends, the receive's
    copy, waking the process, the schedule's bookkeeping): idle time that is not the bubble."""
    ends = {
        (stage, "B" if kind == "I" else kind, mb): t1 for r in ranks for kind, stage, mb, _, t1 in r[0]
    }  # (an input part hands on what a backward does)
    waits_for = {"F": lambda st, mb: (st - 1, "F", mb), "W": lambda st, mb: (st, "B", mb)}
    free, total = ranks[s][1], 0.0
    for kind, stage, mb, t0, t1 in ranks[s][0]:
        need = free if kind == "L" else ends.get(waits_for.get(kind, lambda st, mb: (st + 1, "B", mb))(stage, mb), free)
        total += max(0.0, t0 - max(free, need))
        free = t1
    return total


def bench(pp: int, quick: bool) -> list[dict]:
    from vsf import launch
    from vsf.pipeline import bubble, rank_actions, stage_actions
    from vsf.pipeline.lower import in_flight

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "pipeline.json")
        launch.run(Path(__file__).resolve(), pp, "--worker", out, *(["--quick"] if quick else []), timeout=1800)
        r = json.loads(Path(out).read_text())
    where = f"pp={pp}, {pp} gloo procs{' on 2 shared cores (oversubscribed)' if pp > 2 else ''}"
    rows, spans = [], {}
    for schedule, m in TIMED:
        if f"{schedule},{m}" not in r["timed"]:
            continue
        idle, excess, replayed, span, whole = _idle(r["timed"][f"{schedule},{m}"])
        spans[schedule, m] = span
        theory = bubble(rank_actions(schedule, pp, _stages(schedule, pp), m))
        ratios = [a / b for a, b in zip(idle, theory)]
        per_stage = "/".join(f"{x:.2f}" for x in idle)
        rows.append(
            {
                "name": f"idle fraction per stage (stages 0-{pp - 1}: {per_stage}; ratios {'/'.join(f'{x:.2f}' for x in ratios)}), {schedule.upper()}, m={m}, {where}",
                "vsf": statistics.mean(idle),
                "ref": statistics.mean(theory),
                "unit": "%",
                "ratio": statistics.mean(ratios),
                "target": "0.9-1.1 every stage",
                "met": all(0.9 <= x <= 1.1 for x in ratios),
            }
        )
        rows.append(
            {
                "name": f"idle fraction replayed from the measured compute times, no sends or bookkeeping (stages 0-{pp - 1}: {'/'.join(f'{x:.2f}' for x in replayed)}), {schedule.upper()}, m={m}, {where}",
                "vsf": statistics.mean(replayed),
                "ref": statistics.mean(theory),
                "unit": "%",
                "ratio": statistics.mean(replayed) / statistics.mean(theory),
                "target": "-",
                "met": None,
            }
        )
        rows.append(
            {
                "name": f"of the idle fraction, the part with the input there (stages 0-{pp - 1}: {'/'.join(f'{x:.2f}' for x in excess)}), {schedule.upper()}, m={m}, {where}",
                "vsf": statistics.mean(excess),
                "ref": statistics.mean(idle),
                "unit": "%",
                "ratio": statistics.mean(excess) / statistics.mean(idle),
                "target": "-",
                "met": None,
            }
        )
        rows.append(
            {
                "name": f"pipelined step (value_and_grad) vs the schedule's span, {schedule.upper()}, m={m}, {where}",
                "vsf": whole,
                "ref": span,
                "unit": "s",
                "ratio": whole / span,
                "target": "-",
                "met": None,
            }
        )
        if f"plain,{schedule},{m}" in r["timed"]:
            plain_idle, _, _, plain_span, _ = _idle(r["timed"][f"plain,{schedule},{m}"])
            versus = f"vs torch's own pipelining of the same stage functions on plain tensors, {schedule.upper()}, m={m}, {where}"
            rows.append(
                {
                    "name": f"idle fraction (plain torch, stages 0-{pp - 1}: {'/'.join(f'{x:.2f}' for x in plain_idle)}) {versus}",
                    "vsf": statistics.mean(idle),
                    "ref": statistics.mean(plain_idle),
                    "unit": "%",
                    "ratio": statistics.mean(idle) / statistics.mean(plain_idle),
                    "target": "<= 1.1",
                    "met": statistics.mean(idle) <= 1.1 * statistics.mean(plain_idle),
                }
            )
            rows.append(
                {
                    "name": f"plain torch's idle fraction vs the theory (what torch's schedule over gloo reaches here; ratios {'/'.join(f'{a / b:.2f}' for a, b in zip(plain_idle, theory))}), {schedule.upper()}, m={m}, {where}",
                    "vsf": statistics.mean(plain_idle),
                    "ref": statistics.mean(theory),
                    "unit": "%",
                    "ratio": statistics.mean(plain_idle) / statistics.mean(theory),
                    "target": "-",
                    "met": None,
                }
            )
            rows.append(
                {
                    "name": f"the schedule's span {versus}",
                    "vsf": span,
                    "ref": plain_span,
                    "unit": "s",
                    "ratio": span / plain_span,
                    "target": "-",
                    "met": None,
                }
            )
        if (
            _stages(schedule, pp) > pp and ("1f1b", m) in spans
        ):  # (the same work a rank: the span is the busy time over 1 - idle)
            theory = (1 - bubble(rank_actions("1f1b", pp, pp, m))[0]) / (
                1 - statistics.mean(bubble(rank_actions(schedule, pp, _stages(schedule, pp), m)))
            )
            rows.append(
                {
                    "name": f"{schedule.upper()}'s span (2 stages a rank) vs 1F1B's, m={m}, {where}",
                    "vsf": span,
                    "ref": spans["1f1b", m],
                    "unit": "s",
                    "ratio": span / spans["1f1b", m],
                    "target": f"- (theory {theory:.3f} with equal work)",
                    "met": None,
                }
            )
    mem = r["memory"]
    for schedule, m in MEMORY:
        actions = stage_actions(schedule, pp, m)
        peaks = [mem[s][f"{schedule},{m}"]["peak"] for s in range(pp)]
        theory = [in_flight(actions[s]) * mem[s][f"{schedule},{m}"]["per_microbatch"] for s in range(pp)]
        per_stage = "/".join(f"{x / 2**20:.1f}" for x in peaks)
        rows.append(
            {
                "name": f"peak saved activations, stage 0 (stages 0-{pp - 1}: {per_stage} MiB) vs in-flight x one microbatch's, {schedule.upper()}, m={m}, {where}",
                "vsf": peaks[0],
                "ref": theory[0],
                "unit": "B",
                "ratio": peaks[0] / theory[0],
                "target": "1.0",
                "met": abs(peaks[0] / theory[0] - 1) < 0.05,
            }
        )
    for schedule in ("1f1b", "gpipe"):
        low, high = (mem[0][f"{schedule},{m}"]["peak"] for m in (4, 16))
        flat = schedule == "1f1b"
        rows.append(
            {
                "name": f"peak saved activations, stage 0, m=16 vs m=4, {schedule.upper()}, {where}",
                "vsf": high,
                "ref": low,
                "unit": "B",
                "ratio": high / low,
                "target": "1.0 (flat in m)" if flat else "- (grows with m: 4.0)",
                "met": abs(high / low - 1) < 0.05 if flat else None,
            }
        )
    return rows


def run(quick: bool) -> list[dict]:
    """All measurements as rows of the suite's table (see ``benchmarks``): pp=4, then (not with
    ``quick``) pp=2."""
    return bench(4, quick) + ([] if quick else bench(2, quick))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer repetitions")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        _worker(ns.worker, ns.quick)
        return
    for row in run(ns.quick):
        print(
            f"{row['name']:<84} vsf {row['vsf']:>14.6g}  ref {row['ref']:>14.6g}  ratio {row['ratio']:6.3f}  (target {row['target']})"
        )


if __name__ == "__main__":
    main()
