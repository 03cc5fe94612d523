"""A planned joint graph split into a forward and a backward program, as AOTAutograd's
partitioner splits its joint graph.

The *forward* program computes everything that does not depend on the cotangents; the *backward*
program computes the rest. The forward values the backward reads are *saved*: the forward
program returns them besides the function's outputs, and the backward program takes them before
the cotangents. A value the joint plan redistributes before a backward use is saved as the
forward moved it when the forward moved it there anyway and the move does not grow it, or when
the move only slices it (the forward keeps the smaller shard); a gathered value (an FSDP weight,
say) is saved as its shard and gathered again in the backward (FSDP's reshard-after-forward), so
no program holds a gathered copy from one to the other. Views the backward reads (a weight's
transpose) are computed again there from what they view; values that depend on no input
(constants) are computed where they are used. Each program is a :class:`Plan` of its own, with
the joint plan's placements, so it runs, prints and costs like any plan.

Example::

    >>> parts = partition(joint_plan, n_primals=3, n_outputs=1, live=[0])
    >>> [s.bytes for s in parts.saved], parts.backward.outputs
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from vsf import _compat
from vsf.jit.buckets import form_buckets
from vsf.jit.cost import local_bytes
from vsf.jit.graph import GETITEM, Value, is_tensor_node, meta_of, output_node, placeholders_of, value_of
from vsf.jit.plan import Placements, Plan, Redistribution
from vsf.jit.redistribute import collectives_of

__all__ = ["Partitioned", "Saved", "SplitBackward", "partition", "split_backward"]


@dataclasses.dataclass(frozen=True)
class Saved:
    """A forward value the backward reads, as the forward program hands it over: its value in the
    joint graph, its placements and its bytes on one rank."""

    value: Value
    placements: Placements
    bytes: int


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """``forward``: primals -> the function's tensor outputs, then ``saved``; ``backward``: saved,
    then the cotangents of the ``live`` outputs -> the gradients the joint graph returns."""

    forward: Plan
    backward: Plan
    saved: tuple[Saved, ...]
    live: tuple[int, ...]


def partition(plan: Plan, n_primals: int, n_outputs: int, live: Sequence[int]) -> Partitioned:
    """Split ``plan`` (of a joint graph: ``n_primals`` primals then one cotangent per forward
    output; ``n_outputs`` forward outputs then the gradients) into its forward and backward
    programs. ``live``: the outputs whose cotangents the backward takes."""
    gm, mesh = plan.graph, plan.mesh
    placeholders = placeholders_of(gm)
    primals, cotangents = placeholders[:n_primals], placeholders[n_primals:]
    out_args = list(_compat.torch_tree_leaves(output_node(gm).args))
    fwd_outs, grads = out_args[:n_outputs], out_args[n_outputs:]
    on_tangents, on_primals = _dependence(gm, set(cotangents), set(primals))
    forward_side = lambda n: n not in on_tangents  # noqa: E731
    computed = lambda n: n in on_tangents or (n not in on_primals and n.op != "placeholder")  # noqa: E731  (constants: where used)
    views = _recomputed_views(plan, _reads(plan, grads, n_outputs, computed))
    backward_side = lambda n: computed(n) or n in views  # noqa: E731
    reads = _reads(plan, grads, n_outputs, backward_side)
    fwd_nodes = _closure(fwd_outs + [a for a, _, _ in reads], forward_side)
    moved = _moves_made(plan, [n for n in gm.graph.nodes if n in fwd_nodes], fwd_outs)
    chosen: dict[tuple[Value, Placements], tuple[torch.fx.Node, Saved]] = {}
    for a, v, dst in reads:
        src, t = plan.placement(v), meta_of(v)
        before, after = local_bytes(mesh, t, src), local_bytes(mesh, t, dst)
        sliced = after < before and not collectives_of(mesh, t, src, dst)
        pl = dst if ((v, dst) in moved and after <= before) or sliced else src
        chosen.setdefault((v, pl), (a, Saved(v, pl, local_bytes(mesh, meta_of(v), pl))))
    saved = tuple(s for _, s in chosen.values())
    forward = _program(
        plan,
        (),
        primals,
        fwd_outs + [a for a, _ in chosen.values()],
        list(plan.outputs[:n_outputs]) + [s.placements for s in saved],
        forward_side,
    )
    tangents = [cotangents[j] for j in live]
    backward = _program(plan, saved, tangents, grads, list(plan.outputs[n_outputs:]), backward_side)
    return Partitioned(forward, backward, saved, tuple(live))


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """A backward program cut in two, as zero-bubble pipeline schedules run it: ``inputs`` takes the
    backward's inputs and returns the gradients ``first`` names (a stage's input gradients, which
    the previous stage waits for), then ``stash``; ``weights`` takes ``stash``, then the backward's
    inputs, and returns the other gradients (``rest``: its params', which nothing waits for)."""

    inputs: Plan
    weights: Plan
    stash: tuple[Saved, ...]
    first: tuple[int, ...]
    rest: tuple[int, ...]


def split_backward(backward: Plan, first: Sequence[int]) -> SplitBackward:
    """Cut ``backward`` (a :class:`Partitioned`'s) into the program computing its outputs ``first``
    (indices into its outputs) and the one computing the others from what the first computed: the
    second reads each value of the first's that it needs from the first's ``stash`` (as the first
    holds it), and computes nothing the first computed.

    Example::

        >>> split = split_backward(parts.backward, first=[1])   # outputs: (grad of w, grad of x)
        >>> split.first, split.rest, [s.bytes for s in split.stash]
        ((1,), (0,), [...])
    """
    gm = backward.graph
    inputs = placeholders_of(gm)
    outs = list(_compat.torch_tree_leaves(output_node(gm).args))
    rest = tuple(j for j in range(len(outs)) if j not in first)
    firsts = _closure([outs[j] for j in first], lambda n: True)
    firsts |= {
        n for n in gm.graph.nodes if n.op == "call_function" and n.target is GETITEM and n.args[0] in firsts
    }  # (each output of what it computed)
    later = lambda n: n not in firsts  # noqa: E731
    seconds = _closure([outs[j] for j in rest], later)
    reads = [
        (a, v)
        for node in gm.graph.nodes
        if node in seconds and node in backward.nodes
        for a, v, _ in _tensor_uses(backward, node)
        if a in firsts
    ]
    reads += [(outs[j], value_of(outs[j])) for j in rest if outs[j] in firsts]
    chosen = {v: a for a, v in reads}
    stash = tuple(
        Saved(v, backward.placement(v), local_bytes(backward.mesh, meta_of(v), backward.placement(v))) for v in chosen
    )
    out_pl = backward.outputs
    head = _program(
        backward,
        (),
        inputs,
        [outs[j] for j in first] + list(chosen.values()),
        [out_pl[j] for j in first] + [x.placements for x in stash],
        lambda n: n in firsts,
    )
    tail = _program(backward, stash, inputs, [outs[j] for j in rest], [out_pl[j] for j in rest], later)
    return SplitBackward(head, tail, stash, tuple(first), rest)


def _reads(
    plan: Plan, grads: Sequence[torch.fx.Node], n_outputs: int, backward_side: Callable[[torch.fx.Node], bool]
) -> list[tuple[torch.fx.Node, Value, Placements]]:
    """Every read of a forward value by the backward program (the nodes ``backward_side`` accepts
    that the gradients need): (argument node, value, placement read in)."""
    bwd_nodes = _closure([a for a in grads if backward_side(a)], backward_side)
    reads = [
        (a, v, pl)
        for node in plan.graph.graph.nodes
        if node in bwd_nodes and node in plan.nodes
        for a, v, pl in _tensor_uses(plan, node)
    ]
    reads += [(a, value_of(a), pl) for a, pl in zip(grads, plan.outputs[n_outputs:])]
    return [r for r in reads if not backward_side(r[0])]


def _recomputed_views(plan: Plan, reads: Sequence[tuple[torch.fx.Node, Value, Placements]]) -> set[torch.fx.Node]:
    """The views (``t``, ``view``, ``detach``, ...) of forward values the backward reads, through
    chains of views: the backward computes them again from what they view, so that the forward
    saves the viewed value (a parameter's shard, not a view of its gathered copy)."""
    found: set[torch.fx.Node] = set()
    pending = [a for a, _, _ in reads]
    while pending:
        a = pending.pop()
        if a in found or not _is_view(plan, a):
            continue
        found.add(a)
        pending.extend(src for src, _, _ in _tensor_uses(plan, a))
    return found


def _is_view(plan: Plan, n: torch.fx.Node) -> bool:
    return (
        n in plan.nodes
        and getattr(n.target, "is_view", False)
        and is_tensor_node(n)
        and len(_tensor_uses(plan, n)) == 1
    )


def _dependence(
    gm: torch.fx.GraphModule, tangents: set[torch.fx.Node], primals: set[torch.fx.Node]
) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
    """The nodes that depend on a cotangent, and those that depend on a primal."""
    on_t, on_p = set(tangents), set(primals)
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        if any(a in on_t for a in ins):
            on_t.add(n)
        if any(a in on_p for a in ins):
            on_p.add(n)
    return on_t, on_p


def _closure(roots: Sequence[torch.fx.Node], inside: Callable[[torch.fx.Node], bool]) -> set[torch.fx.Node]:
    """The nodes of ``roots`` that ``inside`` accepts and every node they read that it accepts,
    transitively through those (placeholders left out)."""
    found: set[torch.fx.Node] = set()
    stack = [r for r in roots if inside(r)]
    while stack:
        n = stack.pop()
        if n in found or n.op == "placeholder":
            continue
        found.add(n)
        stack.extend(a for a in n.all_input_nodes if inside(a))
    return found


def _tensor_uses(plan: Plan, node: torch.fx.Node) -> list[tuple[torch.fx.Node, Value, Placements]]:
    """``node``'s tensor arguments in order: the argument node, its value, the placement the plan reads it in."""
    args = [
        a
        for a in _compat.torch_tree_leaves((node.args, node.kwargs))
        if isinstance(a, torch.fx.Node) and is_tensor_node(a)
    ]
    return [(a, value_of(a), pl) for a, pl in zip(args, plan.nodes[node].ins)]


def _moves_made(
    plan: Plan, nodes: Sequence[torch.fx.Node], outputs: Sequence[torch.fx.Node]
) -> set[tuple[Value, Placements]]:
    """The (value, placement) pairs the forward program redistributes to anyway (for its ops and outputs)."""
    made = {
        (v, pl)
        for node in nodes
        if node in plan.nodes
        for _, v, pl in _tensor_uses(plan, node)
        if plan.placement(v) != pl
    }
    made.update((value_of(a), pl) for a, pl in zip(outputs, plan.outputs) if plan.placement(value_of(a)) != pl)
    return made


def _program(
    plan: Plan,
    saved: Sequence[Saved],
    inputs: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    out_placements: Sequence[Placements],
    inside: Callable[[torch.fx.Node], bool],
) -> Plan:
    """The program of ``plan``'s nodes that ``inside`` accepts and ``outputs`` need: its inputs
    are ``saved`` (placeholders of their own), then copies of the joint placeholders ``inputs``;
    a node read from outside the program is read from the saved value it was saved as."""
    gm = plan.graph
    graph = torch.fx.Graph()
    from_saved: dict[tuple[Value, Placements], torch.fx.Node] = {}
    names: set[str] = set()
    for s in saved:
        node, i = s.value
        name = f"{node.name}{f'_out{i}' if i else ''}_saved"
        name = next(f"{name}{k or ''}" for k in range(len(names) + 1) if f"{name}{k or ''}" not in names)
        names.add(name)
        p = graph.placeholder(name)
        p.meta["val"] = meta_of(s.value)
        from_saved[(s.value, s.placements)] = p
    env = {ph: graph.node_copy(ph) for ph in inputs}

    def read(a: torch.fx.Node, pl: Placements) -> torch.fx.Node:
        if a in env:
            return env[a]
        v = value_of(a)
        return from_saved.get((v, pl)) or from_saved[(v, plan.placement(v))]

    nodes = {}
    needed = _closure(outputs, inside)
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        uses = iter(plan.nodes[node].ins) if node in plan.nodes else None

        def one(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and is_tensor_node(a) and uses is not None:
                return read(a, next(uses))
            return env[a] if isinstance(a, torch.fx.Node) else a

        args, kwargs = _compat.torch_tree_map(one, (node.args, node.kwargs))
        new = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        env[node] = new
        if node in plan.nodes:
            nodes[new] = plan.nodes[node]
    graph.output(tuple(read(a, pl) for a, pl in zip(outputs, out_placements)))
    sub = torch.fx.GraphModule(gm, graph)
    ins = tuple(s.placements for s in saved) + tuple(plan.placement((ph, 0)) for ph in inputs)
    draft = Plan(plan.mesh, sub, nodes, ins, tuple(out_placements), (), (), (), plan.options)
    moves, users = _redistributions(draft)
    buckets, order = form_buckets(
        plan.mesh, sub, moves, {id(r): users[(r.value, r.dst)] for r in moves}, plan.options.bucket_bytes
    )
    return dataclasses.replace(
        draft, redistributions=moves, buckets=buckets, order=order, reduce_dtype=plan.reduce_dtype
    )


def _redistributions(
    plan: Plan,
) -> tuple[tuple[Redistribution, ...], dict[tuple[Value, Placements], list[torch.fx.Node]]]:
    """Every redistribution ``plan``'s ops and outputs read their inputs through, once per (value,
    placement), and the nodes that read each (a program cut from a joint plan makes its own)."""
    moves: dict[tuple[Value, Placements], Redistribution] = {}
    users: dict[tuple[Value, Placements], list[torch.fx.Node]] = {}

    def read(v: Value, dst: Placements, node: torch.fx.Node) -> None:
        src = plan.placement(v)
        if src != dst:
            users.setdefault((v, dst), []).append(node)
            if (v, dst) not in moves:
                moves[(v, dst)] = Redistribution(v, src, dst, collectives_of(plan.mesh, meta_of(v), src, dst), node)

    for node in plan.graph.graph.nodes:
        if node in plan.nodes:
            for _, v, pl in _tensor_uses(plan, node):
                read(v, pl, node)
    out = output_node(plan.graph)
    for a, pl in zip(_compat.torch_tree_leaves(out.args), plan.outputs):
        read(value_of(a), pl, out)
    return tuple(dataclasses.replace(r, users=tuple(users[key])) for key, r in moves.items()), users
