"""Donation, one feature in one place: a donated argument's DTensors are released after the call
(their local shards replaced by a stand-in whose every use raises an error that says where the
value went), and the lowered program may update donated buffers in place where an op's result
takes exactly their place, as XLA reuses donated buffers.

Example::

    >>> step = vsf.jit(train_step, donate_argnums=(0, 1))
    >>> params, opt_state, loss = step(params, opt_state, batch)   # the old params are released
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor

from vsf import _compat, tree
from vsf.jit.graph import output_node, placeholders_of

__all__ = ["Donated", "Donation", "allocates", "check_not_donated", "reuse_donated"]


class Donated(torch.Tensor):
    """Stands in for a donated DTensor's local shard: any use raises an error that says why
    (leaf ``k`` of argument ``i``, a tree of structure ``structure``, donated to the function ``name``)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, i: int, structure: tree.PyTreeSpec, k: int) -> "Donated":
        r = _compat.wrapper_tensor(cls, like)
        r._donated_to = (name, i, structure, k)
        return r

    @property
    def where(self) -> str:
        """``fn (as args[i]['path'])``: written only when an error needs it, not on every call."""
        name, i, structure, k = self._donated_to
        arg = tree.unflatten(structure, [object() for _ in range(structure.num_leaves)])
        return f"{name} (as args[{i}]{tree.keystr(tree.leaves_with_path(arg)[k][0], brackets=True)})"

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        where = next(a.where for a in _compat.torch_tree_leaves((args, kwargs)) if isinstance(a, Donated))
        raise RuntimeError(
            f"this value was donated to {where}, which released its memory; use the value that call returned"
        )


class Donation:
    """What the calls of one program do with their donated leaves, ``located`` as
    :meth:`vsf.jit.call.Call.located` lists them (``(j, i, k)``: leaf ``j`` of a call is leaf ``k``
    of its positional argument ``i``; the same for every call of one program, its arguments having
    one structure): after each call, each DTensor among them holds a stand-in (:class:`Donated`),
    made on the first call and reused by later ones. Making the stand-ins took half of a call's
    donation (a GPT step's 110 leaves: 0.25 of 0.45 ms), and flattening the arguments again a
    quarter of the rest."""

    def __init__(self, name: str, located: list[tuple[int, int, int]]) -> None:
        self.name, self.located = name, located
        self.leaves = [j for j, _, _ in located]  # the donated leaves' positions among a call's
        self.stand_ins: dict[int, Donated] = {}

    def release(self, args: tuple[Any, ...], leaves: Sequence[Any]) -> None:
        """Release the donated DTensors among ``leaves``, a call's flattened arguments (``args``:
        its positional arguments, whose structure a stand-in's message names)."""
        for j, i, k in self.located:
            leaf = leaves[j]
            if isinstance(leaf, DTensor):
                stand_in = self.stand_ins.get(j)
                if stand_in is None:
                    local = _compat.dtensor_local(leaf)
                    stand_in = self.stand_ins[j] = Donated(local, self.name, i, tree.structure(args[i]), k)
                _compat.swap_local(leaf, stand_in)


def check_not_donated(leaf: DTensor, name: Callable[[], str]) -> None:
    """Refuse an argument (named ``name()``, computed only for the error) that an earlier call took as donated."""
    local = _compat.dtensor_local(leaf)
    if isinstance(local, Donated):
        raise RuntimeError(
            f"{name()} was donated to {local.where}, which released its memory; pass the value that call returned"
        )


def reuse_donated(
    gm: torch.fx.GraphModule, local_inputs: Sequence[torch.Tensor], donated: Sequence[int]
) -> torch.fx.GraphModule:
    """Let the lowered program ``gm`` overwrite its inputs at positions ``donated``: it updates them
    in place where an op's result takes exactly their place (a donated optimizer state's ``lerp``,
    a donated param's ``sub``). An input passed twice is never overwritten."""
    placeholders = placeholders_of(gm)
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
    one of them qualifies; where the twin does not return what it overwrites (``adam_step_``
    returns the update alone), that result's uses read the overwritten argument instead."""
    outputs = set(output_node(gm).all_input_nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        variant = _inplace_variant(node.target) if node.op == "call_function" else None
        if variant is None:
            continue
        inplace, writes = variant
        results = _results(node)
        if all(_overwritable(node, i, results.get(j), owned, outputs, order) for i, j in writes):
            node.target = inplace
            owned.update(_take_returns(gm, node, results, writes))


def _take_returns(
    gm: torch.fx.GraphModule, node: torch.fx.Node, results: dict[int, torch.fx.Node], writes: list[tuple[int, int]]
) -> list[torch.fx.Node]:
    """Rewire the uses of ``node``'s results, now that it calls an in-place twin that returns
    fewer values: a result it no longer returns is the argument it overwrote, a lone result the
    node itself. Returns the nodes now standing for the overwritten values."""
    returned = len(_compat.op_schema(node.target).returns)
    standing = {j: results[j] for j in results}
    for i, j in writes:
        if j >= returned:  # the twin writes it, returns it not: its uses read the argument
            standing[j] = node.args[i]
    if returned == 1 and isinstance(node.meta.get("val"), (list, tuple)):  # one result, no longer a tuple
        node.meta["val"] = node.meta["val"][0]
        standing[0] = node
    for j, r in results.items():
        if standing[j] is not r:
            r.replace_all_uses_with(standing[j])
            gm.graph.erase_node(r)
    return [standing[j] for _, j in writes]


def _results(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """The nodes that stand for each tensor ``node`` returns: itself, or its ``getitem`` users."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return {0: node}
    return {use.args[1]: use for use in node.users if use.target is operator.getitem}


def _overwritable(
    node: torch.fx.Node,
    i: int,
    result: torch.fx.Node | None,
    owned: set[torch.fx.Node],
    outputs: set[torch.fx.Node],
    order: dict[torch.fx.Node, int],
) -> bool:
    """May ``node``'s argument ``i`` take the place of ``result``, the value computed from it?"""
    x = node.args[i] if i < len(node.args) else None
    if not isinstance(x, torch.fx.Node) or result is None or x in outputs:
        return False
    if not (x in owned or (x.op == "call_function" and allocates(x))) or not _done_before(x, node, order):
        return False
    a, out = x.meta.get("val"), result.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    return a.shape == out.shape and a.dtype == out.dtype and a.stride() == out.stride()


_VIEWS = (
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "expand",
    "slice",
    "select",
    "split",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "as_strided",
    "reshape",
    "unbind",
    "diagonal",
    "narrow",
)


def allocates(node: torch.fx.Node) -> bool:
    """Does ``node`` (an fx ``call_function`` node) produce a new buffer (not a view of an input,
    not a collective's buffer)? For one result of a multi-result op (a ``getitem``), does that result?

    Example::

        >>> allocates(mm_node), allocates(t_node)
        (True, False)
    """
    op, index = node.target, None
    if op is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        op, index = node.args[0].target, node.args[1]
    schema = _compat.op_schema(op)
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
        schema = _compat.op_schema(use.target)
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
    return info is not None and (
        info.before_set == first.before_set or (not info.before_set and "*" in first.after_set)
    )


def _reads_only(use: torch.fx.Node, x: torch.fx.Node) -> bool:
    """Does ``use`` (not a collective) take ``x`` only as plain inputs, never written nor returned as
    a view (``vsf::adam_step_`` reads its ``param`` while it updates the moments in place)?"""
    schema = _compat.op_schema(use.target)
    if schema is None or schema.name.startswith("_c10d_functional"):
        return False
    by_name = {a.name: a for a in schema.arguments}
    holding = [schema.arguments[i] for i, a in enumerate(use.args) if x in _compat.torch_tree_leaves(a)]
    holding += [by_name[k] for k, a in use.kwargs.items() if x in _compat.torch_tree_leaves(a)]
    return bool(holding) and all(a.alias_info is None for a in holding)


def _inplace_variant(op: Any) -> tuple[Any, list[tuple[int, int]]] | None:
    """``X_.<overload>`` for an out-of-place ``X.<overload>`` (aten's, or vsf's own ops) with the same
    arguments, and which arguments it overwrites: ``(argument, result)`` index pairs, read from
    its schema's alias annotations (``add_``: ``[(0, 0)]``). An overwritten argument that the twin
    does not return takes the place of the out-of-place op's results after the twin's own, in
    argument order (functionalization's convention: ``vsf::adam_step_`` returns the update and
    overwrites the moments, ``adam_step``'s results 1 and 2: ``[(1, 1), (2, 2)]``). ``None`` if there is none."""
    schema = _compat.op_schema(op)
    if schema is None or not schema.name.startswith(("aten::", "vsf::")) or schema.is_mutable or not _allocates_op(op):
        return None
    namespace, base = schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), base + "_", None)
    target = getattr(packet, _compat.overload_name(op), None) if packet is not None else None
    if target is None or len(_compat.op_schema(target).arguments) != len(schema.arguments):
        return None
    twin = _compat.op_schema(target)
    returns = [r.alias_info.before_set if r.alias_info is not None else None for r in twin.returns]
    written = [
        (i, a.alias_info.before_set)
        for i, a in enumerate(twin.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    unreturned = iter(range(len(twin.returns), len(schema.returns)))
    writes = [(i, returns.index(alias) if alias in returns else next(unreturned, None)) for i, alias in written]
    return (target, writes) if writes and all(j is not None for _, j in writes) else None


def _allocates_op(op: Any, index: int | None = None) -> bool:
    """Are ``op``'s results (or its result ``index``) new tensors, not views or inputs it returns?"""
    returns = _compat.op_schema(op).returns if index is None else _compat.op_schema(op).returns[index : index + 1]
    return op.__name__.split(".")[0] not in _VIEWS and not any(r.alias_info is not None for r in returns)
