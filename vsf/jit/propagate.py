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
from torch.distributed.tensor import Partial, Placement, Shard

from vsf import _compat
from vsf.config import PlanOptions
from vsf.errors import PlanError
from vsf.jit.buckets import form_buckets
from vsf.jit.classify import classify, constant_nodes
from vsf.jit import context_parallel, manual
from vsf.jit.cost import NOT_PARTIAL, REPLICATED_OR_SUM, Codes, is_sum, transition_kind
from vsf.jit.memory import peak_bytes
from vsf.jit.graph import Value, is_view, meta_of, op_nodes, output_node, outputs_meta, placeholders_of, signature, tensor_args, user_line, value_of
from vsf.jit.plan import NodePlan, Placements, Plan, R, Redistribution, as_contiguous, balanced_of, has_balanced, has_ragged, is_shard, one_d, split_dim, to_placements
from vsf.jit.redistribute import collectives_of
from vsf.jit.solver import AxisSolver, Problem
from vsf.jit.strategies import Strategies, decide, dtensor_decision, row_wise, runnable
from vsf.sharding import constraint
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding, from_placements
from vsf.sharding.placement import has_strided, kind_of, split_factor
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
    """
    axes = [a for a in mesh.device_axes if mesh.axis_size(a) > 1]
    placeholders = placeholders_of(gm)
    outputs = [value_of(a) for a in _compat.torch_tree_leaves(output_node(gm).args)]
    unreduced = list(unreduced) if unreduced is not None else [()] * len(outputs)
    ops = op_nodes(gm)
    constants = constant_nodes(gm.graph)
    manual.mark(gm, constants)
    problem = Problem(
        mesh=mesh, gm=gm, ops=ops,
        inputs={n: tensor_args(n) for n in ops},
        strategies=Strategies(options, {n: classify(n, constants) for n in ops}, manual.auto_strategies),
        seeds={}, out_req={}, pinned={}, solved={}, bytes_per_flop=options.compute_bytes_per_flop,
    )
    problem.index()
    for ph, pl in zip(placeholders, in_placements):
        for p in pl:
            if kind_of(p) == "ragged" and p.ragged.dims != 1:
                raise PlanError(f"vsf.jit takes ragged inputs that split dim 0 only; input %{ph.name} is {p.ragged!r} (dims={p.ragged.dims})")
    dm_axes = list(mesh.device_axes)
    for axis in axes:
        k = dm_axes.index(axis)
        problem.seeds[axis] = {(ph, 0): one_d(pl[k]) for ph, pl in zip(placeholders, in_placements)}
        problem.balanced[axis] = any(kind_of(pl[k]) == "balanced" for pl in in_placements)
        problem.ragged[axis] = sorted(
            {(pl[k], ph.meta["val"].shape[0]) for ph, pl in zip(placeholders, in_placements) if kind_of(pl[k]) == "ragged"},
            key=repr,
        )
        problem.out_req[axis] = [
            (v, _out_requirement(s, k, axis in ok)) for v, s, ok in zip(outputs, out_shardings, unreduced)
        ]
        problem.pinned[axis] = {n: _pinned(n, mesh, axis) for n in ops if problem.strategies.classes[n].kind == "constraint"}
        problem.fixed[axis] = {n: st for n in ops if (st := manual.fixed_on(n, mesh, axis)) is not None}
    with _compat.local_mode_disabled():
        codes = {axis: Codes(mesh.axis_size(axis), options.collective_latency_bytes) for axis in axes}
        encoded: dict[str, dict[int, list[Any]]] = {axis: {} for axis in axes}
        for _sweep in range(2 if len(axes) > 1 else 1):  # a second sweep sees the other axes' choices
            for axis in axes:
                solver = AxisSolver(problem, axis, codes[axis], encoded[axis])
                solver.solve()
                problem.solved[axis] = solver
        plans, moved, final = _check_with_dtensor(problem, axes, in_placements, out_shardings, unreduced)
    plan = _scheduled(mesh, gm, plans, in_placements, final, moved, options, regather=bool(reshard_after_forward))
    notes: tuple[str, ...] = ()
    if reshard_after_forward is None and memory_budget is not None and (kept := peak_bytes(plan)) > memory_budget:
        plan = _scheduled(mesh, gm, plans, in_placements, final, moved, options, regather=True)
        notes = (f"memory_budget {memory_budget:,} B: params gathered again for their backward uses (reshard after forward; "
                 f"~{kept:,} B peak keeping them, ~{peak_bytes(plan):,} B so)",)
    return dataclasses.replace(plan, reduce_dtype=reduce_dtype, notes=notes)


def _out_requirement(s: NamedSharding | None, k: int, may_stay_unreduced: bool) -> Any:
    """What a graph output required as ``s`` (``None``: anything but a partial) must be on mesh
    dim ``k``: ``s``'s placement there, or an unreduced sum as well where ``s`` replicates it and
    ``may_stay_unreduced``."""
    if s is None:
        return NOT_PARTIAL
    p = one_d(to_placements(s)[k])
    return REPLICATED_OR_SUM if may_stay_unreduced and p == R else p


def _kept_unreduced(axes: Sequence[str], arrived: Placements, want: Placements, unreduced: Sequence[str]) -> Placements:
    """An output's placements: ``want``, but an unreduced sum as it arrives on each axis of
    ``unreduced`` where ``want`` replicates it."""
    return tuple(a if axis in unreduced and w == R and is_sum(a) else w for axis, a, w in zip(axes, arrived, want))


def _pinned(node: torch.fx.Node, mesh: Mesh, axis: str) -> set[Placement]:
    s = constraint.parse(node.args[1])
    if axis in s.spec.axes:
        return {one_d(to_placements(s)[list(mesh.device_axes).index(axis)])}
    free = {R} | {Shard(d) for d, e in enumerate(s.spec) if e is UNCONSTRAINED}
    return free


def _check_with_dtensor(
    problem: Problem, axes: list[str], in_placements: Sequence[Placements], out_shardings: Sequence[NamedSharding | None],
    unreduced: Sequence[Sequence[str]],
) -> tuple[dict[torch.fx.Node, NodePlan], list[Redistribution], list[Placements]]:
    """Every op's placements on the full mesh (the per-axis choices, checked with DTensor's own
    propagation), every redistribution with its users, and the outputs' placements (an output
    that may stay unreduced on an axis keeps an unreduced sum it arrives with there)."""
    mesh, gm = problem.mesh, problem.gm
    dm_axes = list(mesh.device_axes)
    actual: dict[Value, Placements] = {(ph, 0): tuple(pl) for ph, pl in zip(placeholders_of(gm), in_placements)}
    plans: dict[torch.fx.Node, NodePlan] = {}
    moves: dict[tuple[Value, Placements], Redistribution] = {}
    asked: dict[Any, Any] = {}
    decided: dict[Any, tuple[list[Placements], list[Placements | None], bool]] = {}

    def combined(per_axis: dict[str, Placement | None]) -> Placements:
        return tuple(per_axis.get(a, R) if mesh.axis_size(a) > 1 else R for a in dm_axes)

    users: dict[tuple[Value, Placements], list[torch.fx.Node]] = {}
    nestings = _input_nestings(gm, in_placements)

    def nest(t: torch.Tensor | None, p: Placements | None) -> Placements | None:
        return None if t is None or p is None else _nested(nestings, t, p)

    def move(v: Value, dst: Placements, before: torch.fx.Node) -> None:
        src = actual[v]
        if any(transition_kind(one_d(a), one_d(b)) == "invalid" for a, b in zip(src, dst)):
            raise PlanError(f"{before.target} wants %{v[0].name} as {dst} but it is {src}: no redistribution does that{user_line(before)}")
        if src != dst:
            users.setdefault((v, dst), []).append(before)
            if (v, dst) not in moves:
                moves[(v, dst)] = Redistribution(v, src, dst, collectives_of(mesh, meta_of(v), src, dst), before)

    for k, node in enumerate(problem.ops):
        ins = problem.inputs[node]
        choice = {a: problem.solved[a].placement_of(k) for a in axes}
        want_in = [combined({a: choice[a][0][i] for a in axes}) for i in range(len(ins))]
        n_out = len(outputs_meta(node))
        want_out = [
            None if outputs_meta(node)[i] is None else combined({a: choice[a][1][i] for a in axes})
            for i in range(n_out)
        ]
        op = problem.strategies.classes[node]
        fallback = bool(ins) and problem.strategies.of(node, 2)[1]
        direct = False
        if op.kind == "constraint":
            s = constraint.parse(node.args[1])
            target = want_out[0] if any(e is UNCONSTRAINED for e in s.spec) else to_placements(s)
            want_in, want_out = [target], [target]
        elif op.kind == "manual":
            want_in, want_out = manual.placements(node, mesh, want_in, want_out)
            direct = True
        elif op.kind == "value_blind":
            direct = True
        elif context_parallel.runs(mesh, node, want_in, want_out):
            pass  # the per-axis choices as they are: vsf runs the op (context_parallel.run), not DTensor
        elif op.kind == "strategy" and not fallback:
            arrived = [actual[v] for v in ins]
            preferred = [nest(meta_of(v), w) for v, w in zip(ins, want_in)] + [nest(t, w) for t, w in zip(outputs_meta(node), want_out)]
            # (decided once per op signature and layouts: a model's repeated blocks ask the same)
            key = (node.target, signature(node.args), signature(node.kwargs), tuple((tuple(t.shape), t.dtype) for t in outputs_meta(node) if t is not None), op, tuple(arrived), tuple(want_in), tuple(want_out), tuple(preferred))
            if key not in decided:
                decide_op = _balanced_decision if has_balanced([*arrived, *want_in, *want_out]) else _strategy_decision
                decided[key] = decide_op(node, mesh, op, arrived, want_in, want_out, preferred, asked)
            want_in, want_out, direct = decided[key]
        if manual.inside(node) and op.kind != "manual":
            _local_over_manual(node, mesh, want_in, want_out)
        for v, dst in zip(ins, want_in):
            move(v, dst, node)
        inside = manual.collectives(node, mesh, want_in) if op.kind == "manual" else context_parallel.collectives(mesh, node, want_in) if context_parallel.splits_sequence(node, want_in) else ()
        plans[node] = NodePlan(tuple(want_in), tuple(want_out), op, fallback, direct, inside)
        for i, out in enumerate(want_out):
            if out is not None:
                actual[(node, i)] = out
    out_node = output_node(gm)
    outs = [value_of(a) for a in _compat.torch_tree_leaves(out_node.args)]
    final = []
    for v, s, ok in zip(outs, out_shardings, unreduced):
        dst = _kept_unreduced(dm_axes, actual[v], to_placements(s), ok) if s is not None else _expressible(mesh, meta_of(v), actual[v])
        move(v, dst, out_node)
        final.append(dst)
    return plans, [dataclasses.replace(r, users=tuple(users[key])) for key, r in moves.items()], final


def _scheduled(
    mesh: Mesh, gm: torch.fx.GraphModule, plans: dict[torch.fx.Node, NodePlan], in_placements: Sequence[Placements],
    final: list[Placements], moves: list[Redistribution], options: PlanOptions, *, regather: bool,
) -> Plan:
    """The plan: with each gathered input gathered again for its later uses if ``regather``, the
    collectives bucketed and the program's order."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = tuple(r for m in moves for r in (_regathered(index, m) if regather else (m,)))
    buckets, order = form_buckets(mesh, gm, moved, {id(r): list(r.users) for r in moved}, options.bucket_bytes)
    return Plan(mesh, gm, plans, tuple(tuple(p) for p in in_placements), tuple(final), moved, buckets, order, options)


def _strategy_decision(
    node: torch.fx.Node, mesh: Mesh, op: Any, arrived: list[Placements], ins: list[Placements], outs: list[Placements | None],
    preferred: list[Placements | None], asked: dict[Any, Any],
) -> tuple[list[Placements], list[Placements | None], bool]:
    """How an op with a DTensor strategy runs, given the per-axis choices ``ins``/``outs`` and the
    layouts its inputs arrive with: directly on the local shards where its rule allows (strided
    shards kept as they arrive), else as DTensor decides. Returns the placements and whether it
    runs directly."""
    direct = op.local or (op.ragged_reduction and has_ragged(ins))
    if direct and not has_ragged(ins):
        strided = _keep_strided(arrived, ins, outs, preferred)
        if strided != (ins, outs):
            # DTensor keeps a strided shard only through rules written with placeholders
            # (elementwise ones), not through rules that name plain shards (embedding's)
            direct = dtensor_decision(node, mesh.device_mesh, strided[0], asked) == strided
        ins, outs = strided
        direct = direct and runnable(mesh, node, ins, outs)
    if not direct:
        rows = row_wise(node, mesh, arrived, ins, outs, asked)
        if rows is not None:
            return *rows, True
        ins = [_as_arrived(a, w) for a, w in zip(arrived, ins)]
        ins, outs = decide(node, mesh, [p if p is not None else w for p, w in zip(preferred, ins)], asked)
    return ins, outs, direct


def _balanced_decision(
    node: torch.fx.Node, mesh: Mesh, op: Any, arrived: list[Placements], ins: list[Placements], outs: list[Placements | None],
    preferred: list[Placements | None], asked: dict[Any, Any],
) -> tuple[list[Placements], list[Placements | None], bool]:
    """:func:`_strategy_decision` for an op some of whose operands arrive or are wanted split
    balanced: decided on the contiguous shards of the balanced view (the same local shards,
    :func:`as_contiguous`) and read back with every shard balanced on the mesh dims the per-axis
    choices split balanced (a rule on contiguous blocks holds on the balanced chunks when every
    operand holds the same ones: :func:`vsf.jit.strategies._balanced_variants`)."""
    dims = {k for p in [*ins, *outs] if p is not None for k, q in enumerate(p) if kind_of(q) == "balanced"}
    got_in, got_out, direct = _strategy_decision(
        node, mesh, op, [as_contiguous(p) for p in arrived], [as_contiguous(p) for p in ins], [as_contiguous(p) for p in outs],
        [as_contiguous(p) for p in preferred], asked,
    )
    metas = [meta_of(v) for v in tensor_args(node)] + list(outputs_meta(node))

    def back(t: torch.Tensor | None, p: Placements | None) -> Placements | None:
        if p is None:
            return None
        out = list(p)
        for k in dims:
            if is_shard(p[k]):
                b = balanced_of(p[k])
                if t.shape[b.dim] % (2 * b.groups * mesh.axis_size(mesh.device_axes[k])):
                    raise PlanError(f"{node.target} would split dim {b.dim} of {tuple(t.shape)} balanced over {mesh.device_axes[k]!r}, which does not cut it into equal chunks{user_line(node)}")
                out[k] = b
        return tuple(out)

    placed = [back(t, p) for t, p in zip(metas, [*got_in, *got_out])]
    return placed[: len(got_in)], placed[len(got_in) :], direct


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
    return dataclasses.replace(r, before=users[0], users=tuple(users[:cut])), dataclasses.replace(r, before=users[cut], users=tuple(users[cut:]))


def _input_view(node: torch.fx.Node) -> bool:
    """Is ``node`` a graph input, or a chain of views (ops whose result aliases their one tensor
    argument: ``detach``, ``t``, ``view``) of one?"""
    while node.op != "placeholder":
        if not is_view(node):
            return False
        node = node.all_input_nodes[0]
    return True


def _local_over_manual(node: torch.fx.Node, mesh: Mesh, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> None:
    """A region's body op runs on each rank's values as they are over the region's manual axes:
    DTensor's decision on the full mesh must move nothing there."""
    r = manual.region_of(node)
    for k, a in enumerate(mesh.device_axes):
        if a in r.manual and any(p is not None and p[k] != R for p in [*ins, *outs]):
            raise PlanError(f"{node.target} in shard_map({r.name}) would need {list(ins)} -> {list(outs)}, which moves values over its manual axis {a!r}{user_line(node)}")


def _keep_strided(
    actual: list[Placements], ins: list[Placements], outs: list[Placements | None], preferred: Sequence[Placements | None]
) -> tuple[list[Placements], list[Placements | None]]:
    """A per-mesh-dim strategy chosen with plain shards, applied to inputs that arrive with strided
    shards kept as they are: on each mesh dim where the inputs that keep their shard all carry the
    same split factor, every shard of the strategy takes it (DTensor fills its single-dim rules the
    same way), so an elementwise op on a ``P(("tp", "dp"))`` value moves nothing. An input keeps its
    shard only if it also keeps the other mesh dims' splits of that tensor dim, which the factor
    counts (``dp``'s factor in ``P(("tp", "dp"))`` is ``tp``'s split: gathering ``tp`` and keeping
    ``dp`` strided is a move DTensor cannot make). ``preferred`` (per input, then per output: see
    :func:`_nested`) counts like an input arriving strided. A strided shard the per-axis solver
    chose (one axis's view of a merged dim: ``bmm`` on ``[b*h@tp, ...]``) counts as a plain shard
    here: its factor on the full mesh is the arriving value's (``[b@dp, h@tp]`` merged leaves tp
    a factor of ``b / dp``); where such an input arrives without a split of that dim, the op runs
    replicated on that mesh dim (the split the per-axis solver counted on was not made)."""
    unmet = {
        k for a, want in zip(actual, ins) for k, w in enumerate(want)
        if kind_of(w) == "strided" and not (is_shard(a[k]) and split_dim(a[k]) == w.dim)
    }
    flat = lambda p: [R if k in unmet else one_d(q) for k, q in enumerate(p)]  # noqa: E731
    ins, outs = [flat(p) for p in ins], [None if p is None else flat(p) for p in outs]
    for k in range(len(ins[0]) if ins else 0):
        factors = {
            a[k].split_factor for a, want in zip(actual, ins)
            if kind_of(a[k]) == "strided" and isinstance(want[k], Shard) and want[k].dim == a[k].dim
            and all(one_d(w) == one_d(b) for j, (b, w) in enumerate(zip(a, want)) if j != k and is_shard(b) and split_dim(b) == a[k].dim)
        } | {p[k].split_factor for p in preferred if p is not None and kind_of(p[k]) == "strided"}
        if len(factors) != 1:
            continue
        sf = factors.pop()
        for p in [*ins, *(o for o in outs if o is not None)]:
            if isinstance(p[k], Shard):
                p[k] = _compat.StridedShard(p[k].dim, split_factor=sf)
    return [tuple(p) for p in ins], [None if o is None else tuple(o) for o in outs]


def _as_arrived(actual: Placements, want: Placements) -> Placements:
    """``want`` with each strided shard the per-axis solver chose replaced by the arriving shard of
    that dim (the full mesh's factor of a merged dim differs from one axis's: see
    :func:`_keep_strided`), or by ``Replicate`` where the value arrives without one."""
    strided = lambda a, w: a if is_shard(a) and split_dim(a) == w.dim else R  # noqa: E731
    return tuple(strided(a, w) if kind_of(w) == "strided" else w for a, w in zip(actual, want))


def _expressible(mesh: Mesh, t: torch.Tensor, placements: Placements) -> Placements:
    """Where a graph output left to propagation ends up: reduced (a partial becomes replicated) and
    in a layout a spec can name (a strided shard that none names, as a view merging a dim sharded
    on one axis into another leaves, is gathered)."""
    out = tuple(R if isinstance(p, Partial) else p for p in placements)
    try:
        from_placements(mesh, out, t.ndim)
    except ValueError:
        return tuple(R if split_factor(p) is not None else p for p in out)
    return out


def _input_nestings(gm: torch.fx.GraphModule, in_placements: Sequence[Placements]) -> dict[tuple[int, ...], list[Placements]]:
    """The strided layouts of the graph's inputs, by shape: a ZeRO state leaf ``P(("fsdp", "dp"))``
    nests ``dp`` inside ``fsdp``, against mesh order."""
    found: dict[tuple[int, ...], list[Placements]] = {}
    for ph, pl in zip(placeholders_of(gm), in_placements):
        same_shape = found.setdefault(tuple(ph.meta["val"].shape), [])
        if has_strided([pl]) and tuple(pl) not in same_shape:
            same_shape.append(tuple(pl))
    return found


def _nested(nestings: dict[tuple[int, ...], list[Placements]], t: torch.Tensor, placements: Placements) -> Placements | None:
    """The strided layout of an input of ``t``'s shape whose mesh dims split the same tensor dims
    as ``placements`` do (in mesh order), if there is one: values shaped like a ZeRO state leaf
    (its gradient, its update) are split as the state is, so they reach it without regathering.
    ``None`` if there is none."""
    candidates = nestings.get(tuple(t.shape))
    if not candidates or has_strided([placements]):
        return None
    plain = tuple(one_d(p) for p in placements)
    return next((pl for pl in candidates if tuple(one_d(p) for p in pl) == plain), None)
