"""How much memory a plan holds: the estimated peak of live local buffers on one rank, as the
lowered program (:func:`vsf.jit.lower.compile_local`, which frees each value after its last use)
holds them.

* Every input lives for the whole program. An output the program may write into a donated input
  (:attr:`Plan.donated`) of the same local shape and dtype (an optimizer's update of a donated param or moment, as
  :func:`vsf.jit.donation.reuse_donated` and XLA's donation alias them) costs nothing more.
* An op's result is a buffer from the op until the last read of it or of any view of it (a view
  op's result, ``detach``, ``t``, ``view``, holds no buffer of its own: it keeps its base's alive).
* A value that reaches an op laid out otherwise is read by its redistribution, where that starts
  (a gradient reduce-scattered is freed after its bucket runs, not kept until the optimizer reads
  the reduced shard); the redistributed copy is a buffer from then until its own last user, so a
  param gathered again for the backward (FSDP's reshard after forward) is freed between.
* A bucket also holds, while it runs, its flat buffers: the members copied into one, and (a
  gather's, whose results are copied out of it) the gathered one.

Example::

    >>> peak_bytes(vsf.jit(step).lower(params, batch).plan)
    1048576
"""

from __future__ import annotations

import collections
import torch.fx

from vsf import _compat
from vsf.jit.cost import local_bytes, local_shape
from vsf.jit.graph import Value, is_view, meta_of, output_node, placeholders_of, tensor_args, value_of
from vsf.jit.plan import Bucket, Plan, Redistribution

__all__ = ["peak_bytes"]


def peak_bytes(plan: Plan) -> int:
    """The estimated peak of live local buffer bytes on one rank while ``plan`` runs."""
    gm = plan.graph
    step_of: dict[object, int] = {}
    transient: dict[int, int] = collections.defaultdict(int)
    for i, item in enumerate(plan.order):
        if isinstance(item, Bucket):
            step_of.update((id(r), i) for r in item.members)
            transient[i] += sum(local_bytes(plan.mesh, meta_of(r.value), r.src) for r in item.members)
            if item.kind == "all_gather":
                transient[i] += sum(local_bytes(plan.mesh, meta_of(r.value), r.dst) for r in item.members)
        elif isinstance(item, Redistribution):
            step_of[id(item)] = i
        else:
            step_of[item] = i
    end = len(plan.order)
    placeholders = placeholders_of(gm)
    placed = {(ph, 0): pl for ph, pl in zip(placeholders, plan.inputs)} | {
        (n, i): pl for n, st in plan.nodes.items() for i, pl in enumerate(st.outs)
    }
    # buffers (an input's, an op's result's or a redistribution's, by key): when each is made, its
    # last read, its bytes; and the buffer each value lives in
    born: dict[object, int] = {}
    size: dict[object, int] = {}
    last: dict[object, int] = {}
    buffer_of: dict[Value, object] = {}
    inputs = {(ph, 0) for ph in placeholders}
    for ph, pl in zip(placeholders, plan.inputs):
        buffer_of[(ph, 0)] = (ph, 0)
        born[(ph, 0)], last[(ph, 0)], size[(ph, 0)] = 0, end, local_bytes(plan.mesh, ph.meta["val"], pl)
    for r in plan.redistributions:
        born[id(r)] = step_of.get(id(r), step_of[r.before])
        size[id(r)] = local_bytes(plan.mesh, meta_of(r.value), r.dst)
        last[id(r)] = born[id(r)]

    def read(v: Value, dst: object, user: torch.fx.Node, at: int) -> object:
        """The buffer ``user`` reads for its input ``v`` laid out as ``dst``, marked read at ``at``;
        ``v`` itself read by the redistribution that serves it, where that starts."""
        if placed[v] == dst:
            key = buffer_of[v]
        else:
            r = plan.serving(user, v, dst)
            key = id(r)
            last[buffer_of[v]] = max(last[buffer_of[v]], born[key])
        last[key] = max(last[key], at)
        return key

    for node in gm.graph.nodes:
        step = plan.nodes.get(node)
        if step is None:
            continue
        at = step_of[node]
        reads = [read(v, dst, node, at) for v, dst in zip(tensor_args(node), step.ins)]
        for i, pl in enumerate(step.outs):
            if pl is None:
                continue
            if is_view(node) and reads:
                buffer_of[(node, i)] = reads[0]
            else:
                buffer_of[(node, i)] = (node, i)
                born[(node, i)], last[(node, i)], size[(node, i)] = (
                    at,
                    at,
                    local_bytes(plan.mesh, meta_of((node, i)), pl),
                )
    out = output_node(gm)
    free = collections.Counter(
        _signature(plan, (ph, 0), plan.inputs[k]) for k, ph in enumerate(placeholders) if k in plan.donated
    )
    for a, dst in zip(_compat.torch_tree_leaves(out.args), plan.outputs):
        key = read(value_of(a), dst, out, end)
        if key not in inputs and free[sig := _signature(plan, value_of(a), dst)] > 0:
            free[sig] -= 1
            size[key] = 0  # written into a donated input's buffer
    events = sorted([(born[k], size[k]) for k in born] + [(last[k] + 1, -size[k]) for k in born])
    live = peak = 0
    events_at = iter(events)
    pending = next(events_at, None)
    for t in range(end + 2):
        while pending is not None and pending[0] <= t:
            live += pending[1]
            pending = next(events_at, None)
        peak = max(peak, live + transient.get(t, 0))
    return peak


def _signature(plan: Plan, v: Value, placements: object) -> tuple[object, ...]:
    t = meta_of(v)
    return local_shape(plan.mesh, t, placements), t.dtype  # type: ignore[arg-type]
