"""Whole-graph sharding propagation: choose a placement for every value of a traced graph.

The problem is solved one mesh axis at a time (as Shardy reasons per factor and DTensor's
single-dim strategies do): on an axis of size ``n`` a value is ``Replicate``, ``Shard(d)`` or
``Partial``, and every op offers the strategies DTensor registers for it (input placements ->
output placements). The planner picks one strategy per op so that the redistributions it implies
and the work it duplicates cost the fewest bytes (:mod:`vsf.jit.cost`), where

* all-reduce moves ``2(n-1)/n`` of the tensor, all-gather and reduce-scatter ``(n-1)/n``,
  all-to-all ``(n-1)/n`` of the local shard (ring model, bytes each rank sends);
* a value redistributed to one placement is redistributed once, however many ops use it there
  (so a gradient is reduced once, not once per use);
* a ``Partial`` result stays partial until the cheapest point to reduce it (the greedy pass
  charges a pending reduction to a partial output; the refinement passes then move it);
* a matmul, convolution or attention op run with nothing split on an axis runs its whole work
  on every rank of it: the FLOPs beyond its share are charged at ``vsf.config.compute_bytes_per_flop``
  bytes each (so Megatron's row-parallel matmul all-reduces its output rather than gathering its
  input and weight to compute the whole product on every rank, where the work outweighs the bytes).

Priority when annotations disagree: a ``with_sharding_constraint`` fixes its value, and a
``shard_map`` region its inputs and results, and its body's values over its manual axes
(:mod:`vsf.jit.manual`); inputs keep
the sharding they arrive with (``in_shardings``); ``out_shardings`` are met by a final
redistribution. Nothing is replicated silently: an op without a DTensor strategy is an error
naming the op and the user's line, unless ``options.allow_replicated_fallback`` is set, in which case the
plan marks that op as replicated.

The per-axis choices are then combined and checked op by op with DTensor's own propagation on the
full mesh (the same decision the lowered program will make), so the plan is exactly what runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Placement, Shard

from vsf import _compat
from vsf.config import PlanOptions
from vsf.errors import PlanError
from vsf.jit.buckets import form_buckets
from vsf.jit.combine import check_with_dtensor
from vsf.jit.classify import classify_all, constant_nodes
from vsf.jit import arrivals, manual
from vsf.jit.cost import NOT_PARTIAL, Codes, OrSum, latency_bytes
from vsf.jit.memory import peak_bytes
from vsf.jit.graph import is_view, op_nodes, output_node, placeholders_of, tensor_args, value_of
from vsf.jit.plan import NodePlan, Placements, Plan, R, Redistribution, to_placements
from vsf.jit.solver import AxisSolver, AxisTables, Problem
from vsf.jit.strategies import Strategies
from vsf.sharding import constraint
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.placement import kind_of, per_axis
from vsf.sharding.spec import UNCONSTRAINED

__all__ = ["propagate"]


def propagate(
    gm: torch.fx.GraphModule,
    mesh: Mesh,
    in_placements: Sequence[Placements],
    out_shardings: Sequence[NamedSharding | None],
    options: PlanOptions,
    *,
    reshard_after_forward: bool | None = None,
    memory_budget: int | None = None,
    unreduced: Sequence[Sequence[str]] | None = None,
    reduce_dtype: torch.dtype | None = None,
    donated: Sequence[int] = (),
) -> Plan:
    """Plan ``gm`` (a traced graph on global shapes) over ``mesh``.

    ``in_placements`` gives each placeholder's DTensor placements (over ``mesh.device_axes``);
    ``out_shardings`` each output's required sharding, ``None`` to let propagation choose
    (anything but an unreduced partial); ``options`` the switches it plans with. ``unreduced``: per output, mesh axes on which it may
    stay an unreduced partial sum where its required sharding replicates it (a gradient the
    caller accumulates over calls and reduces once): it stays so where the plan holds it as one,
    which costs nothing there (a replicated result is not split into a partial one).
    ``reshard_after_forward``: whether a gathered input is gathered again for its later uses (:func:`_regathered`); ``None`` lets ``memory_budget``
    (bytes per rank) decide: kept gathered unless the plan's estimated peak would exceed it.
    ``reduce_dtype``: the dtype floating values are reduced in (:attr:`Plan.reduce_dtype`).
    ``donated``: the inputs the caller donates (:attr:`Plan.donated`).
    """
    axes = [a for a in mesh.device_axes if mesh.axis_size(a) > 1]
    placeholders = placeholders_of(gm)
    outputs = [value_of(a) for a in _compat.torch_tree_leaves(output_node(gm).args)]
    unreduced = list(unreduced) if unreduced is not None else [()] * len(outputs)
    ops = op_nodes(gm)
    constants = constant_nodes(gm.graph)
    manual.mark(gm, constants)
    inputs = {n: tensor_args(n) for n in ops}
    written, *others = manual.orders(gm)
    taking = bool(others) and arrivals.takes_arrivals(gm)  # (an any_order region's entries as they arrive)
    problem = Problem(
        mesh=mesh,
        gm=gm,
        ops=ops,
        inputs=inputs,
        strategies=Strategies(
            options,
            classify_all(ops, constants),
            manual.auto_strategies,
            inputs,
            arrivals.leaves_strided if taking else None,
            held={ph: _packed(pl) for ph, pl in zip(placeholders, in_placements)},
        ),
        seeds={},
        out_req={},
        pinned={},
        solved={},
        bytes_per_flop=options.compute_bytes_per_flop,
    )
    problem.index()
    for ph, pl in zip(placeholders, in_placements):
        for p in pl:
            if kind_of(p) == "ragged" and p.ragged.dims != 1:
                raise PlanError(
                    f"vsf.jit takes ragged inputs that split dim 0 only; input %{ph.name} is {p.ragged!r} (dims={p.ragged.dims})"
                )
    dm_axes = list(mesh.device_axes)
    out_placements = [None if s is None else to_placements(s) for s in out_shardings]
    for axis in axes:
        k = dm_axes.index(axis)
        problem.seeds[axis] = {(ph, 0): per_axis(pl, k) for ph, pl in zip(placeholders, in_placements)}
        problem.balanced[axis] = any(kind_of(pl[k]) == "balanced" for pl in in_placements)
        problem.ragged[axis] = sorted(
            {
                (pl[k], ph.meta["val"].shape[0])
                for ph, pl in zip(placeholders, in_placements)
                if kind_of(pl[k]) == "ragged"
            },
            key=repr,
        )
        problem.out_req[axis] = [
            (v, _out_requirement(pl, k, axis in ok)) for v, pl, ok in zip(outputs, out_placements, unreduced)
        ]
        problem.pinned[axis] = {
            n: _pinned(n, mesh, axis) for n in ops if problem.strategies.classes[n].kind == "constraint"
        }
        problem.fixed[axis] = {n: st for n in ops if (st := manual.fixed_on(n, mesh, axis)) is not None}
    with _compat.local_mode_disabled():
        latency = latency_bytes(mesh.device_type, options.collective_latency_bytes)
        axes = [a for a in axes if not (AxisSolver.reuse and _names_nothing(problem, a))]
        _solve(problem, axes, latency)
        # the per-axis choices hold for every order of an any_order region's specs (manual.orders);
        # for their entries taken as they arrive (arrivals.takes_arrivals), solved with the regions'
        # boundary ops free to split them as any strided shard, then again with each split as the
        # first such entry came
        combined = [check_with_dtensor(problem, axes, in_placements, out_placements, unreduced, written)]
        solved = [problem]
        if others and manual.reorders(mesh, combined[0][1], list(written)):
            combined += [check_with_dtensor(problem, axes, in_placements, out_placements, unreduced, c) for c in others]
            if taking:
                free = {a: {n: st for n in ops if (st := manual.fixed_on(n, mesh, a, True)) is not None} for a in axes}
                loose = dataclasses.replace(problem, fixed=free, solved={})
                _solve(loose, axes, latency, sweeps=1)  # (it only says how the first entries arrive)
                came = dataclasses.replace(problem, fixed=arrivals.as_arrived(ops, free, loose.solved), solved={})
                _solve(came, axes, latency)
                solved += [loose, came]
                combined.append(
                    check_with_dtensor(
                        came, axes, in_placements, out_placements, unreduced, written, as_they_arrive=True
                    )
                )
        plans, moved, final = min(combined, key=lambda c: _bytes_moved(c[0], c[1], latency))
        _drop_solvers(solved)
    plan = _scheduled(
        mesh, gm, plans, in_placements, final, moved, options, regather=bool(reshard_after_forward), donated=donated
    )
    notes: tuple[str, ...] = ()
    if reshard_after_forward is None and memory_budget is not None and (kept := peak_bytes(plan)) > memory_budget:
        plan = _scheduled(mesh, gm, plans, in_placements, final, moved, options, regather=True, donated=donated)
        notes = (
            f"memory_budget {memory_budget:,} B: params gathered again for their backward uses (reshard after forward; "
            f"~{kept:,} B peak keeping them, ~{peak_bytes(plan):,} B so)",
        )
    return dataclasses.replace(plan, reduce_dtype=reduce_dtype, notes=notes)


def _names_nothing(problem: Problem, axis: str) -> bool:
    """Does nothing shard anything over ``axis``: every input arrives replicated on it, every output
    may leave replicated, no ``with_sharding_constraint`` names it and no ``shard_map`` region is
    manual over it? Such an axis is replicated throughout, as a size-1 axis is, without solving:
    vsf does not invent parallelism over an axis no annotation names (nor does JAX), and a solve
    would only depart from replicating to split an op's work over it at the cost of bytes (no solve
    has, on the models the tests plan both ways: ``AxisSolver.reuse``).

    Example::

        >>> _names_nothing(problem, "cp")   # a 5D mesh, the batch over dp x fsdp, weights over tp
        True
    """
    seeds_replicated = all(kind_of(p) == "replicate" for p in problem.seeds[axis].values())
    outs_replicated = all(
        req is NOT_PARTIAL or kind_of(req.placement if isinstance(req, OrSum) else req) == "replicate"
        for _, req in problem.out_req[axis]
    )
    unpinned = all(R in allowed for allowed in problem.pinned[axis].values())
    return seeds_replicated and outs_replicated and unpinned and not problem.fixed[axis]


def _solve(problem: Problem, axes: Sequence[str], latency: float, sweeps: int = 2) -> None:
    """Solve each axis of ``problem`` (:class:`AxisSolver`), ``sweeps`` times where there are several:
    a second sweep sees the other axes' choices (an axis posed the same problem again keeps its answer)."""
    tables: dict[str, AxisTables] = {}
    for _sweep in range(sweeps if len(axes) > 1 else 1):
        for axis in axes:
            if axis not in tables:
                tables[axis] = AxisTables.build(problem, axis, Codes(problem.mesh.axis_size(axis), latency))
            solver = AxisSolver(problem, axis, tables[axis])
            last = problem.solved.get(axis)
            if last is None or not solver.poses_as(last):  # (else: solved again, it gives last's answer)
                solver.solve()
                if held := solver.other_start:
                    other = AxisSolver(problem, axis, tables[axis], held)
                    other.solve()
                    solver = other if other.objective() < solver.objective() - 1e-6 else solver
                problem.solved[axis] = solver


def _drop_solvers(problems: Sequence[Problem]) -> None:
    """Forget the axis solvers of ``problems`` once their choices are combined. A solver refers to its
    problem, which holds it (``Problem.solved``): left so, the problem, its solvers and their tables
    (thousands of objects a layer) are freed only by the cyclic collector, whose first pass after
    planning (:func:`vsf.runtime.collector_paused`) walked them all, about a millisecond a layer.

    Example::

        >>> _drop_solvers([problem])  # problem.solved == {}: freed when the last name of it goes
    """
    for problem in problems:
        problem.solved.clear()


def _bytes_moved(plans: dict[torch.fx.Node, NodePlan], moved: list[Redistribution], latency: float) -> float:
    """What the collectives of a combined plan cost (bytes each rank sends, and ``latency`` bytes
    each): its redistributions' and those its ops run (a region's, context parallel attention's)."""
    collectives = [c for r in moved for c in r.collectives] + [c for p in plans.values() for c in p.collectives]
    return sum(c.bytes + latency for c in collectives if c.kind not in ("slice", "partition"))


def _packed(placements: Placements) -> tuple[Placement, ...]:
    """The packed splits (strided shards of a dim no other mesh dim splits: :func:`per_axis`) an
    input holds: its consumers' strategies take them as they arrive."""
    return tuple(q for k, q in enumerate(placements) if kind_of(q) == "strided" and per_axis(placements, k) == q)


def _out_requirement(placements: Placements | None, k: int, may_stay_unreduced: bool) -> Any:
    """What a graph output required as ``placements`` (``None``: anything but a partial) must be
    on mesh dim ``k``: its placement there, or an unreduced sum as well where ``may_stay_unreduced``."""
    if placements is None:
        return NOT_PARTIAL
    p = per_axis(placements, k)
    return OrSum(p) if may_stay_unreduced else p


def _pinned(node: torch.fx.Node, mesh: Mesh, axis: str) -> set[Placement]:
    s = constraint.parse(node.args[1])
    if axis in s.spec.axes:
        return {per_axis(to_placements(s), list(mesh.device_axes).index(axis))}
    free = {R} | {Shard(d) for d, e in enumerate(s.spec) if e is UNCONSTRAINED}
    return free


def _scheduled(
    mesh: Mesh,
    gm: torch.fx.GraphModule,
    plans: dict[torch.fx.Node, NodePlan],
    in_placements: Sequence[Placements],
    final: list[Placements],
    moves: list[Redistribution],
    options: PlanOptions,
    *,
    regather: bool,
    donated: Sequence[int] = (),
) -> Plan:
    """The plan: with each gathered input gathered again for its later uses if ``regather``, the
    collectives bucketed and the program's order."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = tuple(r for m in moves for r in (_regathered(index, m) if regather else (m,)))
    buckets, order = form_buckets(mesh, gm, moved, {id(r): list(r.users) for r in moved}, options.bucket_bytes)
    return Plan(
        mesh,
        gm,
        plans,
        tuple(tuple(p) for p in in_placements),
        tuple(final),
        moved,
        buckets,
        order,
        options,
        donated=frozenset(donated),
    )


def _regathered(index: dict[torch.fx.Node, int], r: Redistribution) -> tuple[Redistribution, ...]:
    """FSDP's reshard after forward, for one redistribution: a gather of a graph input (or of a
    view of one: a param, its transpose) that several ops read is split at the widest gap
    between consecutive readers, in graph order (``index``). The first copy is freed after the last use before
    the gap; the second is gathered again from the shard, which every rank keeps, before the
    first use after it (in a training step: a param gathered in the forward, and again in the
    backward). Anything else is returned as it is."""
    users = sorted(set(r.users), key=index.__getitem__)  # (an op may read the value twice)
    if len(users) < 2 or not any(c.kind == "all_gather" for c in r.collectives) or not _input_view(r.value[0]):
        return (r,)
    cut = max(range(1, len(users)), key=lambda i: index[users[i]] - index[users[i - 1]])
    return dataclasses.replace(r, before=users[0], users=tuple(users[:cut])), dataclasses.replace(
        r, before=users[cut], users=tuple(users[cut:])
    )


def _input_view(node: torch.fx.Node) -> bool:
    """Is ``node`` a graph input, or a chain of views (ops whose result aliases their one tensor
    argument: ``detach``, ``t``, ``view``) of one?"""
    while node.op != "placeholder":
        if not is_view(node):
            return False
        node = node.all_input_nodes[0]
    return True
