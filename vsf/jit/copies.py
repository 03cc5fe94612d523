"""The runs of ops that copies of a model's repeated blocks made, and the greedy placements the
per-axis solver takes for one run copied to the runs like it.

A stamped block (:mod:`vsf.jit.stamp`) copies its trace's forward ops into the step's graph at each
call, and its backward ops when autograd reaches it; each copied node carries :data:`COPY`, the
name of the first node of its copy. :func:`runs_of` finds the runs of consecutive ops of one copy in
a problem's ops and numbers each run's *shape*: per op in order, which of the run's values (in the
order its ops first read or write them) it reads and writes, and each value's cap on counted reads
(:attr:`vsf.jit.solver.Problem.clamp`). Equal numbers, equal wiring.

The solver's greedy pass decides each op from its context alone (its fixed part, and the
placements and wants of the values it reads and writes: :meth:`vsf.jit.solver.AxisSolver._context`)
and changes only the wants of its inputs and the placements of its outputs. So a run of one shape
whose ops have the fixed contexts and whose values the placements and wants that an earlier run
had when the pass reached it meets, op after op, the contexts that one met, and takes the same
strategies: :class:`Placed` holds what the first took and what that did to its values (their
wants, their placements, and the reads counted, in order), and the solver copies it to the others
(:meth:`vsf.jit.solver.AxisSolver._greedy`), the state it leaves the one op-by-op placing leaves.

Example::

    >>> found = runs_of(problem.ops, problem.op_ins, problem.op_outs, problem.clamp)
    >>> sorted({r.shape for r in found.values()})   # a GPT's block: its forward run and its backward run
    [0, 1]
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx

__all__ = ["COPY", "MIN_OPS", "Merged", "Placed", "Reach", "Run", "runs_of"]

# the node metadata key naming the copy a stamped block's node belongs to
COPY = "vsf_copy"

# the fewest ops a run needs to be copied as one (a shorter one costs about as much to key as to place)
MIN_OPS = 8


@dataclasses.dataclass(frozen=True)
class Run:
    """Ops ``start`` to ``stop`` (exclusive) of a problem, one copy's consecutive ops; ``values``:
    the values they read and write, in the order first met; ``reads``: per op, the positions in
    ``values`` of its inputs; ``shape``: the number of its wiring (:func:`runs_of`); ``of``: what
    reads the values' entries of a per-value list, as a tuple in their order."""

    start: int
    stop: int
    shape: int
    values: tuple[int, ...]
    reads: tuple[tuple[int, ...], ...]
    of: Callable[[Sequence[Any]], tuple[Any, ...]]
    visits: list[int]  # its ops as a solver's work list holds them to visit in turn (the first last)
    reach: "Reach"  # its ops and their producers some hops up (the partial-sum merges of its ops read them)


@dataclasses.dataclass(frozen=True)
class Reach:
    """The ops a run's partial-sum merges read (its own and their producers up to some hops up),
    in graph order, with the values they read and write (in the order first met), the number of
    their wiring (``shape``), and what reads their entries of a per-op and a per-value list."""

    ops: tuple[int, ...]
    values: tuple[int, ...]
    shape: int
    ops_of: Callable[[Sequence[Any]], tuple[Any, ...]]
    values_of: Callable[[Sequence[Any]], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Merged:
    """What the partial-sum merges of a run did where they kept no move: per value of its reach,
    the placements its wants counted none of that the moves tried left in them (with a count of
    0, in order), and each value's wants after."""

    left: tuple[tuple[int, tuple[int, ...]], ...]
    wants: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Placed:
    """What the greedy pass did on a run: the strategy each op took, the reads it counted (value
    position, placement), in order, and each value's wants and placement after."""

    choices: tuple[int, ...]
    counted: tuple[tuple[int, int], ...]
    wants: tuple[int, ...]
    labels: tuple[int, ...]


def runs_of(
    ops: Sequence[torch.fx.Node],
    op_ins: Sequence[tuple[int, ...]],
    op_outs: Sequence[tuple[int, ...]],
    clamp: Sequence[int],
    producer_of: Mapping[int, int],
    hops: int,
) -> dict[int, Run]:
    """The runs of at least :data:`MIN_OPS` consecutive ``ops`` of one copy (:data:`COPY`), by
    first op, each with its shape numbered (equal wiring and caps: equal numbers), and its reach:
    its ops and their producers up to ``hops`` up."""
    shapes: dict[Any, int] = {}
    found: dict[int, Run] = {}
    start = 0
    while start < len(ops):
        copy = ops[start].meta.get(COPY)
        stop = start + 1
        while stop < len(ops) and copy is not None and ops[stop].meta.get(COPY) == copy:
            stop += 1
        if copy is not None and stop - start >= MIN_OPS:
            reach = _producers(range(start, stop), op_ins, producer_of, hops)
            run = _run(
                start,
                stop,
                _wiring(range(start, stop), op_ins, op_outs, clamp, shapes),
                (reach, _wiring(reach, op_ins, op_outs, clamp, shapes)),
            )
            if len(run.values) > 1:  # (an itemgetter of one gives no tuple)
                found[start] = run
        start = stop
    return found


def _producers(ops: range, op_ins: Sequence[tuple[int, ...]], producer_of: Mapping[int, int], hops: int) -> list[int]:
    """``ops`` and the ops that produce their inputs, and theirs, ``hops`` up, in graph order."""
    found, frontier = set(ops), list(ops)
    for _hop in range(hops):
        frontier = [p for k in frontier for v in op_ins[k] if (p := producer_of.get(v)) is not None and p not in found]
        found.update(frontier)
    return sorted(found)


def _wiring(
    ops: Sequence[int],
    op_ins: Sequence[tuple[int, ...]],
    op_outs: Sequence[tuple[int, ...]],
    clamp: Sequence[int],
    shapes: dict[Any, int],
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], int]:
    """The values ``ops`` read and write, in the order first met; per op, the positions of its
    inputs among them; and the number of the wiring (per op, the positions of its inputs and
    outputs) and the values' caps in ``shapes``."""
    position: dict[int, int] = {}
    wiring = []
    for k in ops:
        ins = tuple([position.setdefault(v, len(position)) for v in op_ins[k]])
        outs = tuple([-1 if v < 0 else position.setdefault(v, len(position)) for v in op_outs[k]])
        wiring.append((ins, outs))
    values = tuple(position)
    shape = shapes.setdefault((tuple(wiring), tuple([clamp[v] for v in values])), len(shapes))
    return values, tuple([ins for ins, _ in wiring]), shape


def _run(
    start: int,
    stop: int,
    wired: tuple[tuple[int, ...], tuple[tuple[int, ...], ...], int],
    reach: tuple[list[int], tuple[tuple[int, ...], tuple[tuple[int, ...], ...], int]],
) -> Run:
    values, reads, shape = wired
    ops, (reached, _, reach_shape) = reach
    return Run(
        start,
        stop,
        shape,
        values,
        reads,
        operator.itemgetter(*values),
        list(range(stop - 1, start - 1, -1)),
        Reach(tuple(ops), reached, reach_shape, operator.itemgetter(*ops), operator.itemgetter(*reached)),
    )
