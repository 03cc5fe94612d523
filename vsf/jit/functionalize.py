"""Functionalizing a traced step: its in-place ops made out-of-place and its ``_foreach_*`` ops split
into one op per tensor, so that every node of the plan's graph has one tensor per operand and no op
writes to another op's value.

This takes a second trace (``torch.func.functionalize`` over graph nodes run one by one), but only
of the ops the writes reach (:func:`_written_region`): the ops to rewrite, every op that may alias
a value written (its views, the writes), and every op that reads one of those. The rest of the
graph (in a training step that writes only in its optimizer, the whole forward and backward;
in mamba.py's, all but each block's parallel scan) is pure and stays as it is, its nodes and
marks included, and each op of the region is replaced where it stands by the ops its trace
records. Where a write may reach a graph input or a constant, or changes its value's shape
(``squeeze_``: functionalization keeps such a write to an input of its trace), every op is
traced again, which follows the write through the views (and keeps the write to a graph input,
which :func:`vsf.jit.trace.trace` refuses). Either way the graph is the one a functionalizing
trace of every op gives (tests compare the plans).

A step whose ops from the first to rewrite on write nothing in place, whose rewritten ops are
out-of-place foreach ops with a per-tensor op of the same arguments (``vsf.optim.apply_updates``'s ``_foreach_add``), is not
traced again at all: each such node is replaced in the graph by its per-tensor ops, the nodes
that trace would record (its fake values computed op by op), which is most of a deep step's
functionalization time saved (a trace of the tail costs about two milliseconds a leaf).

Example::

    >>> gm = functionalized(joint, decompositions={})
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from vsf import _compat
from vsf.jit.copies import COPY
from vsf.jit import stamp_key
from vsf.jit.graph import is_tensor_node, output_node

__all__ = ["functionalized"]

aten = torch.ops.aten


def functionalized(gm: torch.fx.GraphModule, decompositions: Mapping[Any, Callable[..., Any]]) -> torch.fx.GraphModule:
    """``gm`` with its in-place ops functionalized and its ``_foreach_*`` ops split per tensor (``gm``
    itself, changed in place, where it has such ops; ``decompositions`` apply to the ops traced
    again), re-tracing only the ops that write, alias a value written or read one
    (:func:`_written_region`) where that gives the same graph, else every op.

    Example::

        >>> gm = functionalized(joint, never_planned_decompositions())
        >>> any(n.target is torch.ops.aten._foreach_add.List for n in gm.graph.nodes)
        False
    """
    nodes = list(gm.graph.nodes)
    first = next((i for i, n in enumerate(nodes) if _needs_rewrite(n)), None)
    if first is None:
        return gm
    if _splits_in_place(nodes[first:], decompositions):
        _split_foreach_nodes(gm, nodes[first:])
        return gm
    region = _written_region(nodes)
    parts = [[n for n in nodes if n.op == "call_function"]] if region is None else _parts(region)
    _retrace(gm, parts, decompositions)
    return gm


def _written_region(nodes: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The ops to trace again, in graph order: every op to rewrite (:func:`_needs_rewrite`) and each
    getitem of its results, every op that may alias a value written in place (its views, the
    writes themselves), and every op that reads one of those or a written value; ``None`` where a
    write may reach a graph input or a constant (its value is no op's own result), changes the
    shape of what it writes (:func:`_changes_shape`: functionalization keeps such a write to an
    input of its trace), or the region would read or give a value that is not one tensor.
    Only the region sees the writes: a value outside it reads nothing written, and every reader
    of a written value is in it, so it is traced alone on the values it reads."""
    if any(_changes_shape(n) for n in nodes):
        return None
    bases = {b for n in nodes for arg in _written_args(n) for b in _bases(arg)}
    if not all(b.op == "call_function" and is_tensor_node(b) for b in bases):
        return None
    aliased, stack = set(bases), list(bases)  # (what may share a written value's storage)
    while stack:
        for u in stack.pop().users:
            if u.op == "call_function" and _aliases(u) and u not in aliased:
                aliased.add(u)
                stack.append(u)
    region = {n for n in nodes if _needs_rewrite(n)} | (aliased - bases)
    region |= {u for n in aliased for u in n.users if u.op == "call_function"}
    region |= {u for n in region if not is_tensor_node(n) for u in n.users if u.target is operator.getitem}
    inputs = {i for n in region for i in n.all_input_nodes if i not in region}
    given = {n for n in region if any(u not in region for u in n.users)}
    if not all(is_tensor_node(n) for n in inputs | given):
        return None
    return [n for n in nodes if n in region]


def _bases(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The values ``node`` may be a view of (itself, if it aliases nothing): its inputs followed
    while each may alias them (:func:`_aliases`)."""
    out, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _aliases(n):
            stack.extend(n.all_input_nodes)
        else:
            out.add(n)
    return out


def _parts(region: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """``region`` split into the parts that share nothing written: the ops joined by the values
    they pass each other and by the values outside the region they write into (each part in graph
    order; a view of a written value is in the region). A part is traced alone: the others' writes
    do not reach it."""
    inside = set(region)
    written = {b for n in region for arg in _written_args(n) for b in _bases(arg) if b not in inside}
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        top = n
        while (up := parent.get(top, top)) is not top:
            top = up
        while n is not top:  # (each node on the way now points at the root)
            up, parent[n] = parent[n], top
            n = up
        return top

    for n in region:
        for i in n.all_input_nodes:
            if i in inside or i in written:
                parent[root(n)] = root(i)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in region:
        groups.setdefault(root(n), []).append(n)
    return list(groups.values())


def _retrace(
    gm: torch.fx.GraphModule, parts: list[list[torch.fx.Node]], decompositions: Mapping[Any, Callable[..., Any]]
) -> None:
    """Trace each of ``parts`` (ops of ``gm``, in order, sharing nothing written) again through
    ``torch.func.functionalize`` on the values it reads, once per shape of part (its ops and
    arguments, the metadata of what it reads: a stamped block's copies are parts alike), and put
    the ops each of its nodes records in that node's place (:func:`_put`)."""
    inside = {n for part in parts for n in part}
    traces: dict[Any, _Trace] = {}
    for part in parts:
        inputs = list(dict.fromkeys(i for n in part for i in n.all_input_nodes if i not in inside))
        given = [n for n in part if any(u not in inside for u in n.users)]
        key = _shape_of(part, inputs, given) if len(parts) > 1 else None  # (one part: none to share)
        if key not in traces:
            traces[key] = _trace_part(gm, part, inputs, given, decompositions)
        _put(gm, part, inputs, given, inside, traces[key])
    for n in reversed([n for n in gm.graph.nodes if n in inside]):
        gm.graph.erase_node(n)
    gm.recompile()


def _shape_of(part: list[torch.fx.Node], inputs: list[torch.fx.Node], given: list[torch.fx.Node]) -> Any:
    """What a part's trace depends on: its ops and their arguments (each node read as its place
    in the part or among its inputs, each other value with its type: ``1``, ``1.0`` and ``True``
    differ, as do ``0.0`` and ``-0.0``), the metadata of its inputs, which of its ops the graph
    reads after it; a part whose arguments cannot be compared is its own shape."""
    places = {n: ("op", k) for k, n in enumerate(part)} | {n: ("in", k) for k, n in enumerate(inputs)}

    def exact(x: Any) -> Any:
        return places[x] if isinstance(x, torch.fx.Node) else stamp_key.exact(x)

    metas = [n.meta["val"] for n in inputs]
    key = (
        tuple([(n.target, torch.fx.node.map_aggregate((n.args, n.kwargs), exact)) for n in part]),
        tuple([(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad) for t in metas]),
        tuple([places[n] for n in given]),
    )
    try:
        hash(key)
    except TypeError:
        return ("unlike any other", id(part))
    return key


def _trace_part(
    gm: torch.fx.GraphModule,
    part: list[torch.fx.Node],
    inputs: list[torch.fx.Node],
    given: list[torch.fx.Node],
    decompositions: Mapping[Any, Callable[..., Any]],
) -> _Trace:
    """The functionalizing trace of ``part`` on fake values like its ``inputs``' (distinct ones),
    giving the values of ``given``."""
    interpreter, ends = torch.fx.Interpreter(gm), []

    def run(*values: torch.Tensor) -> list[Any]:
        interpreter.env = dict(zip(inputs, values))
        recording = _compat.tracer().graph
        for n in part:
            interpreter.env[n] = interpreter.run_node(n)
            ends.append(recording._root.prev)
        return [interpreter.env[n] for n in given]

    with fx_traceback.preserve_node_meta():
        traced = make_fx(
            torch.func.functionalize(run, remove="mutations"),
            decomposition_table=dict(decompositions) | _FOREACH_DECOMPOSITIONS,
            tracing_mode="fake",
        )(*_compat.distinct([n.meta["val"] for n in inputs]))
    for node in traced.graph.find_nodes(op="get_attr"):
        name = _fresh_attribute(gm, node.target)
        setattr(gm, name, getattr(traced, node.target))
        node.target = name
    nodes = list(traced.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    placeholders = traced.graph.find_nodes(op="placeholder")
    cuts = [len(placeholders), *(at[end] + 1 for end in ends)]
    per_op = [nodes[a:b] for a, b in zip(cuts, itertools.accumulate(cuts[1:], max))]
    return _Trace(part, placeholders, per_op, nodes[max(cuts) : -1], nodes[-1])


@dataclasses.dataclass(frozen=True)
class _Trace:
    """A part's functionalizing trace: the part, its placeholders (the part's inputs), per op of the
    part the nodes its run recorded, the nodes recorded once the part had run (the writes back into
    its inputs, the views of written values it gives), and its output node."""

    part: list[torch.fx.Node]
    placeholders: list[torch.fx.Node]
    per_op: list[list[torch.fx.Node]]
    after: list[torch.fx.Node]
    output: torch.fx.Node

    @functools.cached_property
    def metas(self) -> list[dict[str, Any]]:
        """Per op of the part, the metadata the trace gave the nodes recorded from it
        (:func:`vsf._compat.recorded_meta`): asked only where another part copies the trace."""
        return [_compat.recorded_meta(n) for n in self.part]


def _put(
    gm: torch.fx.GraphModule,
    part: list[torch.fx.Node],
    inputs: list[torch.fx.Node],
    given: list[torch.fx.Node],
    inside: set[torch.fx.Node],
    trace: _Trace,
) -> None:
    """Put in ``gm`` the ops ``trace`` records (of ``part``, or of a part of the same shape): each
    op's in its place, with the metadata the trace gives it from that op (its stack trace, module
    stack, ...: ``part``'s own op's, where the trace is another part's) and the mark
    of the copy it belongs to; the ops recorded once the part has run (the writes back into what
    it read) before the output. A write back into a value an op made (not a graph input) is
    dropped: every reader of it is in the region, and the graph's output, if it reads it, reads the
    value written instead. The graph's readers of ``given`` read their new values. The nodes are
    copied without fx's search of their arguments for symbolic numbers (:func:`vsf._compat.copy_nodes`):
    a trace of fake tensors of static shapes records none."""
    graph = gm.graph
    env: dict[torch.fx.Node, Any] = dict(zip(trace.placeholders, inputs))
    own = trace.part is part
    for n, recorded, traced_meta in zip(part, trace.per_op, [None] * len(part) if own else trace.metas):
        with graph.inserting_before(n):
            _compat.copy_nodes(graph, recorded, env)
        meta = None if traced_meta is None else _compat.recorded_meta(n)
        copy = n.meta.get(COPY)
        for r in recorded:
            new = env[r]
            if meta is not None:
                for field in traced_meta.keys() - meta.keys():
                    new.meta.pop(field, None)
                new.meta.update(meta)
            if copy is not None:
                new.meta[COPY] = copy
    out = output_node(gm)
    written_back: dict[torch.fx.Node, torch.fx.Node] = {}  # an op's value: what the part wrote to it
    with graph.inserting_before(out):
        for r in trace.after:
            if r.target is aten.copy_.default and r.args[0].op == "placeholder" and env[r.args[0]].op != "placeholder":
                written_back[env[r.args[0]]] = env[r.args[1]]
            else:
                _compat.copy_nodes(graph, [r], env)
    news = torch.fx.node.map_arg(trace.output.args[0], env.__getitem__)
    for n, new in zip(given, news, strict=True):
        n.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside)
    out.args = torch.fx.node.map_arg(out.args, lambda n: written_back.get(n, n))


def _splits_in_place(tail: list[torch.fx.Node], decompositions: Mapping[Any, Callable[..., Any]]) -> bool:
    """May the tail be rewritten without a trace: does it write nothing in place, is each op of it
    to rewrite an out-of-place foreach op whose per-tensor op takes the same arguments (and is not
    decomposed further), is every other op one that a functionalizing trace records as it is
    (neither writing nor aliasing), and is each foreach result read only element by element?"""
    for node in tail:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            if not (isinstance(node.args[0], torch.fx.Node) and node.args[0].target in _PER_TENSOR):
                return False
            continue
        schema = _compat.op_schema(node.target)
        if schema is None or schema.is_mutable:
            return False
        if node.target in _PER_TENSOR:
            if _PER_TENSOR[node.target] in decompositions or any(u.target is not operator.getitem for u in node.users):
                return False
        elif _needs_rewrite(node) or _aliases(node):
            return False
    return True


def _split_foreach_nodes(gm: torch.fx.GraphModule, tail: list[torch.fx.Node]) -> None:
    """Replace each foreach node of ``tail`` (:func:`_splits_in_place` holds) by its per-tensor ops,
    as the trace of :func:`_split_foreach` records them: in element order where the foreach op
    was, with its metadata, each with the fake value the per-tensor op gives."""
    graph = gm.graph
    elements: dict[torch.fx.Node, torch.fx.Node] = {}  # each getitem of a foreach node: the op now in its place
    for node in tail:
        if node.target not in _PER_TENSOR:
            continue
        op = _PER_TENSOR[node.target]
        meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        news = []
        with graph.inserting_before(node):
            for args, kwargs in _elements(node.args, node.kwargs):
                new = graph.create_node("call_function", op, args, kwargs, name=op.overloadpacket.__name__)
                new.meta.update(meta)
                new.meta["val"] = op(*_values(args), **_values(kwargs))
                news.append(new)
        elements.update({user: news[user.args[1]] for user in node.users})
    readers = {user for got in elements for user in got.users}
    for reader in readers:  # (each reader rewritten once: the output reads every leaf's)
        reader.args = torch.fx.node.map_arg(reader.args, lambda n: elements.get(n, n))
        reader.kwargs = torch.fx.node.map_arg(reader.kwargs, lambda n: elements.get(n, n))
    for node in reversed(tail):
        if node in elements or node.target in _PER_TENSOR:
            graph.erase_node(node)
    gm.recompile()


def _values(x: Any) -> Any:
    """``x`` with each node replaced by its fake value."""
    return torch.fx.node.map_arg(x, lambda n: n.meta["val"])


def _changes_shape(node: torch.fx.Node) -> bool:
    """Is ``node`` an in-place view op (``t_``, ``transpose_``: tagged so), or an in-place op whose
    out-of-place twin is a view (``squeeze_``, which torch does not tag): does it change its input's
    shape and strides, not its data? torch's ``matmul`` of a vector by a matrix ends in one
    (``squeeze_`` of its ``mm``'s result)."""
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable or not schema.name.endswith("_"):
        return False
    if torch.Tag.inplace_view in node.target.tags:
        return True
    packet = getattr(aten, schema.name.split("::")[-1][:-1], None)
    twin = getattr(packet, _compat.overload_name(node.target), None)
    return twin is not None and _returns_a_view(_compat.op_schema(twin))


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an op writes to in place (its arguments marked ``Tensor(a!)``, lists of them included)."""
    schema = _compat.op_schema(node.target) if node.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    bound = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    out: list[torch.fx.Node] = []
    for a in schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write and a.name in bound:
            x = bound[a.name]
            out.extend(x if isinstance(x, (list, tuple)) else [x])
    return [x for x in out if isinstance(x, torch.fx.Node)]


def _aliases(node: torch.fx.Node) -> bool:
    """May ``node``'s result share storage with one of its inputs (a view, a ``getitem`` of a
    ``split``, an in-place op's result; any op without a schema, to be safe)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and _aliases(node.args[0])
    return _returns_a_view(_compat.op_schema(node.target))


def _returns_a_view(schema: Any) -> bool:
    """May an op of this schema return a value sharing storage with an input (``True`` without one)?"""
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _fresh_attribute(gm: torch.fx.GraphModule, name: str) -> str:
    """``name``, or ``name_1``, ``name_2``, ...: the first that ``gm`` has no attribute of."""
    fresh, i = name, 0
    while hasattr(gm, fresh):
        i += 1
        fresh = f"{name}_{i}"
    return fresh


def _needs_rewrite(node: torch.fx.Node) -> bool:
    """In-place and ``_foreach_`` ops are rewritten (functionalized, split per tensor)."""
    if node.op != "call_function":
        return False
    schema = _compat.op_schema(node.target)
    return schema is not None and (schema.is_mutable or node.target in _FOREACH_DECOMPOSITIONS)


def _elements(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """A foreach op's arguments split per element: each list argument's element, the others as they are."""
    n = next(len(a) for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)))
    pick = lambda a, i: a[i] if isinstance(a, (list, tuple)) else a  # noqa: E731
    return [(tuple(pick(a, i) for a in args), {k: pick(v, i) for k, v in kwargs.items()}) for i in range(n)]


def _split_foreach(elementwise: Any) -> Callable[..., list[torch.Tensor]]:
    def per_tensor(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return [elementwise(*a, **k) for a, k in _elements(args, kwargs)]

    return per_tensor


def _per_element(fn: Callable[..., torch.Tensor], lists: int) -> Callable[..., list[torch.Tensor]]:
    """``fn(*tensors_i, *extra_i)`` per element of the first ``lists`` list arguments (a later
    list argument, e.g. ``scalars``, is indexed per element too)."""

    def per_tensor(*args: Any) -> list[torch.Tensor]:
        n = len(args[0])
        pick = lambda a, i: a[i] if isinstance(a, (list, tuple)) else a  # noqa: E731
        return [fn(*(pick(a, i) for a in args)) for i in range(n)]

    return per_tensor


# Foreach ops whose per-tensor op has a different signature (DTensor's resolver does not map them).
_MANUAL_FOREACH = {
    aten._foreach_addcmul.Scalar: _per_element(lambda s, a, b, v=1: aten.addcmul.default(s, a, b, value=v), 3),
    aten._foreach_addcmul.ScalarList: _per_element(lambda s, a, b, v: aten.addcmul.default(s, a, b, value=v), 3),
    aten._foreach_addcdiv.Scalar: _per_element(lambda s, a, b, v=1: aten.addcdiv.default(s, a, b, value=v), 3),
    aten._foreach_addcdiv.ScalarList: _per_element(lambda s, a, b, v: aten.addcdiv.default(s, a, b, value=v), 3),
    aten._foreach_maximum.Scalar: _per_element(lambda s, v: aten.clamp_min.default(s, v), 1),
    aten._foreach_maximum.ScalarList: _per_element(lambda s, v: aten.clamp_min.default(s, v), 1),
    aten._foreach_minimum.Scalar: _per_element(lambda s, v: aten.clamp_max.default(s, v), 1),
    aten._foreach_minimum.ScalarList: _per_element(lambda s, v: aten.clamp_max.default(s, v), 1),
    aten._foreach_norm.Scalar: _per_element(
        lambda s, o=2, dtype=None: aten.linalg_vector_norm.default(s, o, dtype=dtype), 1
    ),
}


def _per_tensor_ops() -> dict[Any, Any]:
    """Each out-of-place foreach op whose per-tensor op takes the same arguments, element by element."""
    table = {}
    for name in dir(aten):
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            elementwise = _compat.foreach_elementwise_op(op)
            if elementwise is not None:
                table[op] = elementwise
    return table


_PER_TENSOR = _per_tensor_ops()
_FOREACH_DECOMPOSITIONS = _MANUAL_FOREACH | {op: _split_foreach(e) for op, e in _PER_TENSOR.items()}
