"""The ops of a traced step that the planner has no strategy for, replaced by PyTorch's own
decompositions (``torch._decomp``): each such op traced by itself through its decomposition and
its pieces put in its place, the rest of the graph left as it is (its nodes, their names and
metadata: the marks of the stamped blocks' copies, :mod:`vsf.jit.copies`, included). Tracing the
whole step again for them cost a whole trace for a few ops (mamba.py's ``softplus_backward``, one
a block: 6 s of a 6-layer step's 14).

Example::

    >>> gm = decompose(gm, vsf.jit.classify.unplanned_ops)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from vsf import _compat
from vsf.jit.copies import COPY

__all__ = ["decompose"]


def decompose(
    gm: torch.fx.GraphModule,
    unplanned: Callable[[torch.fx.GraphModule], set[Any]],
    known: Mapping[Any, Callable[..., Any]] | None = None,
) -> torch.fx.GraphModule:
    """Replace every op of ``gm`` that ``unplanned`` names by PyTorch's own decomposition of it
    (``torch._decomp``), then do the same for the pieces, until each op is planned or has no
    decomposition (the planner names what is left, with the user's line: each piece carries the
    metadata the op's node had, its recorded stack trace included, as a trace does); ``known``
    decompositions (the ops decomposed in every graph) also apply to the pieces. ``gm`` is changed
    in place and returned.

    Example::

        >>> gm = decompose(gm, vsf.jit.classify.unplanned_ops)
    """
    table: dict[Any, Callable[..., Any]] = dict(known or {})
    while True:
        found = {op: d for op in unplanned(gm) if op not in table and (d := _compat.decomposition(op)) is not None}
        if not found:
            return gm
        table.update(found)
        for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in found]:
            _replace(gm.graph, node, table)
        gm.recompile()


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, table: Mapping[Any, Callable[..., Any]]) -> None:
    """Put in the place of ``node`` the ops its trace through ``table`` records, reading its inputs,
    each with ``node``'s metadata as a trace of the whole graph gives it (and the mark of the copy
    it belongs to)."""
    inputs = node.all_input_nodes

    def run(*values: torch.Tensor) -> Any:
        env = dict(zip(inputs, values))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        return node.target(*args, **kwargs)

    with fx_traceback.preserve_node_meta(), fx_traceback.set_current_meta(node):
        piece = make_fx(run, decomposition_table=table, tracing_mode="fake")(
            *_compat.distinct([a.meta["val"] for a in inputs])
        )
    placeholders = piece.graph.find_nodes(op="placeholder")
    start = node.prev
    with graph.inserting_before(node):
        out = graph.graph_copy(piece.graph, dict(zip(placeholders, inputs)))
    copy = node.meta.get(COPY)
    if copy is not None:
        n = start.next
        while n is not node:
            n.meta[COPY] = copy
            n = n.next
    if isinstance(out, torch.fx.Node):
        node.replace_all_uses_with(out)
    else:  # (several results, each read by a getitem)
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)
