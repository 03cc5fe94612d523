"""The runs of ops that copies of a model's repeated blocks made, for the per-axis solver to place
one run and copy what it did to the runs like it.

A stamped block (:mod:`vsf.jit.stamp`) copies its trace's forward ops into the step's graph at each
call, and its backward ops when autograd reaches it; each copied node carries :data:`COPY`, the
name of the first node of its copy. :func:`runs_of` finds the runs of consecutive ops of one copy in
a problem's ops, each as a :class:`Region` whose *shape* numbers its wiring: per op in order, which
of the region's values (in the order its ops first read or write them) it reads and writes, and
per value its cap on counted reads (:attr:`vsf.jit.solver.Problem.clamp`), how many ops read it and
whether one writes it. Equal numbers, equal wiring.

The solver decides each op from its context alone (its fixed part, its choice, and the placements
and wants of the values it reads and writes: :meth:`vsf.jit.solver.AxisSolver._context`), and a
choice changes only the wants of the op's inputs and the placements of its outputs. So a run whose
ops have the fixed contexts, and whose values the placements and wants, that a run of its shape had
when a pass reached it, meets op after op the contexts that one met, and the pass does to it what
it did to that one:

* the greedy pass takes the same strategies: :class:`Placed` holds them and what they did to the
  run's values (the reads counted, in order; their wants and placements), copied to the others
  (:meth:`vsf.jit.solver.AxisSolver._greedy`);
* the repairs, where they changed nothing of that run, change nothing of this one
  (:meth:`vsf.jit.solver.AxisSolver._repairs`);
* the partial-sum merges, which read a run's ops and their producers some hops up (its
  ``reach``), keep no move where they kept none in a reach of that shape and state, and leave it
  as they left that one (:class:`Left`: the placements their tries counted and took back, and
  the wants; :meth:`vsf.jit.solver.AxisSolver._merges`).

Each leaves the state placing op by op leaves (``tests/jit/test_plan_time.py``).

Example::

    >>> found = runs_of(Graph(ops, op_ins, op_outs, clamp, producer_of, consumers_of), hops=3)
    >>> len(found), len({r.own.shape for r in found.values()})  # a 24-layer GPT: each block's forward and backward
    (48, 3)
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx

__all__ = ["COPY", "MIN_OPS", "Graph", "Left", "Placed", "Region", "Run", "runs_of"]

# the node metadata key naming the copy a stamped block's node belongs to
COPY = "vsf_copy"

# the fewest ops a run needs to be copied as one (a shorter one costs about as much to key as to place)
MIN_OPS = 8


@dataclasses.dataclass(frozen=True)
class Region:
    """Some ops of a problem, in graph order, and the values they read and write, in the order
    first met (``position``: each one's place among them); ``shape``: the number of their wiring
    (per op, the positions of its inputs and outputs; per value, its cap on counted reads, how
    many ops read it and whether an op writes it: equal numbers, equal wiring); ``ops_of`` and
    ``values_of``: what reads their entries of a per-op and a per-value list, as tuples."""

    ops: tuple[int, ...]
    values: tuple[int, ...]
    position: dict[int, int]
    shape: int
    ops_of: Callable[[Sequence[Any]], tuple[Any, ...]]
    values_of: Callable[[Sequence[Any]], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Run:
    """Ops ``start`` to ``stop`` (exclusive) of a problem, one copy's consecutive ops (``own``);
    ``reads``: per op, the positions of its inputs among ``own``'s values; ``visits``: its ops as
    a solver's work list holds them to visit in turn (the first last); ``reach``: its ops and
    their producers some hops up (what the partial-sum merges of its ops read)."""

    start: int
    stop: int
    own: Region
    reads: tuple[tuple[int, ...], ...]
    visits: list[int]
    reach: Region


@dataclasses.dataclass(frozen=True)
class Placed:
    """What the greedy pass did on a run: the strategy each op took, the reads it counted (value
    position, placement), in order, and each value's wants and placement after."""

    choices: tuple[int, ...]
    counted: tuple[tuple[int, int], ...]
    wants: tuple[int, ...]
    labels: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Left:
    """What moves tried and taken back left in a region: per value (its position), the placements
    they counted of it that its wants had not (each now with a count of 0, in order), and every
    value's wants after."""

    zeros: tuple[tuple[int, tuple[int, ...]], ...]
    wants: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Graph:
    """The facts about a problem's ops and values the runs are found from."""

    ops: Sequence[torch.fx.Node]
    op_ins: Sequence[tuple[int, ...]]
    op_outs: Sequence[tuple[int, ...]]
    clamp: Sequence[int]
    producer_of: Mapping[int, int]
    consumers_of: Mapping[int, list[int]]


def runs_of(graph: Graph, hops: int) -> dict[int, Run]:
    """The runs of at least :data:`MIN_OPS` consecutive ops of one copy (:data:`COPY`), by first
    op, each with its reach (its ops and their producers ``hops`` up)."""
    shapes: dict[Any, int] = {}
    found: dict[int, Run] = {}
    ops, start = graph.ops, 0
    while start < len(ops):
        copy = ops[start].meta.get(COPY)
        stop = start + 1
        while stop < len(ops) and copy is not None and ops[stop].meta.get(COPY) == copy:
            stop += 1
        if copy is not None and stop - start >= MIN_OPS:
            own = _region(range(start, stop), graph, shapes)
            if len(own.values) > 1:  # (an itemgetter of one gives no tuple)
                found[start] = Run(
                    start,
                    stop,
                    own,
                    tuple([tuple([own.position[v] for v in graph.op_ins[k]]) for k in own.ops]),
                    list(range(stop - 1, start - 1, -1)),
                    _region(_producers(own.ops, graph, hops), graph, shapes),
                )
        start = stop
    return found


def _producers(ops: Sequence[int], graph: Graph, hops: int) -> list[int]:
    """``ops`` and the ops that produce their inputs, and theirs, ``hops`` up, in graph order."""
    found, frontier = set(ops), list(ops)
    for _hop in range(hops):
        frontier = [
            p
            for k in frontier
            for v in graph.op_ins[k]
            if (p := graph.producer_of.get(v)) is not None and p not in found
        ]
        found.update(frontier)
    return sorted(found)


def _region(ops: Sequence[int], graph: Graph, shapes: dict[Any, int]) -> Region:
    """``ops`` as a :class:`Region`, its shape numbered in ``shapes``."""
    position: dict[int, int] = {}
    wiring = []
    for k in ops:
        ins = tuple([position.setdefault(v, len(position)) for v in graph.op_ins[k]])
        outs = tuple([-1 if v < 0 else position.setdefault(v, len(position)) for v in graph.op_outs[k]])
        wiring.append((ins, outs))
    values = tuple(position)
    facts = tuple([(graph.clamp[v], len(graph.consumers_of.get(v, ())), v in graph.producer_of) for v in values])
    shape = shapes.setdefault((tuple(wiring), facts), len(shapes))
    ops = tuple(ops)
    return Region(ops, values, position, shape, operator.itemgetter(*ops), operator.itemgetter(*values))
