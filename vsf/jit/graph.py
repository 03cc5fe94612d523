"""Facts about a traced fx graph that every stage of ``jit`` reads.

A *value* is ``(node, output index)``: the result of an op, ``getitem`` resolved. These helpers
find a graph's inputs, output and ops, the tensor arguments of an op and their fake tensors, and
the user's source line an op came from (for errors).

Example::

    >>> [value_of(a) for a in output_node(gm).args[0]]   # the values the graph returns
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from vsf import _compat

__all__ = [
    "GETITEM",
    "constant_write",
    "eliminate_dead_code",
    "LIBRARY_DIRS",
    "Value",
    "is_library_file",
    "is_tensor_node",
    "is_view",
    "memory_of",
    "meta_of",
    "op_nodes",
    "output_node",
    "outputs_meta",
    "per_op",
    "placeholders_of",
    "signature",
    "source_line",
    "tensor_args",
    "user_line",
    "value_of",
]


Value = tuple[torch.fx.Node, int]


GETITEM = operator.getitem  # the fx target of tuple indexing


def placeholders_of(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's inputs, in order (``placeholders_of(gm)[i]`` is the i-th flat input)."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The graph's ``output`` node (its arguments are the values the graph returns)."""
    return next(n for n in gm.graph.nodes if n.op == "output")


def value_of(arg: torch.fx.Node) -> Value:
    """The (producer, output index) a graph argument refers to (``getitem`` nodes resolved)."""
    if arg.op == "call_function" and arg.target is GETITEM:
        return (arg.args[0], arg.args[1])
    return (arg, 0)


def outputs_meta(node: torch.fx.Node) -> list[torch.Tensor | None]:
    """The fake tensor of each output of ``node`` (``None`` for a non-tensor output; ``[]`` for none)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def tensor_args(node: torch.fx.Node) -> list[Value]:
    """The values ``node`` takes as tensor arguments, in argument order (``add(x, x)``: ``x`` twice)."""
    found: list[torch.fx.Node] = []
    _nodes_in(node.args, found)
    _nodes_in(node.kwargs.values(), found)
    return [value_of(a) for a in found if is_tensor_node(a)]


def _nodes_in(items: Any, found: list[torch.fx.Node]) -> None:
    """Append to ``found`` the nodes among the leaves of the fx arguments ``items``, in pytree order
    (a quicker ``torch_tree_leaves`` for the lists, tuples and dicts fx arguments are made of)."""
    for x in items:
        if isinstance(x, torch.fx.Node):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            _nodes_in(x, found)
        elif isinstance(x, dict):
            _nodes_in(x.values(), found)


def is_tensor_node(n: torch.fx.Node) -> bool:
    """Does ``n`` produce one tensor (as opposed to a tuple, a number or nothing)?"""
    return isinstance(n.meta.get("val"), torch.Tensor)


def meta_of(v: Value) -> torch.Tensor:
    """The fake tensor of value ``v``: its global shape, stride and dtype."""
    out = outputs_meta(v[0])[v[1]]
    assert out is not None
    return out


def op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's ops in order: function calls and constants, tuple indexing resolved away."""
    return [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr") and n.target is not GETITEM]


def is_view(node: torch.fx.Node) -> bool:
    """Does ``node`` compute nothing: an op whose one tensor argument its result aliases
    (``detach``, ``t``, ``view``, ``transpose``)?

    Example::

        >>> is_view(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.t.default)[0])
        True
    """
    return node.op == "call_function" and _aliases_argument(node.target) and len(node.all_input_nodes) == 1


def per_op(fact: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``fact`` of an fx target, worked out once per op overload (an operator: its schema and tags
    never change, and it lives as long as the process) and each time for any other target.

    Example::

        >>> seeded = per_op(lambda op: torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()))
        >>> seeded(torch.ops.aten.bernoulli.p)
        True
    """
    known: dict[Any, bool] = {}

    def of(op: Any) -> bool:
        found = known.get(op)  # (it holds op overloads alone)
        if found is None:
            if _compat.op_schema(op) is None:
                return fact(op)
            found = known[op] = fact(op)
        return found

    return functools.wraps(fact)(of)


@per_op
def _aliases_argument(op: Any) -> bool:
    """Does ``op``'s schema say that its first result aliases an argument it does not write?"""
    schema = _compat.op_schema(op)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def constant_write(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, str, torch.Tensor] | None:
    """The first op of ``gm`` that writes into a tensor constant of it (a ``get_attr``, or a view
    of one: a tensor the traced function closed over), with the argument's name and the constant.

    Example::

        >>> node, name, t = constant_write(make_fx(lambda x: buf[:1].add_(x), tracing_mode="fake")(x))
        >>> (node.target, name, t is buf)
        (torch.ops.aten.add_.Tensor, 'self', True)
    """
    for node in gm.graph.nodes:
        for name, written in _compat.written_values(node.target, node.args, node.kwargs, kind=torch.fx.Node):
            if (base := memory_of(written)).op == "get_attr":
                return node, name, getattr(gm, base.target)
    return None


def memory_of(node: torch.fx.Node) -> torch.fx.Node:
    """The value whose memory ``node``'s value is, followed back through the ops whose result is
    an input's memory (views, ``getitem`` of a ``split``, in-place and ``out=`` ops).

    Example::

        >>> memory_of(node).op   # node: ``select(slice(x))``, x a graph input
        'placeholder'
    """
    index = 0
    while node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            node, index = node.args[0], node.args[1]
            continue
        source = _aliased_input(node, index)
        if source is None:
            return node
        node, index = source, 0
    return node


def _aliased_input(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    """The input whose memory the ``index``-th result of ``node``'s op is, by the op's schema (the
    argument of the result's alias set; for a list of views, the one argument with an alias set),
    or ``None``."""
    schema = _compat.op_schema(node.target)
    if schema is None or not schema.returns:
        return None
    alias = schema.returns[min(index, len(schema.returns) - 1)].alias_info
    aliased = [a for a in schema.arguments if a.alias_info is not None]
    if alias is None or not aliased:
        return None
    arg = next((a for a in aliased if a.alias_info.before_set & alias.before_set), aliased[0])
    value = (dict(zip((a.name for a in schema.arguments), node.args)) | node.kwargs).get(arg.name)
    return value if isinstance(value, torch.fx.Node) else None


def user_line(node: torch.fx.Node) -> str:
    """`` at <user's file:line: `code`>`` for an error message about ``node``, or ``""``. A backward
    op's own line is the step's gradient call, so for one (``avg_pool2d_backward``) the lines of
    the forward ops it may differentiate (``avg_pool2d`` in the same graph) are added.

    Example::

        >>> user_line(node)
        ' at File "train.py", line 9, in step: `grads = vsf.grad(loss)(p)` (the backward of aten.avg_pool2d.default at File "model.py", line 31, ...)'
    """
    line = source_line(node)
    where = f" at {line}" if line else ""
    forward = _forwards_of(node)
    lines = [f for f in dict.fromkeys(source_line(n) for n in forward) if f and f != line]
    if lines:
        more = f" and {len(lines) - 3} more" if len(lines) > 3 else ""
        where += f" (the backward of {forward[0].target} at {'; '.join(lines[:3])}{more})"
    return where


def _forwards_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes of ``node``'s graph calling the forward op of the backward op ``node`` calls
    (by name: ``aten::avg_pool2d`` for ``aten::avg_pool2d_backward``); none for another op."""
    schema = _compat.op_schema(node.target)
    if schema is None or not schema.name.endswith("_backward"):
        return []
    name = schema.name.removesuffix("_backward")
    return [
        n
        for n in node.graph.nodes
        if n.op == "call_function" and (s := _compat.op_schema(n.target)) is not None and s.name == name
    ]


LIBRARY_DIRS = tuple(
    d + os.sep for d in (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
)  # torch's, vsf's


def is_library_file(filename: str) -> bool:
    """Is ``filename`` torch's or vsf's own code (a frame there is never the user's line)?"""
    return filename.startswith(LIBRARY_DIRS)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` in this function's caller that names the innermost
    frame outside torch, vsf, ``contextlib`` and generated code: the user's line that planned or
    ran the step.

    Example::

        >>> warnings.warn("each Block is traced by itself", stacklevel=user_stacklevel())
    """
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and (
        is_library_file(name := frame.f_code.co_filename) or name == contextlib.__file__ or name.startswith("<")
    ):
        level, frame = level + 1, frame.f_back
    return level


def source_line(node: torch.fx.Node) -> str:
    """The user's source line that produced ``node``: the innermost frame recorded while tracing
    that is not torch's or vsf's own (a custom op's autograd wrapper, ``nn.Linear.forward``: the
    line that called them), or ``""``. A model library's code (``transformers``) is the user's.

    Example::

        >>> source_line(node)
        'File "train.py", line 12, in loss: `return my_op(x @ w).sum()`'
    """
    stack = node.meta.get("stack_trace") or ""
    lines = [l.strip() for l in stack.strip().splitlines() if l.strip()]
    for i in range(len(lines) - 1, -1, -1):
        frame = _FRAME.match(lines[i])
        if frame and not is_library_file(frame.group(1)):
            code = lines[i + 1] if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            return f"{lines[i]}: `{code}`" if code else lines[i]
    return ""


_FRAME = re.compile(r'File "(.*)", line \d+')  # a frame's header in a formatted stack trace


def signature(x: Any, seen: dict[int, tuple[torch.Tensor, Any]] | None = None) -> Any:
    """A hashable summary of op arguments (tensors by shape, strides and dtype), to cache per-op
    questions (DTensor's answer may depend on the strides: ``_grouped_mm``'s strategy drops a split
    whose local shard's strides its kernel cannot take). ``seen``: each fake tensor's summary so
    far, by its id (a stamped block's copies hold its trace's tensors: each is read once).

    Example::

        >>> signature(mm_node.args)
        (('T', (8, 6), (6, 1), torch.float32), ('T', (6, 4), (4, 1), torch.float32))
    """
    if isinstance(x, dict) and not x:  # (most ops' keyword arguments)
        return ()
    with _compat.metadata_reads():  # (the tensors' own answers, read once for every argument)
        return _signature(x, {} if seen is None else seen)


_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
_ATOM_TYPES = tuple(_ATOMS)


def _signature(x: Any, seen: dict[int, tuple[torch.Tensor, Any]]) -> Any:
    if isinstance(x, torch.fx.Node):
        t = x.meta.get("val")
        if not isinstance(t, torch.Tensor):
            return ("N", str(x))
        known = seen.get(id(t))
        if known is None or known[0] is not t:
            known = seen[id(t)] = (t, ("T", tuple(t.shape), t.stride(), t.dtype))
        return known[1]
    if isinstance(x, (list, tuple)):  # (a plain value as it is: most arguments are nodes and numbers)
        return tuple([a if type(a) in _ATOMS else _signature(a, seen) for a in x])
    if isinstance(x, dict):
        return tuple(sorted((k, _signature(v, seen)) for k, v in x.items()))
    return x if isinstance(x, _ATOM_TYPES) else repr(x)


def eliminate_dead_code(gm: torch.fx.GraphModule) -> None:
    """``gm.graph.eliminate_dead_code()``: every op that nothing reads and that has no side effect
    removed, last first, and so in the graph modules ``gm`` reads (fx's ``Node.is_impure``), but
    asking only the nodes nothing reads whether they have a side effect, and without fx's check of
    the whole graph's consistency first (a deep step's graph is consistent, and big: a millisecond
    a layer).

    Example::

        >>> eliminate_dead_code(gm)  # as gm.graph.eliminate_dead_code(), sooner
    """
    for node in reversed(gm.graph.nodes):
        if not node.users and not node.is_impure():
            gm.graph.erase_node(node)
    read = {node.target for node in gm.graph.find_nodes(op="get_attr")}
    for name, child in gm.named_children():
        if name in read and isinstance(child, torch.fx.GraphModule):
            child.graph.eliminate_dead_code()
            child.recompile()
