"""Manual regions (``vsf.shard_map`` inside ``jit``) as the planner and the lowering see them.

A region is traced into the step's graph (:mod:`vsf.ops.region`): boundary ops where values
enter and leave it, its body's ops in between, its collectives as ``manual_collective`` nodes.
:func:`mark` finds the body's nodes. Over the region's **manual** axes each body value is what
this rank holds (the solver sees ``Replicate``: the op runs as it is on the local value, nothing
moves), and the boundary ops take and give the region's ``in_specs`` / ``out_specs``, so the
propagator redistributes into and out of them as around a ``with_sharding_constraint``
(:func:`fixed_on`). Over the **automatic** axes (those ``axis_names`` leaves out) the body's ops
are planned like every other op of the step; a boundary op or a collective keeps any layout that
leaves the dims it moves whole (:func:`auto_strategies`), so each rank runs it on its piece.
An ``any_order`` region's specs may take the axes that split one dim together in another order
(:func:`orders`): the per-axis choices hold for every order, and the planner combines them once per
order where the order as written makes the plan move values between nestings (:func:`reorders`),
and once more with the entries split as the values arrive (:mod:`vsf.jit.arrivals`: a strided
shard included, such as the tokens ``[batch@ep, seq@cp]`` merged into one dim leave on a
``("cp", "ep")`` mesh), keeping the plan that moves the fewest bytes.

Example::

    >>> mark(gm, constant_nodes(gm.graph)); [n.name for n in op_nodes(gm) if inside(n)]
    ['manual_in', 'mm', 'relu', 'mm_1', 'manual_collective']
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Shard

from vsf.errors import PlanError
from vsf.jit import arrivals
from vsf.jit.arrivals import ENTERING as _ENTER
from vsf.jit.arrivals import KINDS as _KINDS
from vsf.jit.cost import local_shape
from vsf.jit.graph import meta_of, op_nodes, outputs_meta, tensor_args, user_line
from vsf.jit.plan import R, Collective, Placements, Redistribution, one_d
from vsf.jit.strategies import Strategy
from vsf.ops.collectives import rebound
from vsf.ops.region import (
    AXIS_INDEX_OP,
    COLLECTIVE_OPS,
    EXCHANGE_OP,
    REGION_OPS,
    Region,
    call,
    copies,
    lookup,
    summed_over,
)
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import P

__all__ = [
    "Orders",
    "auto_strategies",
    "collectives",
    "fixed_on",
    "inside",
    "mark",
    "orders",
    "placements",
    "region_of",
    "reordered",
    "reorders",
    "run",
]

# the order chosen for the axes (of size > 1) of the multi-axis spec entries of ``any_order`` regions, by their set
Orders = Mapping[frozenset[str], tuple[str, ...]]

_TAG = "vsf_region"


def _key(node: torch.fx.Node) -> int | None:
    """The key of the region a region op belongs to (``None`` for any other op)."""
    if node.target in _KINDS:
        return node.args[1]
    if node.target in COLLECTIVE_OPS or node.target is AXIS_INDEX_OP:
        return call(node.args[-1]).region
    return None


def region_of(node: torch.fx.Node) -> Region | None:
    """The region whose body computes ``node``'s values (after :func:`mark`), if any.

    Example::

        >>> region_of(mm_node).manual
        ('tp',)
    """
    key = node.meta.get(_TAG)
    return None if key is None else lookup(key)


def inside(node: torch.fx.Node) -> bool:
    """Are ``node``'s values a region's body values (local over its manual axes)? (after :func:`mark`)

    Example::

        >>> inside(mm_node), inside(loss_node)
        (True, False)
    """
    return _TAG in node.meta


def mark(gm: torch.fx.GraphModule, constants: frozenset[torch.fx.Node]) -> None:
    """Tag the ops of ``gm`` that compute a region's body values: those a boundary op into the
    region or a collective starts, and every op computed from them up to the boundary ops out.
    A body op that reads a value computed outside the region (not a constant) is a ``PlanError``:
    the body sees only what it was given; so is a result that varies over a manual axis its spec
    replicates it over (:func:`_check_replicated`).

    Example::

        >>> mark(gm, constant_nodes(gm.graph))
    """
    varying: dict[torch.fx.Node, frozenset[str]] = {}  # the manual axes each body value may differ over
    first: dict[tuple[Any, ...], int] = {}  # each region's key by what it is (:func:`_same_region`)
    for node in op_nodes(gm):
        node.meta.pop(_TAG, None)
        own = _key(node)
        if own is None and not varying:  # (no body value yet for it to read: the ops before any region)
            continue
        own = None if own is None else first.setdefault(_same_region(lookup(own)), own)
        found = {p.meta[_TAG] for p, _ in tensor_args(node) if _TAG in p.meta}
        kind = _KINDS.get(node.target)
        if kind == "manual_out":
            _check_replicated(node, varying)
        if kind in ("manual_out", "manual_in_grad"):  # their results are outside
            continue
        keys = found | ({own} if own is not None else set())
        if not keys:
            continue
        if len(keys) > 1:
            names = " and ".join(sorted(f"shard_map({lookup(k).name})" for k in keys))
            raise PlanError(
                f"{node.target} computes with values of {names} at once{user_line(node)}: pass values between regions as their results and arguments"
            )
        key = keys.pop()
        outer = [p for p, _ in tensor_args(node) if _TAG not in p.meta and p not in constants]
        if outer and node.target not in _ENTER:
            raise PlanError(
                f"shard_map({lookup(key).name}): {node.target} reads %{outer[0].name}, a value computed outside the region"
                f"{user_line(node)}; pass it to the region as an argument (with its in_specs)"
            )
        node.meta[_TAG] = key
        varying[node] = _varies(node, varying)


def _same_region(r: Region) -> tuple[Any, ...]:
    """What region ``r`` is, for the ops that compute with its body's values: activation
    checkpointing calls a region's function again in the backward (a new region of the same name,
    mesh, axes and argument specs; torch stops the recompute once it has the values the backward
    saved, so the new region may have no results), whose recomputed body values the backward of the
    first call's body reads with its own. (A model's blocks calling one region's function are one
    region so too: each rank's body values mean the same in all.)"""
    return (r.name, r.mesh, r.manual, r.ins, r.check_vma, r.any_order)


def _varies(node: torch.fx.Node, varying: dict[torch.fx.Node, frozenset[str]]) -> frozenset[str]:
    """The manual axes over which body value ``node`` may differ from rank to rank (JAX's "varying
    manual axes"): an argument over those its spec splits it over, a cotangent over those its
    result's spec splits; a collective over axis ``a`` adds ``a`` (``ppermute``, ``all_to_all``,
    ``psum_scatter``) or removes it (``psum``, ``all_gather``, ``pmax``), ``axis_index`` is ``a``;
    any other op varies where its operands do."""
    kind = _KINDS.get(node.target)
    if kind is not None:
        r = lookup(node.args[1])
        return frozenset(a for a in r.manual if a in r.sharding(kind, node.args[2]).spec.axes)
    if node.target is AXIS_INDEX_OP:
        return frozenset({call(node.args[-1]).op.g.axis})
    operands = frozenset().union(*(varying.get(p, frozenset()) for p, _ in tensor_args(node)))
    if node.target in COLLECTIVE_OPS:
        op = call(node.args[-1]).op
        return operands - {op.g.axis} if op.replicates else operands | {op.g.axis}
    return operands


def _check_replicated(node: torch.fx.Node, varying: dict[torch.fx.Node, frozenset[str]]) -> None:
    """A region's result (``manual_out`` node) may vary only over the manual axes its spec splits."""
    r, i = lookup(node.args[1]), node.args[2]
    ((p, _),) = tensor_args(node)
    extra = sorted(varying.get(p, frozenset()) - set(r.outs[i].spec.axes))
    if extra and r.check_vma:
        raise PlanError(
            f"shard_map({r.name}): {r.out_names[i]} varies over {extra[0]!r}, but out_specs gives it {r.outs[i].spec!r}, which says it is the same "
            f"on every rank of {extra[0]!r}{user_line(node)}: reduce it over {extra[0]!r} (psum, pmean, all_gather), give it a spec that splits "
            f"over {extra[0]!r}, or pass check_vma=False if it is the same there by construction"
        )


def _manual_dim(node: torch.fx.Node, mesh: Mesh, axis: str) -> tuple[Region, int] | None:
    """The region ``node`` belongs to and the position of ``axis`` among the mesh dims, if ``axis``
    is one of that region's manual axes (else ``None``)."""
    key = _key(node) if node.target in REGION_OPS else node.meta.get(_TAG)
    if key is None:
        return None
    r = lookup(key)
    if r.mesh != mesh:
        raise PlanError(
            f"shard_map({r.name}) runs on {r.mesh!r}, but the jitted step is planned over {mesh!r}{user_line(node)}: give the region the step's mesh"
        )
    return (r, list(mesh.device_axes).index(axis)) if axis in r.manual else None


def fixed_on(node: torch.fx.Node, mesh: Mesh, axis: str, as_they_arrive: bool = False) -> list[Strategy] | None:
    """The strategies ``node`` has on mesh axis ``axis`` if that axis is manual in ``node``'s
    region: a boundary op takes (or gives) the region's spec and gives (or takes) the value as
    this rank holds it; every other op of the body runs on the values as they are. ``None`` for
    an automatic axis, or an op outside every region. With ``as_they_arrive`` (the plan weighs an
    ``any_order`` region's entries taken as they arrive: :mod:`vsf.jit.arrivals`), a boundary op
    of a multi-axis entry also takes or gives it as each strided shard of that dim on ``axis``
    (one axis's view of the tokens ``[batch@ep, seq@cp]`` merged: ``S(0)/sf4`` on cp).

    Example::

        >>> fixed_on(manual_in_node, mesh, "tp")     # in_specs P(None, "tp")
        [Strategy(ins=(Shard(dim=1),), outs=(Replicate(),))]
    """
    found = _manual_dim(node, mesh, axis)
    if found is None:
        return None
    r, k = found
    ins = tuple(R for _ in tensor_args(node))
    outs = tuple(None if t is None else R for t in outputs_meta(node))
    kind = _KINDS.get(node.target)
    if kind is None:
        return [Strategy(ins, outs)]
    s = r.sharding(kind, node.args[2])
    spec = one_d(s.placements[k]) if kind != "manual_in_grad" else one_d(summed_over(s, r.manual)[k])
    choices = [spec]
    if as_they_arrive and r.any_order and isinstance(spec, Shard) and len(arrivals.split_axes(s, spec.dim)) > 1:
        choices += arrivals.strided_splits(node, spec.dim, mesh.axis_size(axis))
    if node.target in _ENTER:
        return [Strategy((c,), (R,)) for c in choices]
    return [Strategy((R,), (c,)) for c in choices]


def orders(gm: torch.fx.GraphModule) -> list[dict[frozenset[str], tuple[str, ...]]]:
    """The orders the planner may take the multi-axis spec entries of ``gm``'s ``any_order``
    regions in (every permutation of each set of axes that splits one dim together), the specs as
    written first; ``[{}]`` where there is none. One choice holds for every such region of the step.

    Example::

        >>> orders(gm)      # an expert dispatch over the tokens P(("cp", "ep"))
        [{frozenset({'cp', 'ep'}): ('cp', 'ep')}, {frozenset({'cp', 'ep'}): ('ep', 'cp')}]
    """
    written: dict[frozenset[str], tuple[str, ...]] = {}
    for _, _, axes in arrivals.entries(gm):
        written.setdefault(frozenset(axes), axes)
    choices = itertools.product(*(itertools.permutations(axes) for axes in written.values()))
    return [dict(zip(written, choice)) for choice in choices]


def reorders(mesh: Mesh, moved: Sequence[Redistribution], sets: Sequence[frozenset[str]]) -> bool:
    """Does a plan with the redistributions ``moved`` move a value between two nestings of one of
    the axis ``sets`` splitting a dim (``P(("ep", "dp"))`` to ``P(("dp", "ep"))``, or the strided
    shards a view merging two split dims leaves to blocks)? Only then may another order of the
    ``any_order`` regions' specs, or their entries taken as they arrive, move less: where none
    does, the values keep the nesting the plan gave them, and the others are not planned.

    Example::

        >>> reorders(mesh, plan.redistributions, [frozenset({"dp", "ep"})])  # ep-major tokens regathered
        True
    """

    def renests(r: Redistribution) -> bool:
        before, after = arrivals.dims_over(mesh, r.src), arrivals.dims_over(mesh, r.dst)
        return any(
            axes in sets
            and after.get(d) == axes
            and any(p != q for p, q, a in zip(r.src, r.dst, mesh.device_axes) if a in axes)
            for d, axes in before.items()
        )

    return any(renests(r) for r in moved)


def reordered(s: NamedSharding, chosen: Orders) -> NamedSharding:
    """``s`` with each multi-axis entry's axes in the ``chosen`` order (any axis of size 1 after them).

    Example::

        >>> reordered(NamedSharding(mesh, P(("cp", "ep"))), {frozenset({"cp", "ep"}): ("ep", "cp")}).spec
        P(('ep', 'cp'))
    """
    entries = []
    for d, entry in enumerate(s.spec):
        order = chosen.get(frozenset(arrivals.split_axes(s, d)))
        rest = tuple(a for a in s.spec.entry_axes(d) if order is not None and a not in order)
        entries.append(entry if order is None else order + rest)
    return NamedSharding(s.mesh, P(*entries, unreduced=s.spec.unreduced))


def placements(
    node: torch.fx.Node,
    mesh: Mesh,
    ins: list[Placements],
    outs: list[Placements | None],
    chosen: Orders | None = None,
    taken: arrivals.Taken | None = None,
    arrived: Placements | None = None,
) -> tuple[list[Placements], list[Placements | None]]:
    """A region op's placements on the full mesh: the per-axis choices (``ins``, ``outs``), with a
    boundary op's spec side exactly as its sharding has it (a strided shard of a multi-axis entry),
    its entries' axes in the ``chosen`` order in an ``any_order`` region (:func:`orders`). With
    ``taken`` (where :func:`vsf.jit.arrivals.takes_arrivals`), an ``any_order`` region's
    multi-axis entries are split as the first of them arrived instead (``arrived``: how the value
    a boundary op brings in is split), a strided shard included: no value is regathered on its
    way in.

    Example::

        >>> placements(manual_in_node, mesh, [(Shard(0), Shard(1))], [(Shard(0), Replicate())])
        ([(Shard(dim=0), Shard(dim=1))], [(Shard(dim=0), Replicate())])
    """
    kind = _KINDS.get(node.target)
    if kind is None:
        return ins, outs
    r = lookup(node.args[1])
    s = r.sharding(kind, node.args[2])
    if r.any_order and chosen:
        s = reordered(s, chosen)
    exact = summed_over(s, r.manual) if kind == "manual_in_grad" else tuple(s.placements)
    if r.any_order and taken is not None:
        exact = arrivals.taken_as(node, s, exact, taken, arrived if node.target in _ENTER else None)
    manual = [k for k, a in enumerate(mesh.device_axes) if a in r.manual]

    def spec_side(p: Placements) -> Placements:
        return tuple(exact[k] if k in manual else q for k, q in enumerate(p))

    if kind in ("manual_in", "manual_out_grad"):
        return [spec_side(ins[0])], outs
    return ins, [spec_side(outs[0])]


def auto_strategies(node: torch.fx.Node, n: int) -> list[Strategy]:
    """A region op's strategies on an automatic axis of ``n`` ranks: replicated, a partial sum
    where the op is linear, or split on any dim it leaves whole (each rank runs it on its piece).

    Example::

        >>> [st.ins for st in auto_strategies(psum_node, 2)]     # on a [8, 4] operand
        [(Replicate(),), (Partial(sum),), (Shard(dim=0),), (Shard(dim=1),)]
    """
    if node.target is AXIS_INDEX_OP:
        return [Strategy((), (R,))]
    counts = (R,) * (len(tensor_args(node)) - 1)  # an exchange's row counts: the same on every rank of the axis
    if node.target in COLLECTIVE_OPS:
        op = call(node.args[-1]).op
        moves, partials = {d % meta_of(tensor_args(node)[0]).ndim for d in op.moves}, op.passes_partials
    else:
        r = lookup(node.args[1])
        s = r.sharding(_KINDS[node.target], node.args[2])
        moves, partials = {d for d in range(len(s.spec)) if s.num_shards(d) > 1}, True
    x, y = meta_of(tensor_args(node)[0]), outputs_meta(node)[0]
    out = [Strategy((R, *counts), (R,))] + ([Strategy((Partial(), *counts), (Partial(),))] if partials else [])
    return out + [
        Strategy((Shard(d), *counts), (Shard(d),))
        for d in range(x.ndim)
        if d not in moves and x.shape[d] >= n and y.shape[d] >= n
    ]


def collectives(node: torch.fx.Node, mesh: Mesh, ins: list[Placements]) -> tuple[Collective, ...]:
    """The collective a ``manual_collective`` node runs, on this rank's piece of its operand
    (laid out as ``ins[0]`` over the automatic axes); none for the other region ops.

    Example::

        >>> collectives(psum_node, mesh, [(Shard(0), Replicate())])    # [8, 4] over dp=2
        (Collective(kind='all_reduce', axis='tp', shape=(4, 4), dtype=torch.float32, bytes=64),)
    """
    if node.target not in COLLECTIVE_OPS:
        return ()
    x = meta_of(tensor_args(node)[0])
    s = call(node.args[-1]).op.abstract(torch.empty(local_shape(mesh, x, ins[0]), dtype=x.dtype, device="meta"))[1]
    return (Collective(s.kind, s.axis, s.shape, s.dtype, s.bytes, s.most),)


def run(node: torch.fx.Node, args: tuple) -> torch.Tensor:
    """A region op on this rank's local values (``args``: the node's arguments, tensors local):
    a collective over its manual axis; a boundary op moves nothing (a cotangent coming in for a
    result its spec replicates is split among the ranks that hold it).

    Example::

        >>> run(psum_node, (local_block, key))    # this rank's sum over tp
    """
    if node.target is AXIS_INDEX_OP:
        return rebound(call(args[-1]).op)()
    if node.target is EXCHANGE_OP:
        return rebound(call(args[-1]).op)(args[0], args[1])
    if node.target in COLLECTIVE_OPS:
        return rebound(call(args[-1]).op)(args[0])
    if _KINDS[node.target] == "manual_out_grad":
        r = lookup(args[1])
        k = copies(r.outs[args[2]], r.manual)
        return args[0] / k if k > 1 else args[0]
    return args[0]
