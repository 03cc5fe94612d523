"""Pipeline schedules: the order of each stage's forward and backward microbatches, and the
in-order runner that plays them in one process.

On real processes the schedules are ``torch.distributed.pipelining``'s (``ScheduleGPipe``,
``Schedule1F1B``); :data:`SCHEDULES` names them. Under ``vsf.simulate`` one process holds every
stage, and :func:`run_in_order` plays each stage's actions in the order that schedule gives them
(:func:`stage_actions`, the same order as torch's own runtime), running an action as soon as what
it needs is there: a forward needs the previous stage's output for that microbatch, a backward
the next stage's input gradient. So a stage keeps at most as many activations alive as the
schedule allows (1F1B: at most ``p - s``).

Example::

    >>> stage_actions("1f1b", stages=2, microbatches=3)[0]
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

__all__ = ["SCHEDULES", "Action", "bubble", "run_in_order", "stage_actions"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
Action = tuple[str, int]   # ("F" | "B", microbatch)


def check_schedule(name: str) -> str:
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    return key


def stage_actions(schedule: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's forwards ("F") and backwards ("B") by microbatch, in the order it runs them.

    GPipe: every forward, then every backward. 1F1B (torch's ``Schedule1F1B``): stage ``s`` runs
    ``min(m, p - s)`` forwards, then alternates one backward and one forward, then the remaining
    backwards.
    """
    schedule = check_schedule(schedule)
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


def run_in_order(actions: list[list[Action]], run: Callable[[int, str, int], None]) -> list[tuple[int, str, int]]:
    """Play every stage's ``actions`` in one process: repeatedly, for each stage in turn, run its
    next action if its inputs are ready (``run(stage, kind, microbatch)``). Returns the global
    order the actions ran in; an order that can never finish is a ``RuntimeError``."""
    p = len(actions)
    done: set[tuple[int, str, int]] = set()
    nxt = [0] * p
    order = []
    while any(nxt[s] < len(actions[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] == len(actions[s]):
                continue
            kind, mb = actions[s][nxt[s]]
            need = (s - 1, "F", mb) if kind == "F" else ((s + 1, "B", mb) if s + 1 < p else (s, "F", mb))
            if kind == "F" and s == 0 or need in done:
                run(s, kind, mb)
                done.add((s, kind, mb))
                order.append((s, kind, mb))
                nxt[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: actions[s][nxt[s]] for s in range(p) if nxt[s] < len(actions[s])}
            raise RuntimeError(f"pipeline schedule cannot progress: each stage's next action {stuck} waits for another")
    return order


def bubble(actions: list[list[Action]], forward: float = 1.0, backward: float = 2.0) -> list[float]:
    """Each stage's idle fraction of the step when a forward takes ``forward`` and a backward
    ``backward`` time units and an action starts as soon as its stage and its input are free (the
    schedule's theory: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B)."""
    p = len(actions)
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * p
    pending = [list(a) for a in actions]
    while any(pending):
        for s in range(p):
            while pending[s]:
                kind, mb = pending[s][0]
                need = (s - 1, "F", mb) if kind == "F" else ((s + 1, "B", mb) if s + 1 < p else (s, "F", mb))
                if not (kind == "F" and s == 0) and need not in end:
                    break
                start = max(free[s], end.get(need, 0.0) if not (kind == "F" and s == 0) else 0.0)
                end[(s, kind, mb)] = free[s] = start + (forward if kind == "F" else backward)
                pending[s].pop(0)
    span = max(free)
    busy = [sum(forward if k == "F" else backward for k, _ in a) for a in actions]
    return [1 - b / span for b in busy]
