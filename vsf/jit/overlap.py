"""Overlap in the lowered program: each collective is waited for at its result's first use, not
where it is issued, so the ops in between run while it communicates (a gradient bucket's
all-reduce under the rest of the backward, as DDP's hooks do).

The lowered program (:func:`vsf.jit.lower.compile_local`) issues a functional collective and
waits for it right away; :func:`wait_late` moves each ``wait_tensor``, with the views that only
reshape its result, down to just before the first op that computes with it. A wait never moves
past an op that writes in place a buffer the collective reads or writes (a donated param's
update after its gather: buffers are told apart by the op that allocated them, a view's by its
inputs'), so nothing a collective may still read or write is touched before it is done; the
in-place updates of other buffers (a backward's accumulations, an in-place all-reduce of a
bucket of its own) do not hold it back. An all-gather or reduce-scatter is waited for by the
time the next one of its kind is issued: until its wait, the collective holds its input (a
reduce-scatter's unreduced buffer: a layer's whole gradients) and the backend's own buffers, so
at most one of each is in flight, as FSDP2 keeps them.

Example::

    >>> gm = wait_late(reuse_donated(compile_local(plan, locals_in), locals_in, donated))
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from vsf import _compat
from vsf.jit.donation import allocates

__all__ = ["wait_late"]

aten = torch.ops.aten

# ops that only reshape a value: they move down with the wait whose result they view
_RESHAPES = frozenset(
    {
        operator.getitem,
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.alias.default,
    }
)


def _is_wait(node: torch.fx.Node) -> bool:
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    return schema is not None and schema.name == "_c10d_functional::wait_tensor"


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments an op writes in place (none for a functional collective: it writes only the
    buffer it returns, of its own)."""
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable or schema.name.startswith("_c10d_functional::"):
        return []
    by_name = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    written = [by_name.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return [x for w in written for x in _compat.torch_tree_leaves(w) if isinstance(x, torch.fx.Node)]


def _buffers(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, frozenset[torch.fx.Node]]:
    """Each value's buffers, named by the nodes that allocated them: an input's or a new
    result's its own, a view's (or anything else's) its inputs' (more than it may alias)."""
    out: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    for n in nodes:
        fresh = n.op in ("placeholder", "get_attr") or (n.op == "call_function" and allocates(n))
        out[n] = frozenset({n}) if fresh else frozenset().union(*(out[a] for a in n.all_input_nodes))
    return out


# collectives that hold buffers until waited for: the next one of the same op waits for them first
_ONE_IN_FLIGHT = frozenset({"_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor"})


def _kind(node: torch.fx.Node) -> str | None:
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    return schema.name if schema is not None and schema.name in _ONE_IN_FLIGHT else None


def wait_late(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every collective's wait (and the reshapes of its result) just before the first
    op that computes with it, never past an op that writes in place a buffer the collective holds
    nor past the next all-gather (or reduce-scatter) after an all-gather's (a reduce-scatter's);
    returns ``gm``, recompiled."""
    nodes = list(gm.graph.nodes)
    moving = set()
    for n in nodes:
        if _is_wait(n) or (
            n.op == "call_function"
            and n.target in _RESHAPES
            and n.all_input_nodes
            and all(a in moving for a in n.all_input_nodes)
        ):
            moving.add(n)
    buffers = _buffers(nodes)
    position = {m: i for i, m in enumerate(nodes)}
    writes = [
        (m, frozenset().union(*(buffers[w] for w in _written(m)))) for m in nodes if _written(m) or m.op == "output"
    ]
    next_of: dict[str, torch.fx.Node] = {}
    issued_next: dict[torch.fx.Node, torch.fx.Node] = {}  # a collective -> the next one of its op
    for n in reversed(nodes):
        kind = _kind(n)
        if kind is not None:
            if kind in next_of:
                issued_next[n] = next_of[kind]
            next_of[kind] = n

    def barrier(n: torch.fx.Node) -> torch.fx.Node | None:
        """The first op after ``n`` that writes a buffer the collective ``n`` waits for (or ``n``
        views) reads or writes; the output if none."""
        held = buffers[n].union(*(buffers[a] for a in (n.args[0].all_input_nodes if _is_wait(n) else ())))
        return next((m for m, w in writes if position[m] > position[n] and (m.op == "output" or w & held)), None)

    for n in reversed(nodes):
        if n not in moving:
            continue
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
        target = min(n.users, key=order.__getitem__, default=None)
        stops = [barrier(n), issued_next.get(n.args[0]) if _is_wait(n) else None]
        for stop in stops:
            if stop is not None and (target is None or order[stop] < order[target]):
                target = stop
        if target is not None and order[target] > order[n] + 1:
            target.prepend(n)
    gm.recompile()
    return gm
