"""The per-axis choices of :mod:`vsf.jit.propagate` combined into every op's placements on the
full mesh and checked with DTensor's own propagation (the decision the lowered program will make),
with the redistributions they imply: the plan is what runs.

Example::

    >>> plans, moves, final = check_with_dtensor(problem, axes, in_placements, out_placements, unreduced)
    >>> plans[mm_node].inputs           # the matmul's inputs' placements over every mesh dim
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Shard

from vsf import _compat
from vsf.errors import PlanError
from vsf.jit import arrivals, context_parallel, manual, packed
from vsf.jit.cost import is_sum, reachable
from vsf.jit.graph import (
    Value,
    meta_of,
    output_node,
    outputs_meta,
    placeholders_of,
    tensor_args,
    user_line,
    value_of,
)
from vsf.jit.plan import (
    Collective,
    NodePlan,
    Placements,
    R,
    Redistribution,
    as_contiguous,
    balanced_of,
    has_balanced,
    has_ragged,
    is_shard,
    one_d,
    split_dim,
    to_placements,
)
from vsf.jit.redistribute import collectives_of
from vsf.jit.solver import Problem
from vsf.jit.strategies import batch_split_convolution, decide, dtensor_decision, row_wise, runnable
from vsf.sharding import constraint
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import from_placements
from vsf.sharding.placement import has_strided, kind_of, split_factor
from vsf.sharding.spec import UNCONSTRAINED

__all__ = ["check_with_dtensor"]


def _kept_unreduced(axes: Sequence[str], arrived: Placements, want: Placements, unreduced: Sequence[str]) -> Placements:
    """An output's placements: ``want``, but an unreduced sum as it arrives on each axis of ``unreduced``."""
    return tuple(a if axis in unreduced and is_sum(a) else w for axis, a, w in zip(axes, arrived, want))


def check_with_dtensor(
    problem: Problem,
    axes: list[str],
    in_placements: Sequence[Placements],
    out_placements: Sequence[Placements | None],
    unreduced: Sequence[Sequence[str]],
    chosen: manual.Orders | None = None,
    as_they_arrive: bool = False,
) -> tuple[dict[torch.fx.Node, NodePlan], list[Redistribution], list[Placements]]:
    """Every op's placements on the full mesh (the per-axis choices, checked with DTensor's own
    propagation), every redistribution with its users, and the outputs' placements: those
    ``out_placements`` requires (``None``: left to propagation), except that an output that may
    stay unreduced on an axis keeps an unreduced sum it arrives with there. ``chosen``:
    the order of the multi-axis entries of ``any_order`` regions' specs (:func:`vsf.jit.manual.orders`);
    ``as_they_arrive``: those entries split as they arrive instead (:func:`vsf.jit.arrivals.takes_arrivals`)."""
    mesh, gm = problem.mesh, problem.gm
    dm_axes = list(mesh.device_axes)
    layouts: dict[Placements, Placements] = {}  # each layout held, once (node_plan)
    actual: dict[Value, Placements] = {
        (ph, 0): layouts.setdefault(tuple(pl), tuple(pl)) for ph, pl in zip(placeholders_of(gm), in_placements)
    }
    plans: dict[torch.fx.Node, NodePlan] = {}
    moves: dict[tuple[Value, int], Redistribution] = {}  # by value and the id of its layout wanted
    asked: dict[Any, Any] = {}
    kinds: dict[Any, int] = {}  # op signatures, numbered
    decided: dict[tuple[Any, ...], NodePlan] = {}
    taken: arrivals.Taken | None = {} if as_they_arrive else None

    live = [a in axes and mesh.axis_size(a) > 1 for a in dm_axes]  # (an axis of size 1 holds the value whole)

    users: dict[tuple[Value, int], list[torch.fx.Node]] = {}  # per move (:func:`move`'s key), its users
    nestings = _input_nestings(gm, in_placements)

    def nest(t: torch.Tensor | None, p: Placements | None) -> Placements | None:
        return None if t is None or p is None else _nested(nestings, t, p) or _ordered(mesh, t, p, chosen)

    paths: dict[Any, tuple[Collective, ...]] = {}  # by shape, dtype and move: repeated blocks make the same
    valid: set[tuple[int, int]] = set()  # the moves between two layouts found possible
    asked_n = mesh.axis_size(axes[0]) if axes else 2  # (whether an op falls back: as the solvers were told)

    def move(v: Value, dst: Placements, before: torch.fx.Node) -> None:
        """Move ``v`` to ``dst`` before ``before``. Every layout held (``actual``'s) and wanted is one of
        ``layouts`` (interned, alive throughout), so a layout's id stands for it in the keys: comparing
        and hashing the placements themselves was most of a move's cost, and every block moves alike."""
        src = actual[v]
        if src is dst:
            return
        if (id(src), id(dst)) not in valid:
            if not reachable(src, dst):
                raise PlanError(
                    f"{before.target} wants %{v[0].name} as {dst} but it is {src}: no redistribution does that{user_line(before)}"
                )
            valid.add((id(src), id(dst)))
        key = (v, id(dst))
        if (listed := users.get(key)) is not None:
            listed.append(before)
            return
        users[key] = [before]
        t = meta_of(v)
        path = (tuple(t.shape), t.stride(), t.dtype, id(src), id(dst))  # (all collectives_of reads of t)
        if path not in paths:
            paths[path] = collectives_of(mesh, t, src, dst)
        moves[key] = Redistribution(v, src, dst, paths[path], before)

    def decision(
        node: torch.fx.Node, op: Any, fallback: bool, chosen_here: list[Any], arrived: list[Placements]
    ) -> NodePlan:
        """How an op that neither constrains nor is a region runs (its strategy as DTensor decides, or as vsf runs it)."""
        metas = outputs_meta(node)
        want_in, want_out = _wanted(chosen_here, len(arrived), metas)
        direct = op.kind == "value_blind"
        if direct or context_parallel.runs(mesh, node, want_in, want_out):
            pass  # the per-axis choices as they are (context parallel attention: vsf runs it, context_parallel.run)
        elif packed.runs(node, want_in, want_out):
            direct = True  # a packed split's chunks or their cat, on the local shards (packed.run)
        elif op.kind == "strategy" and not fallback:
            ins = problem.inputs[node]
            # an input that arrives split as wanted, in any nesting, is preferred as it arrives
            preferred = [
                a if [*map(one_d, a)] == [*map(one_d, w)] else nest(meta_of(v), w)
                for v, a, w in zip(ins, arrived, want_in)
            ] + [nest(t, w) for t, w in zip(metas, want_out)]
            decide_op = _balanced_decision if has_balanced([*arrived, *want_in, *want_out]) else _strategy_decision
            want_in, want_out, direct = decide_op(node, mesh, op, arrived, want_in, want_out, preferred, asked)
        inside = (
            context_parallel.collectives(mesh, node, want_in) if context_parallel.splits_sequence(node, want_in) else ()
        )
        return node_plan(want_in, want_out, op, fallback, direct, inside)

    def bound(node: torch.fx.Node, op: Any, fallback: bool, chosen_here: list[Any]) -> NodePlan:
        """How a ``with_sharding_constraint`` (its value as the constraint says) or a region's op runs."""
        ins = problem.inputs[node]
        want_in, want_out = _wanted(chosen_here, len(ins), outputs_meta(node))
        if op.kind == "constraint":
            s = constraint.parse(node.args[1])
            target = want_out[0] if any(e is UNCONSTRAINED for e in s.spec) else to_placements(s)
            return node_plan([target], [target], op, fallback, False, ())
        came = actual[ins[0]] if ins else None
        want_in, want_out = manual.placements(node, mesh, want_in, want_out, chosen, taken, came)
        return node_plan(want_in, want_out, op, fallback, True, manual.collectives(node, mesh, want_in))

    def node_plan(
        ins: Sequence[Placements], outs: Sequence[Placements | None], op: Any, fallback: bool, direct: bool, inside: Any
    ) -> NodePlan:
        """The op's plan, its layouts interned: one object per layout (the memo's key holds their ids)."""
        held = tuple(None if p is None else layouts.setdefault(p, p) for p in outs)
        return NodePlan(tuple(layouts.setdefault(p, p) for p in ins), held, op, fallback, direct, inside)

    solvers = [problem.solved[a] if on else None for a, on in zip(dm_axes, live)]
    placed = [(k, s.strategies, s.choice) for k, s in enumerate(solvers) if s is not None]
    for k, node in enumerate(problem.ops):
        ins = problem.inputs[node]
        op = problem.strategies.classes[node]
        fallback = bool(ins) and problem.strategies.of(node, asked_n)[1]
        if op.kind in ("constraint", "manual"):
            plan = bound(node, op, fallback, [None if s is None else s.placement_of(k) for s in solvers])
        else:
            # decided once per op signature and layouts (a model's repeated blocks ask the same): a
            # solver's choice is its strategy's placement codes (one placement object per code), and
            # every layout held is one object per value (interned), so the key holds the codes and
            # the layouts' ids (objects alive throughout); the signature sorts keyword arguments,
            # their order orders the tensor inputs
            metas = outputs_meta(node)
            shapes = tuple((tuple(t.shape), t.dtype) for t in metas if t is not None)
            kind = kinds.setdefault((problem.strategies.signature(node), tuple(node.kwargs), shapes, op), len(kinds))
            ids = [kind, fallback]
            for d, strategies, choice in placed:
                ids.append(d)
                ids.append(strategies[k][choice[k]])
            for v in ins:
                ids.append(id(actual[v]))
            key = tuple(ids)
            plan = decided.get(key)
            if plan is None:
                chosen_here = [None if s is None else s.placement_of(k) for s in solvers]
                plan = decided[key] = decision(node, op, fallback, chosen_here, [actual[v] for v in ins])
        if manual.inside(node) and op.kind != "manual":
            _local_over_manual(node, mesh, plan.ins, plan.outs)
        for v, dst in zip(ins, plan.ins):
            if actual[v] is not dst:  # (the same layout object: nothing moves)
                move(v, dst, node)
        plans[node] = plan
        for i, out in enumerate(plan.outs):
            if out is not None:
                actual[(node, i)] = out
    out_node = output_node(gm)
    outs = [value_of(a) for a in _compat.torch_tree_leaves(out_node.args)]
    final = []
    for v, want, ok in zip(outs, out_placements, unreduced):
        dst = (
            _kept_unreduced(dm_axes, actual[v], want, ok)
            if want is not None
            else _expressible(mesh, meta_of(v), actual[v])
        )
        dst = layouts.setdefault(dst, dst)
        move(v, dst, out_node)
        final.append(dst)
    return plans, [dataclasses.replace(r, users=tuple(users[key])) for key, r in moves.items()], final


def _wanted(
    chosen_here: Sequence[tuple[list[Any], list[Any]] | None], n_ins: int, metas: Sequence[torch.Tensor | None]
) -> tuple[list[Placements], list[Placements | None]]:
    """The per-axis choices of an op with ``n_ins`` tensor inputs and outputs ``metas`` (``None``: no
    tensor) combined: each input's and output's placements over every mesh dim (``chosen_here``: per
    mesh dim, the solver's ``(inputs, outputs)`` placements there, ``None`` where nothing was solved: ``R``).

    Example::

        >>> _wanted([([Shard(0)], [Shard(0)]), None], 1, [t])   # an elementwise op split on the first mesh dim
        ([(Shard(dim=0), Replicate())], [(Shard(dim=0), Replicate())])
    """
    want_in = [tuple(R if c is None else c[0][i] for c in chosen_here) for i in range(n_ins)]
    want_out = [
        None if t is None else tuple(R if c is None else c[1][i] for c in chosen_here) for i, t in enumerate(metas)
    ]
    return want_in, want_out


def _strategy_decision(
    node: torch.fx.Node,
    mesh: Mesh,
    op: Any,
    arrived: list[Placements],
    ins: list[Placements],
    outs: list[Placements | None],
    preferred: list[Placements | None],
    asked: dict[Any, Any],
) -> tuple[list[Placements], list[Placements | None], bool]:
    """How an op with a DTensor strategy runs, given the per-axis choices ``ins``/``outs`` and the
    layouts its inputs arrive with: directly on the local shards where its rule allows (strided
    shards kept as they arrive), else as DTensor decides. Returns the placements and whether it
    runs directly."""
    direct = op.local or (op.ragged_reduction and has_ragged(ins)) or batch_split_convolution(node, ins, outs)
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
    node: torch.fx.Node,
    mesh: Mesh,
    op: Any,
    arrived: list[Placements],
    ins: list[Placements],
    outs: list[Placements | None],
    preferred: list[Placements | None],
    asked: dict[Any, Any],
) -> tuple[list[Placements], list[Placements | None], bool]:
    """:func:`_strategy_decision` for an op some of whose operands arrive or are wanted split
    balanced: decided on the contiguous shards of the balanced view (the same local shards,
    :func:`as_contiguous`) and read back with every shard balanced on the mesh dims the per-axis
    choices split balanced (a rule on contiguous blocks holds on the balanced chunks when every
    operand holds the same ones: :func:`vsf.jit.strategies._balanced_variants`)."""
    dims = {k for p in [*ins, *outs] if p is not None for k, q in enumerate(p) if kind_of(q) == "balanced"}
    got_in, got_out, direct = _strategy_decision(
        node,
        mesh,
        op,
        [as_contiguous(p) for p in arrived],
        [as_contiguous(p) for p in ins],
        [as_contiguous(p) for p in outs],
        [as_contiguous(p) for p in preferred],
        asked,
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
                    raise PlanError(
                        f"{node.target} would split dim {b.dim} of {tuple(t.shape)} balanced over {mesh.device_axes[k]!r}, which does not cut it into equal chunks{user_line(node)}"
                    )
                out[k] = b
        return tuple(out)

    placed = [back(t, p) for t, p in zip(metas, [*got_in, *got_out])]
    return placed[: len(got_in)], placed[len(got_in) :], direct


def _local_over_manual(
    node: torch.fx.Node, mesh: Mesh, ins: Sequence[Placements], outs: Sequence[Placements | None]
) -> None:
    """A region's body op runs on each rank's values as they are over the region's manual axes:
    DTensor's decision on the full mesh must move nothing there."""
    r = manual.region_of(node)
    for k, a in enumerate(mesh.device_axes):
        if a in r.manual and any(p is not None and p[k] != R for p in [*ins, *outs]):
            raise PlanError(
                f"{node.target} in shard_map({r.name}) would need {list(ins)} -> {list(outs)}, which moves values over its manual axis {a!r}{user_line(node)}"
            )


def _keep_strided(
    actual: list[Placements],
    ins: list[Placements],
    outs: list[Placements | None],
    preferred: Sequence[Placements | None],
) -> tuple[list[Placements], list[Placements | None]]:
    """A per-mesh-dim strategy chosen with plain shards, applied to inputs that arrive with strided
    shards kept as they are: on each mesh dim where the inputs that keep their shard all carry the
    same split factor, every shard of the strategy takes it (DTensor fills its single-dim rules the
    same way), so an elementwise op on a ``P(("tp", "dp"))`` value moves nothing; an input that
    keeps a plain shard there (nested in mesh order) counts as a factor of its own, so a value of
    a strided input's shape that arrives split the plain way stays so. An input keeps its
    shard only if it also keeps the other mesh dims' splits of that tensor dim, which the factor
    counts (``dp``'s factor in ``P(("tp", "dp"))`` is ``tp``'s split: gathering ``tp`` and keeping
    ``dp`` strided is a move DTensor cannot make). ``preferred`` (per input, then per output: see
    :func:`_nested`) counts like an input arriving strided. A strided shard the per-axis solver
    chose (one axis's view of a merged dim: ``bmm`` on ``[b*h@tp, ...]``) counts as a plain shard
    here: its factor on the full mesh is the arriving value's (``[b@dp, h@tp]`` merged leaves tp
    a factor of ``b / dp``); where such an input arrives without a split of that dim, the op runs
    replicated on that mesh dim (the split the per-axis solver counted on was not made)."""
    unmet = {
        k
        for a, want in zip(actual, ins)
        for k, w in enumerate(want)
        if kind_of(w) == "strided" and not (is_shard(a[k]) and split_dim(a[k]) == w.dim)
    }
    flat = lambda p: [R if k in unmet else one_d(q) for k, q in enumerate(p)]  # noqa: E731
    ins, outs = [flat(p) for p in ins], [None if p is None else flat(p) for p in outs]
    for k in range(len(ins[0]) if ins else 0):
        factors = {
            split_factor(a[k])  # (None for a plain shard)
            for a, want in zip(actual, ins)
            if kind_of(a[k]) in ("strided", "shard")
            and isinstance(want[k], Shard)
            and want[k].dim == a[k].dim
            and all(
                one_d(w) == one_d(b)
                for j, (b, w) in enumerate(zip(a, want))
                if j != k and is_shard(b) and split_dim(b) == a[k].dim
            )
        } | {p[k].split_factor for p in preferred if p is not None and kind_of(p[k]) == "strided"}
        if len(factors) != 1 or None in factors:
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
    in a layout a spec can name (a nesting of strided shards that none names is gathered; a
    strided shard of a dim no other mesh dim splits is a packed split, ``vsf.packed``, and stays:
    a packed weight's gradient, a view merging a dim split over one axis into a larger one)."""
    out = tuple(R if isinstance(p, Partial) else p for p in placements)
    try:
        from_placements(mesh, out, t.ndim)
    except ValueError:
        return tuple(R if split_factor(p) is not None else p for p in out)
    return out


def _ordered(mesh: Mesh, t: torch.Tensor, placements: Placements, chosen: manual.Orders | None) -> Placements | None:
    """``placements`` (plain shards: several mesh dims that split one tensor dim nest in mesh order)
    with those mesh dims nested in the ``chosen`` order instead, where it differs (the order the
    plan takes the tokens of an ``any_order`` region in: the values on their way to it and back
    nested alike); ``None`` where nothing changes."""
    if not chosen or any(kind_of(p) not in ("replicate", "shard", "partial") for p in placements):
        return None
    try:
        s = from_placements(mesh, placements, t.ndim)
    except ValueError:
        return None
    ordered = tuple(manual.reordered(s, chosen).placements)
    return ordered if ordered != tuple(placements) else None


def _input_nestings(
    gm: torch.fx.GraphModule, in_placements: Sequence[Placements]
) -> dict[tuple[int, ...], list[Placements]]:
    """The strided layouts of the graph's inputs, by shape: a ZeRO state leaf ``P(("fsdp", "dp"))``
    nests ``dp`` inside ``fsdp``, against mesh order."""
    found: dict[tuple[int, ...], list[Placements]] = {}
    for ph, pl in zip(placeholders_of(gm), in_placements):
        same_shape = found.setdefault(tuple(ph.meta["val"].shape), [])
        if has_strided([pl]) and tuple(pl) not in same_shape:
            same_shape.append(tuple(pl))
    return found


def _nested(
    nestings: dict[tuple[int, ...], list[Placements]], t: torch.Tensor, placements: Placements
) -> Placements | None:
    """The strided layout of an input of ``t``'s shape whose mesh dims split the same tensor dims
    as ``placements`` do (in mesh order), if there is one: values shaped like a ZeRO state leaf
    (its gradient, its update) are split as the state is, so they reach it without regathering.
    ``None`` if there is none."""
    candidates = nestings.get(tuple(t.shape))
    if not candidates or has_strided([placements]):
        return None
    plain = tuple(one_d(p) for p in placements)
    return next((pl for pl in candidates if tuple(one_d(p) for p in pl) == plain), None)
