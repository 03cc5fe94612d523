"""An ``any_order`` region's multi-axis entries taken as the values arrive: the planner's third
way to take the specs of a region whose body does not care which rank holds which block of a dim
split over several axes (an expert dispatch), besides their orders (:func:`vsf.jit.manual.orders`).
The tokens ``[batch@ep, seq@cp]`` merged into rows on a ``("cp", "ep")`` mesh are ``S(0)/sf4`` over
cp and ``S(0)`` over ep, a nesting neither order of ``P(("cp", "ep"))`` names: taken so, nothing
regathers them on their way in or out. Each axis is solved with the region's boundary ops free to
split those entries as any strided shard (:func:`strided_splits`, :func:`leaves_strided` for the
ops they feed), then again with one layout for every such entry, the first's as it arrived
(:func:`as_arrived`), and the combined plan takes that layout (:func:`taken_as`); propagate keeps
it where it moves fewer bytes.

Example::

    >>> takes_arrivals(gm)      # an expert dispatch: tokens, routing and result all [tokens, ...]
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Placement

from vsf._compat import StridedShard
from vsf.jit.graph import meta_of, op_nodes, outputs_meta, tensor_args
from vsf.jit.plan import Placements
from vsf.jit.strategies import Strategy
from vsf.ops.region import BOUNDARY_OPS, lookup
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.placement import is_shard, kind_of, split_dim

__all__ = [
    "ENTERING",
    "KINDS",
    "Taken",
    "as_arrived",
    "dims_over",
    "entries",
    "leaves_strided",
    "outside",
    "split_axes",
    "strided_splits",
    "taken_as",
    "takes_arrivals",
]

KINDS = {op: kind for kind, op in BOUNDARY_OPS.items()}  # a boundary op's kind, by its op
ENTERING = frozenset({BOUNDARY_OPS["manual_in"], BOUNDARY_OPS["manual_out_grad"]})  # their results are body values
# how an ``any_order`` region takes each of its multi-axis entries (:func:`vsf.jit.manual.placements`),
# by (region key, the entry's axes): the placements of those axes' mesh dims
Taken = dict[tuple[int, frozenset[str]], Placements]


def outside(node: torch.fx.Node) -> torch.Tensor:
    """The value a boundary op moves as it is outside the region (inside, each rank's block)."""
    return meta_of(tensor_args(node)[0]) if node.target in ENTERING else outputs_meta(node)[0]


def split_axes(s: NamedSharding, d: int) -> tuple[str, ...]:
    """The axes of size > 1 that split dim ``d`` of a value laid out as ``s``, major to minor."""
    return tuple(a for a in s.spec.entry_axes(d) if s.mesh.axis_size(a) > 1)


def entries(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, int, tuple[str, ...]]]:
    """The multi-axis spec entries of ``gm``'s ``any_order`` regions: each boundary op, the tensor
    dim its spec splits over several axes (of size > 1), and those axes, major to minor."""
    for node in op_nodes(gm):
        kind = KINDS.get(node.target)
        r = lookup(node.args[1]) if kind is not None else None
        if r is None or not r.any_order:
            continue
        s = r.sharding(kind, node.args[2])
        for d in range(len(s.spec)):
            axes = split_axes(s, d)
            if len(axes) > 1:
                yield node, d, axes


def takes_arrivals(gm: torch.fx.GraphModule) -> bool:
    """May ``gm``'s ``any_order`` regions take their multi-axis entries split as they arrive
    (:func:`vsf.jit.manual.placements` with ``taken``), strided shards included? Where every entry
    of a region split over one set of axes is the same dim of the same size (the tokens, their
    routing, their result: the body pairs their rows, so one layout must hold for all of them).

    Example::

        >>> takes_arrivals(gm)      # an expert dispatch: tokens, routing and result all [tokens, ...]
        True
    """
    seen: dict[tuple[int, frozenset[str]], tuple[int, int]] = {}
    for node, d, axes in entries(gm):
        here = (d, outside(node).shape[d])
        if seen.setdefault((node.args[1], frozenset(axes)), here) != here:
            return False
    return True


def strided_splits(node: torch.fx.Node, d: int, n: int) -> list[Placement]:
    """Every strided shard of dim ``d`` of the value boundary op ``node`` moves, over ``n`` ranks."""
    rows = outside(node).shape[d] // n
    return [StridedShard(d, split_factor=f) for f in range(2, rows + 1) if rows % f == 0]


def leaves_strided(node: torch.fx.Node, n: int) -> tuple[tuple[Placement, ...], ...]:
    """Per output of the region op ``node``, the strided shards it may give on a manual axis of
    ``n`` ranks when the plan weighs an ``any_order`` region's entries taken as they arrive
    (:func:`vsf.jit.manual.fixed_on` with ``as_they_arrive``): a result or a cotangent leaving the
    region split over several axes on one dim; nothing for the other ops. What the ops it feeds
    may take (the expert dispatch's result ``S(0)/sf4`` on cp, viewed back to the tokens
    ``[batch@ep, seq@cp]``).

    Example::

        >>> leaves_strided(manual_out_node, 2)     # out_specs P(("cp", "ep")) of 64 rows
        ((_StridedShard(dim=0, sf=2), _StridedShard(dim=0, sf=4), ...),)
    """
    kind = KINDS.get(node.target)
    r = lookup(node.args[1]) if kind is not None and node.target not in ENTERING else None
    if r is None or not r.any_order:
        return tuple(() for _ in outputs_meta(node))
    s = r.sharding(kind, node.args[2])
    return (tuple(p for d in range(len(s.spec)) if len(split_axes(s, d)) > 1 for p in strided_splits(node, d, n)),)


def as_arrived(
    ops: Sequence[torch.fx.Node], fixed: Mapping[str, Mapping[torch.fx.Node, list[Strategy]]], solved: Mapping[str, Any]
) -> dict[str, dict[torch.fx.Node, list[Strategy]]]:
    """The fixed strategies (:func:`vsf.jit.manual.fixed_on` with ``as_they_arrive``) with each
    boundary op of an ``any_order`` region's multi-axis entry left the one that splits it on each
    axis as the axis solvers (``solved``) split the first such entry of that dim and size there,
    in any region (the tokens as they arrive at the first MoE layer's dispatch): one layout for all
    the entries' values, which a body pairs row for row (:func:`vsf.jit.manual.placements`)."""
    out: dict[str, dict[torch.fx.Node, list[Strategy]]] = {}
    for axis, strategies in fixed.items():
        first: dict[tuple[int, int], Any] = {}
        out[axis] = {}
        for k, node in enumerate(ops):
            choices = strategies.get(node)
            if choices is None:
                continue
            if len(choices) > 1:
                enters = node.target in ENTERING
                ins, outs = solved[axis].placement_of(k)
                d = choices[0].ins[0].dim if enters else choices[0].outs[0].dim
                want = first.setdefault((d, outside(node).shape[d]), ins[0] if enters else outs[0])
                choices = [st for st in choices if (st.ins[0] if enters else st.outs[0]) == want] or choices
            out[axis][node] = choices
    return out


def dims_over(mesh: Mesh, placements: Placements) -> dict[int, frozenset[str]]:
    """The axes (of size > 1) whose mesh dims split each tensor dim, in any nesting."""
    out: dict[int, set[str]] = {}
    for p, a in zip(placements, mesh.device_axes):
        if is_shard(p) and mesh.axis_size(a) > 1:
            out.setdefault(split_dim(p), set()).add(a)
    return {d: frozenset(axes) for d, axes in out.items()}


def taken_as(
    node: torch.fx.Node, s: NamedSharding, exact: Placements, taken: Taken, arrived: Placements | None
) -> Placements:
    """``exact``, a boundary op's spec side, with the mesh dims of each multi-axis entry split as
    ``taken`` has it for the region and those axes: as the first value split over them arrived
    (``arrived``, where ``node`` brings it in split over the same axes, plain or strided shards;
    else as written). One layout for the region's every such entry, its results and cotangents
    too: the body pairs their rows."""
    out = list(exact)
    for d in range(len(s.spec)):
        axes = split_axes(s, d)
        if len(axes) < 2:
            continue
        dims = [list(s.mesh.device_axes).index(a) for a in axes]
        key = (node.args[1], frozenset(axes))
        if key not in taken:
            came = (
                arrived is not None
                and dims_over(s.mesh, arrived).get(d) == key[1]
                and all(kind_of(arrived[k]) in ("shard", "strided") for k in dims)
            )
            taken[key] = tuple((arrived if came else exact)[k] for k in dims)
        for k, p in zip(dims, taken[key]):
            out[k] = p
    return tuple(out)
