"""The runs of ops that copies of a model's repeated blocks made, for the per-axis solver to place
one run and copy what it did to the runs like it.

A stamped block (:mod:`vsf.jit.stamp`) copies its trace's forward ops into the step's graph at each
call, and its backward ops when autograd reaches it; each copied node carries :data:`COPY`, the
name of the first node of its copy. :func:`runs_of` finds the runs of consecutive ops of one copy in
a problem's ops, each as a :class:`Region` whose *shape* numbers its wiring: per op in order, which
of the region's values (in the order its ops first read or write them) it reads and writes, and
per value its cap on counted reads (:attr:`vsf.jit.solver.Problem.clamp`) and whether an op writes
it. Equal numbers, equal wiring. Copies of a few ops each (an optimizer's update of one leaf, one
op) are cut into runs where their sequence repeats (a block's leaves after another's).

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

    >>> found = runs_of(Graph(ops, op_ins, op_outs, clamp, producer_of), hops=3)
    >>> len(found), len({r.own.shape for r in found.values()})  # a 24-layer GPT's AdamW step: blocks, leaf updates
    (96, 4)
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

__all__ = ["COPY", "MIN_OPS", "Graph", "Left", "Placed", "Region", "Run", "runs_of"]

# the node metadata key naming the copy a stamped block's node belongs to
COPY = "vsf_copy"

# the fewest ops a run needs to be copied as one (a shorter one costs about as much to key as to place)
MIN_OPS = 8

# the most ops a period of short copies may span (:func:`_periods`: a block's leaves' updates)
_LONGEST = 64


@dataclasses.dataclass(frozen=True)
class Region:
    """Some ops of a problem, in graph order, and the values they read and write, in the order
    first met (``position``: each one's place among them); ``shape``: the number of their wiring
    (per op, the positions of its inputs and outputs; per value, its cap on counted reads and
    whether an op writes it: equal numbers, equal wiring); ``ops_of`` and
    ``values_of``: what reads their entries of a per-op and a per-value list, as tuples."""

    ops: tuple[int, ...]
    values: tuple[int, ...]
    position: dict[int, int]
    shape: int
    ops_of: Callable[[Sequence[Any]], tuple[Any, ...]]
    values_of: Callable[[Sequence[Any]], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Run:
    """Ops ``start`` to ``stop`` (exclusive) of a problem, one copy's consecutive ops or a period
    of short copies (``own``); ``visits``: its ops as
    a solver's work list holds them to visit in turn (the first last); ``reach``: its ops and
    their producers some hops up (what the partial-sum merges of its ops read)."""

    start: int
    stop: int
    own: Region
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


def runs_of(graph: Graph, hops: int) -> dict[int, Run]:
    """The runs of at least :data:`MIN_OPS` consecutive ops of one copy (:data:`COPY`), and the
    runs the copies of one op each make where they repeat (:func:`_periods`: an optimizer's
    per-leaf updates, a block's leaves after another's), by first op, each with its reach (its
    ops and their producers ``hops`` up)."""
    shapes: dict[Any, int] = {}
    found: dict[int, Run] = {}
    for start, stop in _spans(graph.ops):
        own = _region(range(start, stop), graph, shapes)
        if len(own.values) > 1:  # (an itemgetter of one gives no tuple)
            found[start] = Run(
                start,
                stop,
                own,
                list(range(stop - 1, start - 1, -1)),
                _region(_producers(own.ops, graph, hops), graph, shapes),
            )
    return found


def _spans(ops: Sequence[torch.fx.Node]) -> list[tuple[int, int]]:
    """The spans of the runs: each copy's consecutive ops where at least :data:`MIN_OPS`, and
    the periods of the stretches of shorter copies (:func:`_periods`)."""
    spans: list[tuple[int, int]] = []
    stretch: list[int] = []  # consecutive ops of copies too short to be runs
    start = 0
    while start < len(ops):
        copy = ops[start].meta.get(COPY)
        stop = start + 1
        while stop < len(ops) and copy is not None and ops[stop].meta.get(COPY) == copy:
            stop += 1
        if copy is not None and stop - start >= MIN_OPS:
            spans.append((start, stop))
        if copy is not None and stop - start < MIN_OPS:
            stretch.extend(range(start, stop))
        else:
            spans += _periods(ops, stretch)
            stretch = []
        start = stop
    return sorted(spans + _periods(ops, stretch))


def _periods(ops: Sequence[torch.fx.Node], stretch: list[int]) -> list[tuple[int, int]]:
    """The consecutive ops ``stretch`` cut into runs where they repeat: from an op, the fewest ops
    (up to :data:`_LONGEST`) after which the targets and output shapes repeat three times over
    (taken as many times as makes :data:`MIN_OPS`) is a run, and each next as many ops that
    repeat it; ops that start no repeat are left out."""
    marks = [(ops[k].target, _shape(ops[k])) for k in stretch]
    spans, i = [], 0
    while i < len(marks):
        period = next(
            (
                p
                for p in range(1, min(_LONGEST, (len(marks) - i) // 4) + 1)
                if all(marks[i + j] == marks[i + j + p] for j in range(3 * p))
            ),
            None,
        )
        if period is not None:
            period *= -(-MIN_OPS // period)
        if period is None or i + period > len(marks):
            i += 1
            continue
        first = marks[i : i + period]
        while marks[i : i + period] == first:
            spans.append((stretch[i], stretch[i + period - 1] + 1))
            i += period
    return spans


def _shape(node: torch.fx.Node) -> Any:
    """The shape of ``node``'s value, or of each of its values (``None`` for one not a tensor)."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return tuple([tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in val])
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


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
    """``ops`` as a :class:`Region`, its shape numbered in ``shapes``: per op the numbers of its
    inputs and outputs, then the positions among its values of every op's inputs and outputs in
    turn (``-1``: no output), then per value its cap on counted reads and whether an op writes it."""
    ops = tuple(ops)
    ins, outs = operator.itemgetter(*ops)(graph.op_ins), operator.itemgetter(*ops)(graph.op_outs)
    if len(ops) == 1:
        ins, outs = (ins,), (outs,)
    met = [v for op_ins, op_outs in zip(ins, outs) for v in (*op_ins, *op_outs)]
    position = {v: i for i, v in enumerate(dict.fromkeys(v for v in met if v >= 0))}
    position[-1] = -1
    wired = tuple(map(position.__getitem__, met))
    del position[-1]
    values = tuple(position)
    key = (
        tuple(map(len, ins)),
        tuple(map(len, outs)),
        wired,
        tuple(map(graph.clamp.__getitem__, values)),
        tuple(map(graph.producer_of.__contains__, values)),
    )
    shape = shapes.setdefault(key, len(shapes))
    return Region(ops, values, position, shape, operator.itemgetter(*ops), operator.itemgetter(*values))
