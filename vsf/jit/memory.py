"""How much memory a plan holds: the estimated peak of live local tensors on one rank.

Every input lives for the whole program; an op's result from the op until its last use (an
output until the end); a redistributed copy from its first user (or its bucket) until its own
last user, so a gathered input that the plan gathers again later (FSDP's reshard after forward)
is freed between. Views are counted as new tensors (an upper bound).

Example::

    >>> peak_bytes(vsf.jit(step).lower(params, batch).plan)
    1048576
"""

from __future__ import annotations

import torch
import torch.fx

from vsf import _compat
from vsf.jit.cost import local_bytes
from vsf.jit.graph import Value, is_tensor_node, meta_of, output_node, placeholders_of, value_of
from vsf.jit.plan import Bucket, Plan, Redistribution

__all__ = ["peak_bytes"]


def peak_bytes(plan: Plan) -> int:
    """The estimated peak of live local tensor bytes on one rank while ``plan`` runs."""
    gm = plan.graph
    order: dict[object, int] = {}
    for i, item in enumerate(plan.order):
        if isinstance(item, Bucket):
            order.update((id(r), i) for r in item.members)
        elif isinstance(item, Redistribution):
            order[id(item)] = i
        else:
            order[item] = i
    end = len(plan.order)
    last: dict[Value, int] = {}
    for node in gm.graph.nodes:
        for a in _compat.torch_tree_leaves((node.args, node.kwargs)):
            if isinstance(a, torch.fx.Node) and is_tensor_node(a):
                last[value_of(a)] = max(last.get(value_of(a), 0), order[node])
    born: list[tuple[int, int, int]] = []
    for ph, pl in zip(placeholders_of(gm), plan.inputs):
        born.append((0, end, local_bytes(plan.mesh, ph.meta["val"], pl)))
    outputs = {value_of(a) for a in _compat.torch_tree_leaves(output_node(gm).args)}
    for node, step in plan.nodes.items():
        for i, pl in enumerate(step.outs):
            if pl is not None:
                v = (node, i)
                born.append((order[node], end if v in outputs else last.get(v, order[node]), local_bytes(plan.mesh, meta_of(v), pl)))
    for r in plan.redistributions:
        start = order.get(id(r), order[r.before])
        born.append((start, max((order[u] for u in r.users), default=last.get(r.value, start)), local_bytes(plan.mesh, meta_of(r.value), r.dst)))
    events = sorted([(s, b) for s, _, b in born] + [(e + 1, -b) for _, e, b in born])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak
