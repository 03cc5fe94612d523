"""Reading a plan: its text (every op's shardings, every collective) and its cost.

Example::

    >>> print(plan_text(plan, "step", ["args[0]"], ["[0]"]))
    >>> cost(plan).comm_bytes
    >>> cost(plan).flops
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from vsf import _compat
from vsf.jit.cost import local_bytes, local_flops
from vsf.jit.graph import meta_of, output_node, placeholders_of, tensor_args, value_of
from vsf.jit.manual import region_of
from vsf.jit.memory import peak_bytes
from vsf.jit.partition import Partitioned, Saved, SplitBackward
from vsf.jit.plan import Bucket, Collective, Plan, Redistribution
from vsf.jit.remat import recomputed
from vsf.sharding.inspect import type_string

__all__ = ["Cost", "cost", "differentiable_cost", "differentiable_text", "fmt_bytes", "plan_text"]


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a plan costs each rank.

    ``comm_bytes``: bytes each rank sends per mesh axis (ring model: all-reduce ``2(n-1)/n``,
    all-gather and reduce-scatter ``(n-1)/n`` of the tensor, all-to-all ``(n-1)/n`` of the
    shard). ``peak_bytes``: estimated peak of live local tensors on one rank.
    ``collectives``: every collective the program runs, in order. ``flops``: FLOPs one rank
    runs in the ops that do real work (matmuls, convolutions, attention:
    :func:`vsf.jit.cost.op_flops`; elementwise ops are not counted), each op's FLOPs over the
    size of every mesh axis that splits it (one of its operands or results is split there:
    :func:`vsf.jit.cost.splits_work`); an op run unsplit on an axis counts whole, as every rank
    of it runs it. This is the work the planner weighs against bytes
    (``vsf.config.compute_bytes_per_flop``).
    """

    comm_bytes: dict[str, int]
    peak_bytes: int
    collectives: tuple[Collective, ...]
    flops: int

    def count(self, kind: str, axis: str | None = None) -> int:
        """How many collectives of ``kind`` (over ``axis``, if given) the program runs."""
        return sum(1 for c in self.collectives if c.kind == kind and (axis is None or c.axis == axis))


def _type(plan: Plan, t: torch.Tensor, placements: tuple) -> str:
    return type_string(tuple(t.shape), t.dtype, plan.mesh, placements)


def cost(plan: Plan) -> Cost:
    """Communication per mesh axis, estimated peak memory and compute of ``plan`` (per rank)."""
    collectives = tuple(plan.collectives())
    comm = {a: 0 for a in plan.mesh.axis_names}
    for c in collectives:
        comm[c.axis] += c.bytes
    flops = sum(local_flops(plan.mesh, node, step.ins, step.outs) for node, step in plan.nodes.items())
    return Cost(comm, peak_bytes(plan), collectives, round(flops))


def differentiable_cost(parts: Partitioned) -> Cost:
    """What a call that torch autograd differentiates costs each rank: both programs' bytes,
    collectives and FLOPs; the peak is the larger of the forward's and the backward's, the latter with the
    call's inputs alive beside it (the caller holds them) unless it holds them as saved values."""
    fwd, bwd = cost(parts.forward), cost(parts.backward)
    comm = {a: fwd.comm_bytes[a] + bwd.comm_bytes[a] for a in fwd.comm_bytes}
    held = sum(
        local_bytes(parts.forward.mesh, ph.meta["val"], pl)
        for ph, pl in zip(placeholders_of(parts.forward.graph), parts.forward.inputs)
    )
    held -= sum(s.bytes for s in parts.saved if s.value[0].op == "placeholder")
    return Cost(
        comm, max(fwd.peak_bytes, bwd.peak_bytes + held), fwd.collectives + bwd.collectives, fwd.flops + bwd.flops
    )


def differentiable_text(
    parts: Partitioned, name: str, input_names: Sequence[str], output_names: Sequence[str], grad_names: Sequence[str]
) -> str:
    """The two programs of a call that torch autograd differentiates, and what the forward saves for the backward."""
    fwd, bwd = parts.forward, parts.backward
    primals = {
        ph.name: name for ph, name in zip(placeholders_of(fwd.graph), input_names)
    }  # (copies of the joint graph's)
    saved = [
        f"saved {primals[s.value[0].name] if s.value[0].op == 'placeholder' else _value_name(s)}" for s in parts.saved
    ]
    cotangents = [f"cotangent of {output_names[j]}" for j in parts.live]
    total = sum(s.bytes for s in parts.saved)
    inputs = sum(s.bytes for s in parts.saved if s.value[0].op == "placeholder")
    lines = [
        f"{name} differentiated by torch autograd: one joint graph (forward + vjp) planned once, run as two programs",
        plan_text(fwd, f"{name} (forward)", input_names, list(output_names) + saved),
        f"saved for the backward: {len(saved)} values, {fmt_bytes(total)} per rank ({fmt_bytes(inputs)} of it the call's inputs themselves)",
    ]
    width = max((len(label) for label in saved), default=0) + 1
    lines.extend(
        f"  {label:<{width}} {_type(fwd, meta_of(s.value), s.placements):<28} {fmt_bytes(s.bytes)}"
        for label, s in zip(saved, parts.saved)
    )
    lines.append(plan_text(bwd, f"{name} (backward)", saved + cotangents, grad_names))
    lines.append(
        "a cotangent that arrives in another layout than the backward's input above is redistributed once, before the backward runs"
    )
    c = differentiable_cost(parts)
    per_axis = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in c.comm_bytes.items() if fwd.mesh.axis_size(a) > 1) or "none"
    lines.append(
        f"cost per rank of both programs: sends {per_axis}; {len(c.collectives)} collectives; peak memory ~{fmt_bytes(c.peak_bytes)}"
    )
    return "\n".join(lines)


def split_text(split: SplitBackward, name: str) -> str:
    """How a backward cut for deferred gradients divides its ops and bytes between its two parts."""
    ops = lambda plan: sum(1 for n in plan.graph.graph.nodes if n.op == "call_function")  # noqa: E731
    sent = lambda plan: fmt_bytes(sum(cost(plan).comm_bytes.values()))  # noqa: E731
    return (
        f"{name}'s backward is cut in two (deferred_grad_argnums): the part run in backward has {ops(split.inputs)} ops and sends {sent(split.inputs)} per rank; "
        f"the deferred part has {ops(split.weights)} ops and sends {sent(split.weights)}, from {len(split.stash)} values the first part keeps for it "
        f"({fmt_bytes(sum(s.bytes for s in split.stash))})"
    )


def _value_name(s: Saved) -> str:
    node, i = s.value
    return f"%{node.name}{f'[{i}]' if i else ''}"


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, as the plans print them.

    Example::

        >>> fmt_bytes(512), fmt_bytes(2048)
        ('512 B', '2.0 KiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def plan_text(plan: Plan, name: str, input_names: Sequence[str], output_names: Sequence[str]) -> str:
    """Every input, op, collective and output of ``plan``, with shardings in ``typeof`` notation."""
    mesh = plan.mesh
    gm = plan.graph
    lines = [
        f"plan for {name} on mesh {' x '.join(f'{a}={s}' for a, s in mesh.shape.items())} ({mesh.size} ranks)",
        "inputs:",
    ]
    for ph, pl, label in zip(placeholders_of(gm), plan.inputs, input_names):
        lines.append(f"  %{ph.name:<14} {_type(plan, ph.meta['val'], pl):<28} {label}")
    lines.append("ops:")
    again = recomputed(gm)
    moves: dict[torch.fx.Node, list[str]] = {}
    placed = {id(r) for b in plan.buckets for r in b.members} | {
        id(r) for r in plan.order if isinstance(r, Redistribution)
    }
    for r in plan.redistributions:
        if id(r) not in placed:
            moves.setdefault(r.before, []).extend(_move_lines(plan, r))
    for node in plan.order:
        if isinstance(node, Redistribution):  # a lone reduction, where it starts
            lines.extend(_move_lines(plan, node))
            continue
        if isinstance(node, Bucket):
            names = ", ".join(f"%{r.value[0].name}" for r in node.members)
            for c in plan.wire(node):
                lines.append(
                    f"    {c.kind} over {c.axis}: one bucket of {len(node.members)} values ({names}), [{c.shape[0]}] {fmt_bytes(c.bytes)} sent{_in_dtype(plan, node)}"
                )
            continue
        if node not in plan.nodes:
            continue
        lines.extend(moves.get(node, ()))
        step = plan.nodes[node]
        ins = [
            f"%{v[0].name}{f'[{v[1]}]' if v[1] else ''}:{_type(plan, meta_of(v), pl)}"
            for v, pl in zip(tensor_args(node), step.ins)
        ]
        outs = [
            _type(plan, node.meta["val"][i] if isinstance(node.meta["val"], (list, tuple)) else node.meta["val"], pl)
            for i, pl in enumerate(step.outs)
            if pl is not None
        ]
        flag = "   <-- no sharding strategy: run replicated (allow_replicated_fallback)" if step.fallback else ""
        flag += f"   (recomputed: %{again[node].name} again)" if node in again else ""
        lines.append(f"  %{node.name} = {_op_name(node)}({', '.join(ins)}) -> {', '.join(outs)}{flag}")
        region = f"shard_map({r.name})" if step.collectives and (r := region_of(node)) is not None else "the region"
        lines.extend(
            f"    {c.kind} over {c.axis} (inside {region}): {list(c.shape)} {fmt_bytes(c.bytes)} sent"
            + (f" (the average rank's; one rank at most {fmt_bytes(c.most)})" if c.most is not None else "")
            for c in step.collectives
        )
    output = output_node(gm)
    lines.extend(moves.get(output, ()))
    lines.append("outputs:")
    for a, pl, label in zip(_compat.torch_tree_leaves(output.args), plan.outputs, output_names):
        lines.append(f"  {label:<16} {_type(plan, meta_of(value_of(a)), pl)}  (from %{a.name})")
    if again:
        lines.append(_remat_line(plan, again))
    c = cost(plan)
    per_axis = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in c.comm_bytes.items() if mesh.axis_size(a) > 1) or "none"
    lines.append(
        f"cost per rank: sends {per_axis}; {len(c.collectives)} collectives; peak memory ~{fmt_bytes(c.peak_bytes)}"
    )
    lines.extend(plan.notes)
    return "\n".join(lines)


def _remat_line(plan: Plan, again: dict[torch.fx.Node, torch.fx.Node]) -> str:
    """What rematerialisation does in ``plan``: the ops run again, the forward values the backward
    recomputes instead of keeping (bytes per rank), and the collectives run again for them."""
    firsts = set(again.values())
    kept = sum(
        local_bytes(plan.mesh, meta_of((n, i)), pl)
        for n in firsts
        for i, pl in enumerate(plan.nodes[n].outs)
        if pl is not None
    )
    flops = sum(local_flops(plan.mesh, n, plan.nodes[n].ins, plan.nodes[n].outs) for n in again)
    regathered = [c for r in plan.redistributions if r.before in again for c in r.collectives]
    gathers = (
        f"; {len(regathered)} collectives run again for them ({fmt_bytes(sum(c.bytes for c in regathered))} sent)"
        if regathered
        else ""
    )
    return (
        f"remat: {len(again)} ops recomputed in the backward ({round(flops):,} FLOPs per rank) instead of keeping "
        f"{len(firsts)} forward values, {fmt_bytes(kept)} per rank{gathers}"
    )


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "get_attr":
        return f"constant {node.target}"
    target = node.target
    return str(getattr(target, "__name__", target)).replace(".default", "")


def _move_lines(plan: Plan, r: Redistribution) -> list[str]:
    t = meta_of(r.value)
    src, dst = _type(plan, t, r.src), _type(plan, t, r.dst)
    if not r.collectives:
        return [f"    slice  %{r.value[0].name}: {src} -> {dst} (local, no communication)"]
    return [
        f"    {c.kind} over {c.axis}: %{r.value[0].name} {list(c.shape)} {fmt_bytes(c.bytes)} sent{_in_dtype(plan, r)}  ({src} -> {dst})"
        for c in plan.wire(r)
    ]


def _in_dtype(plan: Plan, r: Redistribution | Bucket) -> str:
    wire = plan.reduced_in(r)
    return (
        f" in {str(wire).removeprefix('torch.')} (reduce_dtype; {str(r.collectives[0].dtype).removeprefix('torch.')} before and after)"
        if wire is not None
        else ""
    )
