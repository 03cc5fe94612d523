"""Pipeline schedules: the order of each stage's forward and backward microbatches, and the
in-order runner that plays them in one process.

On real processes the schedules are ``torch.distributed.pipelining``'s (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``); :data:`SCHEDULES` names them. GPipe and 1F1B
run one stage per ``pp`` rank; the interleaved schedules run ``v >= 2`` stages per rank (virtual
stages: stage ``s`` on rank ``s % p``, Megatron's layout), which cuts the bubble by about ``v``;
the V-shaped ones (ZB-V, DeepSeek's DualPipe-V) run two, stages ``s`` and ``2p - 1 - s`` on rank
``s`` (:func:`stage_rank`). The zero-bubble schedules (:data:`DEFERRED`) run a backward's input
part (``"I"``) and its weight part (``"W"``) apart, the weight parts filling the bubble.
Under ``vsf.simulate`` one process holds every stage, and :func:`run_in_order` plays each rank's
actions in the order that schedule gives them (:func:`rank_actions`, the same order as torch's
own runtime), running an action as soon as what it needs is there: a forward needs the previous
stage's output for that microbatch, a backward the next stage's input gradient. So a stage keeps
at most as many activations alive as the schedule allows (1F1B: at most ``p - s``).

Example::

    >>> stage_actions("1f1b", stages=2, microbatches=3)[0]
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> rank_actions("interleaved", ranks=2, stages=4, microbatches=2)[1][:3]
    [(1, 'F', 0), (1, 'F', 1), (3, 'F', 0)]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, get_args

from vsf import _compat

__all__ = [
    "DEFERRED",
    "INTERLEAVED",
    "SCHEDULES",
    "V_SHAPED",
    "Action",
    "ScheduleName",
    "Step",
    "bubble",
    "check_stages",
    "rank_actions",
    "run_in_order",
    "stage_actions",
    "stage_rank",
]


ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"]


class _Schedules(Mapping):
    """``{name: torch.distributed.pipelining schedule class}``, importing torch's pipelining (and
    with it torch._dynamo, about 0.6 s of every process's start) only when a class is looked up."""

    _CLASSES = dict(
        zip(
            get_args(ScheduleName),
            (
                "ScheduleGPipe",
                "Schedule1F1B",
                "ScheduleInterleaved1F1B",
                "ScheduleInterleavedZeroBubble",
                "ScheduleZBVZeroBubble",
                "ScheduleDualPipeV",
            ),
        )
    )

    def __getitem__(self, name: str) -> type:
        return getattr(importlib.import_module("torch.distributed.pipelining"), self._CLASSES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._CLASSES)

    def __len__(self) -> int:
        return len(self._CLASSES)

    def __repr__(self) -> str:
        return f"SCHEDULES({', '.join(f'{k}={v}' for k, v in self._CLASSES.items())})"


SCHEDULES = _Schedules()
Action = tuple[str, int]  # ("F" | "B", microbatch)
Step = tuple[
    int, str, int
]  # (stage, "F" | "B" | "I" | "W", microbatch): a forward, a backward, or its input and weight parts
INTERLEAVED = ("interleaved", "zb", "zbv", "dualpipev")  # the schedules running several stages on a rank
V_SHAPED = ("zbv", "dualpipev")  # two stages a rank, stage s and 2p - 1 - s on rank s
DEFERRED = ("zb", "zbv", "dualpipev")  # the schedules running a backward's weight part apart ("I", then "W")


def stage_rank(schedule: ScheduleName, stage: int, ranks: int) -> int:
    """The pp rank running ``stage`` under ``schedule``: stage ``s`` on rank ``s % ranks`` (one
    stage a rank, or Megatron's interleaved loop), and for the V-shaped schedules stage ``s`` and
    stage ``2 ranks - 1 - s`` on rank ``s`` (the first and last stages on rank 0).

    Example::

        >>> [stage_rank("zbv", s, 2) for s in range(4)], [stage_rank("interleaved", s, 2) for s in range(4)]
        ([0, 1, 1, 0], [0, 1, 0, 1])
    """
    return min(stage, 2 * ranks - 1 - stage) if schedule in V_SHAPED else stage % ranks


def check_schedule(name: str) -> ScheduleName:
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    return key


def check_stages(schedule: ScheduleName, stages: int, ranks: int, microbatches: int, axis: str = "pp") -> int:
    """The number of stages each of the ``ranks`` ranks of the pipeline axis runs under
    ``schedule``, after checking that ``stages`` and ``microbatches`` fit it (errors say what the
    schedule needs)."""
    if schedule not in INTERLEAVED:
        if stages != ranks:
            raise ValueError(
                f"the mesh's {axis} axis has size {ranks} but the pipeline has {stages} stages; they must be equal ({schedule} runs one stage per {axis} rank)"
            )
        return 1
    if schedule in V_SHAPED and stages != 2 * ranks:
        raise ValueError(
            f"the {schedule} schedule runs two stages on each of the {ranks} {axis} ranks (stages s and {2 * ranks - 1} - s on rank s): give {2 * ranks} stages; got {stages}"
        )
    if schedule == "dualpipev" and microbatches < stages:
        raise ValueError(
            f"torch's ScheduleDualPipeV needs at least as many microbatches as stages ({stages}); got {microbatches}"
        )
    if stages % ranks or stages < 2 * ranks:
        raise ValueError(
            f"the {schedule} schedule runs 2 or more stages on each of the {ranks} {axis} ranks: give a multiple of {ranks} stages, at least {2 * ranks}; got {stages}"
        )
    rounds = max(1, microbatches // ranks)
    if schedule not in V_SHAPED and microbatches % rounds:
        raise ValueError(
            f"torch's {SCHEDULES._CLASSES[schedule]} needs the microbatches to be a multiple of its rounds (max(1, m // p) = {rounds}); got {microbatches}"
        )
    return stages // ranks


def rank_actions(schedule: ScheduleName, ranks: int, stages: int, microbatches: int) -> list[list[Step]]:
    """Each pp rank's forwards and backwards as ``(stage, "F" | "B", microbatch)``, in the order it
    runs them: :func:`stage_actions` for GPipe and 1F1B (stage ``s`` on rank ``s``), torch's own
    order for the others (each stage on its :func:`stage_rank`; a zero-bubble one splits a
    backward into its input part ``"I"``, which the previous stage waits for, and its weight part
    ``"W"``, run later to fill the bubble; DualPipe-V's overlapped forward-and-backward pairs are
    its two actions, in its order)."""
    schedule = check_schedule(schedule)
    if schedule in INTERLEAVED:
        return _compat.interleaved_order(
            SCHEDULES[schedule], check_stages(schedule, stages, ranks, microbatches), ranks, microbatches
        )
    check_stages(schedule, stages, ranks, microbatches)
    return [
        [(s, kind, mb) for kind, mb in acts] for s, acts in enumerate(stage_actions(schedule, stages, microbatches))
    ]


def stage_actions(schedule: ScheduleName, stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's forwards ("F") and backwards ("B") by microbatch, in the order it runs them.

    GPipe: every forward, then every backward. 1F1B (torch's ``Schedule1F1B``): stage ``s`` runs
    ``min(m, p - s)`` forwards, then alternates one backward and one forward, then the remaining
    backwards.
    """
    schedule = check_schedule(schedule)
    if schedule in INTERLEAVED:
        raise ValueError(f"the {schedule} schedule runs several stages on a rank: read its order with rank_actions")
    m = microbatches
    out = []
    for s in range(stages):
        if schedule == "gpipe":
            out.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(m, stages - s)
        acts: list[Action] = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [("B", i), ("F", warm + i)]
        acts += [("B", i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def run_in_order(actions: list[list[Step]], run: Callable[[int, str, int], None]) -> list[Step]:
    """Play every rank's ``actions`` (:func:`rank_actions`) in one process: repeatedly, for each
    rank in turn, run its next action if its input is ready (``run(stage, kind, microbatch)``).
    Returns the global order the actions ran in; an order that can never finish is a
    ``RuntimeError``."""
    last = max(st for acts in actions for st, _, _ in acts)
    done: set[Step] = set()
    nxt = [0] * len(actions)
    order = []
    while any(nxt[r] < len(acts) for r, acts in enumerate(actions)):
        progressed = False
        for r, acts in enumerate(actions):
            if nxt[r] == len(acts):
                continue
            s, kind, mb = acts[nxt[r]]
            need = _input_of((s, kind, mb), last)
            if need is None or need in done:
                run(s, kind, mb)
                done.add(_done_as((s, kind, mb)))
                order.append((s, kind, mb))
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: acts[nxt[r]] for r, acts in enumerate(actions) if nxt[r] < len(acts)}
            raise RuntimeError(f"pipeline schedule cannot progress: each rank's next action {stuck} waits for another")
    return order


def _input_of(step: Step, last: int) -> Step | None:
    """The action whose result ``step`` waits for (as :func:`_done_as` records it), ``None`` if it
    waits for none: a forward for the previous stage's, a backward (or its input part) for the
    next stage's input gradient (the last stage: for its own forward), a weight part for its
    input part."""
    s, kind, mb = step
    if kind == "F":
        return None if s == 0 else (s - 1, "F", mb)
    if kind == "W":
        return (s, "B", mb)
    return (s + 1, "B", mb) if s < last else (s, "F", mb)


def _done_as(step: Step) -> Step:
    """What ``step`` hands on: a backward's input part the input gradient, as a backward does."""
    s, kind, mb = step
    return (s, "B" if kind == "I" else kind, mb)


def bubble(
    actions: list[list[Step]],
    forward: float = 1.0,
    backward: float = 2.0,
    durations: Mapping[Step, float] | None = None,
) -> list[float]:
    """Each rank's idle fraction of the step when a forward takes ``forward`` and a backward
    ``backward`` time units (its input and weight parts half of it each; on every stage; or each
    action its own ``durations[action]``, e.g. measured ones) and an action starts as soon as its
    rank and its input are free; ``actions`` as :func:`rank_actions` gives them. The schedule's
    theory: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` for the
    interleaved schedule, and for the zero-bubble one ZB-H1's ``(p - 1)(F + B - 2W)`` idle in
    ``v m (F + B)`` of work (``W``: a weight part's time).

    Example::

        >>> bubble(rank_actions("1f1b", 4, 4, 8), 1.0, 1.0)   # (p - 1) / (m + p - 1) = 3 / 11
        [0.2727..., 0.2727..., 0.2727..., 0.2727...]
    """
    last = max(st for acts in actions for st, _, _ in acts)
    end: dict[Step, float] = {}
    free = [0.0] * len(actions)
    pending = [list(a) for a in actions]
    cost = lambda step: (
        durations[step] if durations is not None else {"F": forward, "B": backward}.get(step[1], backward / 2)
    )  # noqa: E731
    while any(pending):
        progressed = False
        for r, acts in enumerate(pending):
            while acts:
                s, kind, mb = acts[0]
                need = _input_of((s, kind, mb), last)
                if need is not None and need not in end:
                    break
                start = max(free[r], end[need] if need is not None else 0.0)
                end[_done_as((s, kind, mb))] = free[r] = start + cost((s, kind, mb))
                acts.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule cannot progress")
    span = max(free)
    return [1 - sum(cost(a) for a in acts) / span for acts in actions]
