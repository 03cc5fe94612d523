"""DTensor's sharding strategies for an op, as the planner uses them: per mesh axis of ``n``
ranks, the list of (input placements -> output placements) an op allows; and DTensor's own
decision for an op on the full mesh. This is the only module of the planner that asks DTensor's
strategy registry.

Example::

    >>> strategies, is_fallback = Strategies(False, {mm_node: classify(mm_node)}).of(mm_node, 2)
    >>> strategies[0]
    Strategy(ins=(Shard(dim=0), Replicate()), outs=(Shard(dim=0),))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Shard
from torch.utils import _pytree as pytree

from vsf import _compat
from vsf.errors import PlanError
from vsf.jit.classify import OpClass
from vsf.jit.graph import is_tensor_node, meta_of, outputs_meta, signature, tensor_args, tensor_meta, user_line
from vsf.jit.plan import PARTIAL, Placements, R, is_shard
from vsf.sharding.named import RaggedPlacement

__all__ = ["Strategies", "Strategy", "dtensor_decision", "shardable"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    ins: tuple[Placement, ...]
    outs: tuple[Placement | None, ...]


class Strategies:
    """DTensor's candidate strategies per op and axis size, cached by op signature; ``classes``
    holds each op's :class:`~vsf.jit.classify.OpClass`."""

    def __init__(self, allow_replicated_fallback: bool, classes: dict[torch.fx.Node, OpClass]) -> None:
        self.fallback = allow_replicated_fallback
        self.classes = classes
        self.cache: dict[Any, tuple[list[Strategy], bool]] = {}

    def of(self, node: torch.fx.Node, n: int, ragged: Sequence[tuple[RaggedPlacement, int]] = ()) -> tuple[list[Strategy], bool]:
        """``(strategies, is_fallback)`` for ``node`` on an axis of ``n`` ranks; ``ragged`` lists the
        ragged splits ``(placement, rows)`` values on this axis have (they join per-row rules)."""
        key = (node.target, signature(node.args), signature(node.kwargs), n, tuple(ragged))
        if key not in self.cache:
            op = self.classes[node]
            found, fallback = self._compute(node, op, n)
            if ragged and (op.ragged_reduction or op.local):
                found = found + _ragged_variants(node, found, ragged)
            self.cache[key] = (found, fallback)
        return self.cache[key]

    def _compute(self, node: torch.fx.Node, op: OpClass, n: int) -> tuple[list[Strategy], bool]:
        ins = tensor_args(node)
        outs = outputs_meta(node)
        if op.kind == "constant":
            return [Strategy((), tuple(R if o is not None else None for o in outs))], False
        if op.kind == "constraint":
            return [Strategy((p,), (p,)) for p in _candidates(meta_of(ins[0]), n)], False
        if op.kind == "value_blind":
            inputs = [*_candidates(meta_of(ins[0]), n), Partial("avg"), Partial("max"), Partial("min")]
            return [Strategy((p,), (p if is_shard(p) else R,)) for p in inputs], False
        found = _single_dim(node, n) if op.rules == "single" else _by_each_input(node, n) if op.rules else None
        if found:
            return _valid(found, node, n), False
        if self.fallback:
            return [Strategy(tuple(R for _ in ins), tuple(R if o is not None else None for o in outs))], True
        raise PlanError(
            f"{node.target} has no DTensor sharding strategy, so vsf cannot shard it{user_line(node)}. "
            "Set vsf.config.allow_replicated_fallback = True to run it replicated (the plan flags it)."
        )


def _ragged_variants(node: torch.fx.Node, strategies: list[Strategy], ragged: Sequence[tuple[RaggedPlacement, int]]) -> list[Strategy]:
    """Per-row rules (every shard on dim 0 of a tensor with that many rows) run on a ragged split
    of those rows too: an elementwise op keeps ragged rows ragged, a sum over the rows of ragged
    operands is a partial sum."""
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    out = []
    for g, rows in ragged:
        for st in strategies:
            placed = [*st.ins, *st.outs]
            shards = [(t, p) for t, p in zip(metas, placed) if t is not None and p is not None and is_shard(p)]
            if not any(is_shard(p) for p in st.ins) or not all(isinstance(p, Shard) and p.dim == 0 and t.shape[0] == rows for t, p in shards):
                continue
            if any(isinstance(p, Partial) and p.reduce_op == "avg" for p in st.outs if p is not None):
                continue  # an average of per-rank averages is wrong when ranks hold different row counts
            swap = lambda p: g if isinstance(p, Shard) else p  # noqa: E731
            out.append(Strategy(tuple(swap(p) for p in st.ins), tuple(None if p is None else swap(p) for p in st.outs)))
    return out


def _meta_args(node: torch.fx.Node) -> tuple[Any, Any]:
    conv = lambda a: tensor_meta(a.meta["val"]) if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a  # noqa: E731
    return pytree.tree_map(conv, node.args), pytree.tree_map(conv, node.kwargs)


def _single_dim(node: torch.fx.Node, n: int) -> list[Strategy] | None:
    args, kwargs = _meta_args(node)
    outs = outputs_meta(node)
    out_meta = tensor_meta(outs[0]) if isinstance(node.meta.get("val"), torch.Tensor) else [None if o is None else tensor_meta(o) for o in outs]
    rules = _compat.single_dim_strategies(node.target, args, kwargs, out_meta)
    if rules is None:
        return None
    n_out = len(outs)
    return [Strategy(tuple(R if p is None else p for p in rule[n_out:]), tuple(rule[:n_out])) for rule in rules]


def _candidates(t: torch.Tensor, n: int) -> list[Placement]:
    return [R, PARTIAL] + [Shard(d) for d in range(t.ndim) if t.shape[d] >= n and t.shape[d] > 1]


def _by_each_input(node: torch.fx.Node, n: int) -> list[Strategy] | None:
    """Ask a whole-op strategy function (or rule) once per candidate placement of each tensor input
    that is not a scalar, the other inputs replicated: most functions follow their first input,
    some another one (``nll_loss_backward`` follows ``self``, its second)."""
    prop = _compat.sharding_propagator()
    op = node.target
    func = prop.op_strategy_funcs.get(op)
    rule = prop.op_to_rules.get(op)
    if func is None and rule is None:
        return None
    mesh = _compat.abstract_device_mesh(n)
    ins = tensor_args(node)
    found: dict[Strategy, None] = {}
    leads = [i for i, a in enumerate(ins) if i == 0 or meta_of(a).ndim > 0]
    for lead, placement in ((i, c) for i in leads for c in _candidates(meta_of(ins[i]), n)):
        seen = [0]

        def spec(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and is_tensor_node(a):
                p = placement if seen[0] == lead else R
                seen[0] += 1
                return _compat.DTensorSpec(mesh, (p,), tensor_meta=tensor_meta(a.meta["val"]))
            return a

        args = pytree.tree_map(spec, node.args)
        kwargs = pytree.tree_map(spec, node.kwargs)
        try:
            strategy = _run_strategy(func, rule, op, args, kwargs, node)
        except Exception:  # noqa: BLE001 - DTensor rejects this candidate input; try the next
            continue
        for s in strategy:
            found.setdefault(s)
    return list(found)


def _run_strategy(func: Any, rule: Any, op: Any, args: Any, kwargs: Any, node: torch.fx.Node) -> list[Strategy]:
    n_in = len(tensor_args(node))
    if func is not None:
        schema = _compat.OpSchema(op, tuple(_wrap(a) for a in args), {k: _wrap(v) for k, v in kwargs.items()})
        result = func(schema)
        specs = result.strategies if isinstance(result, _compat.OpStrategy) else _tuple_strategy_specs(result)
        out = []
        for s in specs:
            outs = s.output_specs if isinstance(s.output_specs, (tuple, list)) else (s.output_specs,)
            ins = s.input_specs if s.input_specs is not None else (s.output_specs,) * n_in
            out.append(Strategy(tuple(i.placements[0] for i in ins), tuple(None if o is None else o.placements[0] for o in outs)))
        return out
    schema = _compat.OpSchema(op, tuple(args), dict(kwargs))
    res = rule(schema)
    if res.output_spec is None:
        schema = res.redistribute_schema
        res = rule(schema)
    ins = [a for a in pytree.tree_leaves((schema.args_schema, schema.kwargs_schema)) if isinstance(a, _compat.DTensorSpec)]
    outs = res.output_spec if isinstance(res.output_spec, (tuple, list)) else (res.output_spec,)
    return [Strategy(tuple(i.placements[0] for i in ins), tuple(None if o is None else o.placements[0] for o in outs))]


def _wrap(a: Any) -> Any:
    if isinstance(a, _compat.DTensorSpec):
        return _compat.OpStrategy([_compat.OpSpec(a)])
    if isinstance(a, (list, tuple)) and a and all(isinstance(x, _compat.DTensorSpec) for x in a):
        return _compat.TupleStrategy(tuple(_wrap(x) for x in a))
    return a


def _tuple_strategy_specs(result: Any) -> list[Any]:
    """A TupleStrategy (one child per output) as a list of combined single-output specs."""
    children = result.children
    if not children:
        return []
    combos = []
    for i in range(len(children[0].strategies)):
        specs = [c.strategies[min(i, len(c.strategies) - 1)] for c in children]
        combos.append(_Combined(tuple(s.output_specs for s in specs), tuple(x for s in specs for x in (s.input_specs or ()))))
    return combos


@dataclasses.dataclass(frozen=True)
class _Combined:
    output_specs: Any
    input_specs: Any


def _valid(strategies: list[Strategy], node: torch.fx.Node, n: int) -> list[Strategy]:
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    ok = []
    for s in strategies:
        placed = [*s.ins, *s.outs]
        if len(placed) != len(metas):
            continue
        if all(t is None or p is None or not isinstance(p, Shard) or (p.dim < t.ndim and t.shape[p.dim] >= n) for t, p in zip(metas, placed)):
            ok.append(s)
    return ok


def shardable(node: torch.fx.Node, dm: Any, want_in: list[Placements]) -> bool:
    """DTensor's own filter on a combined strategy: every sharded input dim has a row per shard."""
    return all(
        _compat.is_tensor_shardable(meta_of(v).shape, _compat.DTensorSpec(dm, pl, tensor_meta=tensor_meta(meta_of(v))))
        for v, pl in zip(tensor_args(node), want_in)
    )


def dtensor_decision(node: torch.fx.Node, dm: Any, want_in: list[Placements], asked: dict[Any, Any]) -> tuple[list[Placements], list[Placements | None]]:
    """What DTensor does for ``node`` when its inputs arrive as ``want_in`` (asked once per op
    signature and input placements in ``asked``: a model's repeated layers ask the same questions)."""
    key = (node.target, signature(node.args), signature(node.kwargs), tuple(want_in))
    if key not in asked:
        asked[key] = _ask_dtensor(node, dm, want_in)
    return asked[key]


def _ask_dtensor(node: torch.fx.Node, dm: Any, want_in: list[Placements]) -> tuple[list[Placements], list[Placements | None]]:
    it = iter(want_in)

    def spec(a: Any) -> Any:
        if isinstance(a, torch.fx.Node) and is_tensor_node(a):
            return _compat.DTensorSpec(dm, next(it), tensor_meta=tensor_meta(a.meta["val"]))
        return a

    schema = _compat.OpSchema(node.target, pytree.tree_map(spec, node.args), pytree.tree_map(spec, node.kwargs))
    out = _compat.sharding_propagator().propagate_op_sharding(schema)
    suggested = want_in
    if out.needs_redistribute and out.redistribute_schema is not None:
        suggested = [s.placements for s in pytree.tree_leaves((out.redistribute_schema.args_schema, out.redistribute_schema.kwargs_schema)) if isinstance(s, _compat.DTensorSpec)]
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else (out.output_spec,)
    return [tuple(p) for p in suggested], [None if s is None else tuple(s.placements) for s in specs]
