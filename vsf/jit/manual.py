"""Manual regions (``vsf.shard_map`` inside ``jit``) as the planner and the lowering see them.

A region node (:mod:`vsf.ops.region`) is planned with exactly one strategy: its inputs take the
region's ``in_specs`` and its results its ``out_specs`` (the propagator redistributes into and out
of them, as around a ``with_sharding_constraint``). Its backward node takes the inputs and the
results' cotangents laid out the same way and gives each input's gradient that input's layout,
``Partial`` (a sum) over the manual axes its spec replicates. The collectives the body runs are the
program's: they come from the region, found when it was traced. A forward node keeps its
autograd graph for its backward node, which runs only the transposed collectives.

Example::

    >>> ins, outs = placements(region_node, mesh)
    >>> [c.kind for c in collectives(region_node)]
    ['all_reduce']
"""

from __future__ import annotations

import torch
import torch.fx
from vsf.errors import PlanError
from vsf.jit.graph import GETITEM, outputs_meta, user_line
from vsf.jit.plan import Collective, Placements, one_d, to_placements
from vsf.jit.strategies import Strategy
from vsf.ops.region import REGION_OP, REGION_VJP_OP, Region, lookup, summed_over
from vsf.sharding.mesh import Mesh

__all__ = ["collectives", "placements", "run", "strategy_on"]


def _region(node: torch.fx.Node) -> Region:
    return lookup(node.args[-1])


def placements(node: torch.fx.Node, mesh: Mesh) -> tuple[list[Placements], list[Placements]]:
    """The placements a region node (or its backward) takes its tensor inputs in and gives its
    results in; a ``PlanError`` if the region's mesh is not the one the step is planned over."""
    r = _region(node)
    if r.mesh != mesh:
        raise PlanError(f"shard_map({r.name}) runs on {r.mesh!r}, but the jitted step is planned over {mesh!r}{user_line(node)}: give the region the step's mesh")
    ins = [to_placements(s) for s in r.ins]
    outs = [to_placements(s) for s in r.outs]
    if node.target is REGION_OP:
        return ins, outs
    grads = [summed_over(s, r.manual) if t is not None and t.is_floating_point() else pl for s, pl, t in zip(r.ins, ins, outputs_meta(node))]
    return ins + outs, grads


def strategy_on(node: torch.fx.Node, mesh: Mesh, axis: str) -> Strategy:
    """The one strategy a region node has on mesh axis ``axis``."""
    k = list(mesh.device_axes).index(axis)
    ins, outs = placements(node, mesh)
    return Strategy(tuple(one_d(p[k]) for p in ins), tuple(one_d(p[k]) for p in outs))


def collectives(node: torch.fx.Node) -> tuple[Collective, ...]:
    """The collectives a region node's body runs on each rank; for a backward node, the transposed
    ones (preceded by the forward's when the forward node is not in the program to keep its graph)."""
    r = _region(node)
    if node.target is REGION_OP:
        sent = r.sent
    else:
        sent = r.sent_vjp if _partner(node) is not None else r.sent + r.sent_vjp
    return tuple(Collective(s.kind, s.axis, s.shape, s.dtype, s.bytes) for s in sent)


def run(node: torch.fx.Node, args: tuple) -> list[torch.Tensor]:
    """A region node on this rank's local shards (``args``: the node's arguments, tensors local).
    A forward node whose backward node is in the program keeps its autograd graph for it; a
    backward node computes only the gradients the program reads."""
    r = _region(node)
    if node.target is not REGION_OP:
        return r.vjp(args[0], args[1], {u.args[1] for u in node.users if u.target is GETITEM})
    return r.run_for_vjp(args[0]) if _partner(node) is not None else r.run(args[0])


def _partner(node: torch.fx.Node) -> torch.fx.Node | None:
    """The other node of the same region call (forward <-> backward) in the graph, if any."""
    return next((n for n in node.graph.nodes if n is not node and n.op == "call_function"
                 and n.target in (REGION_OP, REGION_VJP_OP) and n.args[-1] == node.args[-1]), None)
