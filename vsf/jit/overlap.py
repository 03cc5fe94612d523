"""Overlap in the lowered program: each collective is waited for at its result's first use, not
where it is issued, so the ops in between run while it communicates (a gradient bucket's
all-reduce under the rest of the backward, as DDP's hooks do).

The lowered program (:func:`vsf.jit.lower.compile_local`) issues a functional collective and
waits for it right away; :func:`wait_late` moves each ``wait_tensor``, with the views that only
reshape its result, down to just before the first op that computes with it. A wait never moves
past an op that writes its arguments in place (the donated-buffer updates), so nothing a
collective may still read or write is touched before it is done.

Example::

    >>> gm = wait_late(reuse_donated(compile_local(plan, locals_in), locals_in, donated))
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from vsf import _compat

__all__ = ["wait_late"]

aten = torch.ops.aten

# ops that only reshape a value: they move down with the wait whose result they view
_RESHAPES = frozenset({operator.getitem, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.split.Tensor,
                       aten.split_with_sizes.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.alias.default})


def _is_wait(node: torch.fx.Node) -> bool:
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    return schema is not None and schema.name == "_c10d_functional::wait_tensor"


def _writes_in_place(node: torch.fx.Node) -> bool:
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def wait_late(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every collective's wait (and the reshapes of its result) just before the first
    op that computes with it, never past an in-place op; returns ``gm``, recompiled."""
    nodes = list(gm.graph.nodes)
    moving = set()
    for n in nodes:
        if _is_wait(n) or (n.op == "call_function" and n.target in _RESHAPES and n.all_input_nodes and all(a in moving for a in n.all_input_nodes)):
            moving.add(n)
    barrier_after: dict[torch.fx.Node, torch.fx.Node | None] = {}
    next_barrier = None
    for n in reversed(nodes):
        barrier_after[n] = next_barrier
        if _writes_in_place(n) or n.op == "output":
            next_barrier = n
    for n in reversed(nodes):
        if n not in moving:
            continue
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
        target = min(n.users, key=order.__getitem__, default=None)
        stop = barrier_after[n]
        if stop is not None and (target is None or order[stop] < order[target]):
            target = stop
        if target is not None and order[target] > order[n] + 1:
            target.prepend(n)
    gm.recompile()
    return gm
