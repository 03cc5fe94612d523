"""Lowering a plan to a program over local shards.

:func:`execute` walks the planned graph on this rank's local tensors: before each op it
redistributes every input to the placement the plan chose (once per value and placement, with
DTensor's own redistribution, i.e. explicit collectives), then runs the op. Most ops run as they
are on the local shards; view ops (whose shape arguments must become local), random ops and the
few ops DTensor handles specially run through DTensor's dispatcher, and must produce the plan's
placements. Under ``vsf.simulate`` the walk runs as is (every simulated rank at once); in a real
run it is traced once with ``make_fx`` into an fx graph of local aten ops and functional
collectives, which is what each step then runs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from vsf import _compat
from vsf.sharding import ragged
from vsf.sharding.named import RaggedPlacement, from_placements
from vsf.sharding.constraint import CONSTRAINT_OP
from vsf.sharding.propagate import Bucket, Placements, Plan, Value, _is_tensor_node, _meta, _placeholders, _tmeta, _value, local_shape, minor_step, transition_path

__all__ = ["PlanMismatch", "compile_local", "execute"]


class PlanMismatch(RuntimeError):
    """DTensor produced a placement the plan did not predict (a bug in vsf: please report it)."""


def _replicated(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    """A value every rank holds whole, as a local tensor of this run (one per simulated rank)."""
    if _compat.active_local_mode() is not None and not isinstance(t, _compat.LocalTensor):
        return _compat.make_local({r: t for r in plan.mesh.devices})
    return t


def execute(plan: Plan, inputs: Sequence[torch.Tensor], check: Callable[[torch.fx.Node, list[Any]], None] | None = None) -> list[torch.Tensor]:
    """Run ``plan`` on local shards laid out as ``plan.inputs``; return local shards laid out as ``plan.outputs``.

    ``check`` (checking mode, :class:`vsf.check.Checker`) is called after each op with the op's
    local results.
    """
    gm = plan.graph
    dm = plan.mesh.device_mesh
    env: dict[Value, torch.Tensor] = {(ph, 0): x for ph, x in zip(_placeholders(gm), inputs)}
    moved: dict[tuple[Value, Placements], torch.Tensor] = {}
    def spec(v: Value, placements: Placements) -> Any:
        return _compat.DTensorSpec(dm, placements, tensor_meta=_tmeta(_meta(v)))

    def get(v: Value, dst: Placements) -> torch.Tensor:
        src = plan.placement(v)
        if src == dst:
            return env[v]
        if (v, dst) not in moved:
            local, prev = env[v], src
            for nxt in transition_path(plan.mesh, src, dst):
                local, prev = _move(plan, _meta(v), local, prev, nxt), nxt
            moved[(v, dst)] = local
        return moved[(v, dst)]

    def run_bucket(b: Bucket) -> None:
        sizes = [plan.mesh.axis_size(a) for a in plan.mesh.device_axes]
        pieces = [env[r.value] for r in b.members]
        averaged = [math.prod(sizes[k] for k in b.mesh_dims if r.src[k].reduce_op == "avg") for r in b.members]
        flat = torch.cat([(p / n if n > 1 else p).reshape(-1) for n, p in zip(averaged, pieces)])
        src = tuple(Partial() if k in b.mesh_dims else Replicate() for k in range(len(b.members[0].src)))
        meta = _compat.TensorMeta(flat.shape, flat.stride(), flat.dtype)
        reduced = _compat.redistribute_local_tensor(
            flat, _compat.DTensorSpec(dm, src, tensor_meta=meta), _compat.DTensorSpec(dm, (Replicate(),) * len(src), tensor_meta=meta)
        )
        for r, p, out in zip(b.members, pieces, reduced.split([p.numel() for p in pieces])):
            moved[(r.value, r.dst)] = out.view(p.shape)

    for node in plan.order:
        if isinstance(node, Bucket):
            run_bucket(node)
            continue
        if node not in plan.nodes:
            continue  # placeholders, tuple indexing and the output: nothing to run
        step = plan.nodes[node]
        wanted = iter(step.ins)
        as_dtensor = not step.direct and bool(step.ins) and not step.fallback and node.target is not CONSTRAINT_OP

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and _is_tensor_node(a):
                v, dst = _value(a), next(wanted)
                local = get(v, dst)
                if node.target in _STRIDED_VIEWS:
                    local = _traced_layout(local, _meta(v))
                return _compat.dtensor_from_local(local, spec(v, dst)) if as_dtensor else local
            return a

        args, kwargs = pytree.tree_map(arg, (node.args, node.kwargs))
        if node.op == "get_attr":
            out: Any = _replicated(getattr(gm, node.target), plan)
        elif node.target is CONSTRAINT_OP:
            out = args[0]
        elif not step.ins:
            out = pytree.tree_map(lambda t: _replicated(t, plan) if isinstance(t, torch.Tensor) else t, node.target(*args, **kwargs))
        elif as_dtensor:
            out = _unwrap(node, node.target(*args, **kwargs), step.outs)
        else:
            out = node.target(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for i, (o, want) in enumerate(zip(outs, step.outs)):
            if want is not None:
                env[(node, i)] = o
        if check is not None:
            check(node, outs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [get(_value(a), dst) for a, dst in zip(pytree.tree_leaves(output.args), plan.outputs)]


def _move(plan: Plan, t: torch.Tensor, local: torch.Tensor, src: Placements, dst: Placements) -> torch.Tensor:
    """One step of a redistribution on this rank's local shard: DTensor's, or vsf's ragged
    collectives on a mesh dim where either side is ragged (one mesh dim at a time)."""
    dm = plan.mesh.device_mesh
    minor = minor_step(plan.mesh, src, dst)
    if minor is not None:  # a 1D collective of the local shard: the other mesh dims have split it already
        k, d = minor
        level = list(src)
        level[k] = Replicate()
        shape = local_shape(plan.mesh, t, tuple(level))
        meta = _compat.TensorMeta(torch.Size(shape), _contiguous(shape), t.dtype)
        one_d = lambda p: Shard(d) if isinstance(p, _compat.StridedShard) else p  # noqa: E731
        lone = lambda p: tuple(one_d(p) if j == k else Replicate() for j in range(len(src)))  # noqa: E731
        return _compat.redistribute_local_tensor(local, _compat.DTensorSpec(dm, lone(src[k]), tensor_meta=meta), _compat.DTensorSpec(dm, lone(dst[k]), tensor_meta=meta))
    if not any(isinstance(p, RaggedPlacement) for p in (*src, *dst)):
        meta = _tmeta(t)
        return _compat.redistribute_local_tensor(local, _compat.DTensorSpec(dm, src, tensor_meta=meta), _compat.DTensorSpec(dm, dst, tensor_meta=meta))
    for k, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        mid = tuple(b if j == k else p for j, p in enumerate(src))
        if isinstance(a, RaggedPlacement) or isinstance(b, RaggedPlacement):
            axis = plan.mesh.device_axes[k]
            shape = ragged.group_shape(from_placements(plan.mesh, src, t.ndim), axis, tuple(t.shape))
            local = ragged.reshard(local, shape, _layout(a), _layout(b), mesh=plan.mesh)
        else:  # another mesh dim: DTensor moves it; the ragged rows are just rows there
            plain = lambda pl: tuple(Replicate() if isinstance(p, RaggedPlacement) else p for p in pl)  # noqa: E731
            local = _move(plan, t, local, plain(src), plain(mid))
        src = mid
    return local


_STRIDED_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def _traced_layout(local: torch.Tensor, traced: torch.Tensor) -> torch.Tensor:
    """``local`` stored in the dim order ``traced`` had, for a view that folds dims (it needs the
    strides the trace had; a copy only where they differ). A shard's memory order can differ from
    the traced value's: a collective returns a row-major buffer, and a kernel's output order may
    follow its inputs' (SDPA's CPU kernel on q, k, v that a redistribution made row-major)."""
    order = _dim_order(traced)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return local.permute(order).contiguous().permute(inverse)


def _dim_order(t: torch.Tensor) -> list[int]:
    """``t``'s dims from outermost to innermost in memory (dims of size 1, whose stride means nothing, last)."""
    return sorted(range(t.ndim), key=lambda d: (0, -t.stride(d), d) if t.shape[d] > 1 else (1, 0, d))


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _layout(p: Any) -> Any:
    return p.ragged if isinstance(p, RaggedPlacement) else p


def _unwrap(node: torch.fx.Node, out: Any, want: Sequence[Placements | None]) -> Any:
    outs = out if isinstance(out, (list, tuple)) else [out]
    for o, w in zip(outs, want):
        if w is not None and tuple(o.placements) != w:
            raise PlanMismatch(f"{node.target} (node {node.name}) produced {tuple(o.placements)}, the plan said {w}")
    locals_ = [o.to_local() if isinstance(o, DTensor) else o for o in outs]
    return locals_ if isinstance(out, (list, tuple)) else locals_[0]


def compile_local(plan: Plan, local_inputs: Sequence[torch.Tensor], donated: Sequence[int] = ()) -> torch.fx.GraphModule:
    """Trace :func:`execute` on this rank's local shards into a graph of local ops and collectives.

    The inputs at positions ``donated`` may be overwritten: the program updates them in place
    where an op's result takes exactly their place (a donated optimizer state's ``lerp``, a
    donated param's ``sub``), as XLA reuses donated buffers.
    """
    with _compat.quiet_redistribute():
        gm = make_fx(lambda *xs: execute(plan, xs), tracing_mode="fake")(*local_inputs)
    gm.graph.eliminate_dead_code()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shared = {id(t) for t in local_inputs if sum(u is t for u in local_inputs) > 1}
    _reuse(gm, {placeholders[i] for i in donated if id(local_inputs[i]) not in shared})
    gm.recompile()
    return gm


def _reuse(gm: torch.fx.GraphModule, owned: set[torch.fx.Node]) -> None:
    """Turn ``op(x, ...)`` into ``op_(x, ...)`` where ``x`` is ours to overwrite (a donated input, or
    a fresh result of an earlier op), this op is its last use (every other use came before it and
    read ``x`` into a buffer of its own: no view, no collective still reading it), and the result
    has exactly ``x``'s shape, stride and dtype. Each rewrite makes the result ours too, so chains
    update one buffer (``p + u`` after ``u = c * p`` updates ``p`` itself). An op whose in-place
    twin overwrites several arguments (``vsf::adam_step_``: both moments) is rewritten when every
    one of them qualifies."""
    outputs = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        variant = _inplace_variant(node.target) if node.op == "call_function" else None
        if variant is None:
            continue
        inplace, writes = variant
        results = _results(node)
        if all(_overwritable(node, i, results.get(j), owned, outputs, order) for i, j in writes):
            node.target = inplace
            owned.update(results[j] for _, j in writes)


def _results(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """The nodes that stand for each tensor ``node`` returns: itself, or its ``getitem`` users."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return {0: node}
    return {use.args[1]: use for use in node.users if use.target is operator.getitem}


def _overwritable(node: torch.fx.Node, i: int, result: torch.fx.Node | None, owned: set[torch.fx.Node], outputs: set[torch.fx.Node], order: dict[torch.fx.Node, int]) -> bool:
    """May ``node``'s argument ``i`` take the place of ``result``, the value computed from it?"""
    x = node.args[i] if i < len(node.args) else None
    if not isinstance(x, torch.fx.Node) or result is None or x in outputs:
        return False
    if not (x in owned or (x.op == "call_function" and _allocates(x))) or not _done_before(x, node, order):
        return False
    a, out = x.meta.get("val"), result.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    return a.shape == out.shape and a.dtype == out.dtype and a.stride() == out.stride()


_VIEWS = ("view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "split", "unsqueeze", "squeeze", "alias", "detach", "as_strided", "reshape", "unbind", "diagonal", "narrow")


def _allocates(node: torch.fx.Node) -> bool:
    """Does ``node`` produce a new buffer (not a view of an input, not a collective's buffer)? For
    one result of a multi-result op (a ``getitem``), does that result?"""
    op, index = node.target, None
    if op is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        op, index = node.args[0].target, node.args[1]
    schema = getattr(op, "_schema", None)
    return schema is not None and not schema.name.startswith("_c10d_functional") and _allocates_op(op, index)


def _done_before(x: torch.fx.Node, node: torch.fx.Node, order: dict[torch.fx.Node, int], *, view: bool = False) -> bool:
    """Has every use of ``x`` but ``node`` run before ``node`` and only read ``x``: as a plain input
    (:func:`_reads_only`), as a side input of an in-place op, or through a view whose own uses are done too
    (never a collective, which may still be reading it; ``node`` may not read a ``view`` of it)?"""
    for use in x.users:
        if use is node:
            if view:
                return False
            continue
        if order[use] > order[node] or use.op != "call_function":
            return False
        if use.target is operator.getitem:  # one of the views a split of x returns
            if not _done_before(use, node, order, view=True):
                return False
            continue
        if _reads_only(use, x):
            continue
        schema = getattr(use.target, "_schema", None)
        if schema is None or not schema.name.startswith("aten::") or not schema.arguments:
            return False
        first = schema.arguments[0].alias_info
        if first is None or not all(_aliases(r, first) for r in schema.returns):
            return False
        if first.is_write and use.args[0] is x:
            return False
        if not first.is_write and not (use.args[0] is x and _done_before(use, node, order, view=True)):
            return False
    return True


def _aliases(ret: Any, first: Any) -> bool:
    """Does a schema return alias the first argument (``Tensor(a)``; a list of views of it,
    ``Tensor(a)[]``, for a first argument marked ``Tensor(a -> *)``)?"""
    info = ret.alias_info
    return info is not None and (info.before_set == first.before_set or (not info.before_set and "*" in first.after_set))


def _reads_only(use: torch.fx.Node, x: torch.fx.Node) -> bool:
    """Does ``use`` (not a collective) take ``x`` only as plain inputs, never written nor returned as
    a view (``vsf::adam_step_`` reads its ``param`` while it updates the moments in place)?"""
    schema = getattr(use.target, "_schema", None)
    if schema is None or schema.name.startswith("_c10d_functional"):
        return False
    by_name = {a.name: a for a in schema.arguments}
    holding = [schema.arguments[i] for i, a in enumerate(use.args) if x in pytree.tree_leaves(a)]
    holding += [by_name[k] for k, a in use.kwargs.items() if x in pytree.tree_leaves(a)]
    return bool(holding) and all(a.alias_info is None for a in holding)


def _inplace_variant(op: Any) -> tuple[Any, list[tuple[int, int]]] | None:
    """``X_.<overload>`` for an out-of-place ``X.<overload>`` (aten's, or vsf's own ops) with the same
    arguments, and which arguments it overwrites: ``(argument, result)`` index pairs, read from
    its schema's alias annotations (``add_``: ``[(0, 0)]``). ``None`` if there is none."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.startswith(("aten::", "vsf::")) or schema.is_mutable or not _allocates_op(op):
        return None
    namespace, base = schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), base + "_", None)
    target = getattr(packet, op._overloadname, None) if packet is not None else None
    if target is None or len(target._schema.arguments) != len(schema.arguments):
        return None
    returns = [r.alias_info.before_set if r.alias_info is not None else None for r in target._schema.returns]
    writes = [(i, returns.index(a.alias_info.before_set)) for i, a in enumerate(target._schema.arguments) if a.alias_info is not None and a.alias_info.is_write and a.alias_info.before_set in returns]
    return (target, writes) if writes else None


def _allocates_op(op: Any, index: int | None = None) -> bool:
    """Are ``op``'s results (or its result ``index``) new tensors, not views or inputs it returns?"""
    returns = op._schema.returns if index is None else op._schema.returns[index : index + 1]
    return op.__name__.split(".")[0] not in _VIEWS and not any(r.alias_info is not None for r in returns)
