"""Whole-graph sharding propagation: choose a placement for every value of a traced graph.

The problem is solved one mesh axis at a time (as Shardy reasons per factor and DTensor's
single-dim strategies do): on an axis of size ``n`` a value is ``Replicate``, ``Shard(d)`` or
``Partial``, and every op offers the strategies DTensor registers for it (input placements ->
output placements). The planner picks one strategy per op so that the redistributions it implies
cost the fewest bytes, where

* all-reduce moves ``2(n-1)/n`` of the tensor, all-gather and reduce-scatter ``(n-1)/n``,
  all-to-all ``(n-1)/n`` of the local shard (ring model, bytes each rank sends);
* a value redistributed to one placement is redistributed once, however many ops use it there
  (so a gradient is reduced once, not once per use);
* a ``Partial`` result stays partial until the cheapest point to reduce it (the greedy pass
  charges a pending reduction to a partial output; the refinement passes then move it).

Priority when annotations disagree: a ``with_sharding_constraint`` fixes its value; inputs keep
the sharding they arrive with (``in_shardings``); ``out_shardings`` are met by a final
redistribution. Nothing is replicated silently: an op without a DTensor strategy is an error
naming the op and the user's line, unless ``allow_replicated_fallback`` is set, in which case the
plan marks that op as replicated.

The per-axis choices are then combined and checked op by op with DTensor's own propagation on the
full mesh (the same decision the lowered program will make), so the plan is exactly what runs.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from vsf import _compat
from vsf.sharding import constraint
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding, RaggedPlacement
from vsf.sharding.spec import UNCONSTRAINED

__all__ = ["Collective", "NodePlan", "Plan", "PlanError", "Redistribution", "constant_nodes", "propagate", "to_placements", "unplanned_ops"]

Placements = tuple[Placement, ...]
Value = tuple[torch.fx.Node, int]
R, PARTIAL = Replicate(), Partial()
_INF = float("inf")


class PlanError(ValueError):
    """No sharded program can be planned (the message names the op and the user's line)."""


# -- the plan ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the program runs: its kind, mesh axis, the local shape it reduces or gathers
    into (per rank), and the bytes each rank sends."""

    kind: str
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int


@dataclasses.dataclass(frozen=True)
class Redistribution:
    """Moving ``value`` from placements ``src`` to ``dst`` (before ``before`` uses it)."""

    value: Value
    src: Placements
    dst: Placements
    collectives: tuple[Collective, ...]
    before: torch.fx.Node


@dataclasses.dataclass(frozen=True)
class Bucket:
    """All-reduces over one mesh axis that run as one collective on a flat buffer, before
    ``before`` (DDP's gradient buckets, found in the graph instead of at hook time). Partial
    averages join partial sums: their local values are divided by the axis size first."""

    members: tuple[Redistribution, ...]
    mesh_dims: tuple[int, ...]  # the mesh dims whose partial sums are reduced (one all-reduce each)
    before: torch.fx.Node
    collectives: tuple[Collective, ...]


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """How one op runs: the placements of its tensor inputs and outputs (``None``: no tensor).

    ``direct``: the op runs as is on the local shards (its strategy is one DTensor's per-mesh-dim
    rules allow); otherwise it runs through DTensor's dispatcher (view ops whose shape arguments
    must become local, random ops). ``fallback``: no strategy exists; it runs replicated.
    """

    ins: tuple[Placements, ...]
    outs: tuple[Placements | None, ...]
    fallback: bool = False
    direct: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement for every value of ``graph`` over ``mesh`` and every redistribution between."""

    mesh: Mesh
    graph: torch.fx.GraphModule
    nodes: dict[torch.fx.Node, NodePlan]
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    redistributions: tuple[Redistribution, ...]
    buckets: tuple[Bucket, ...]
    order: tuple[Any, ...]  # graph nodes and buckets, in the order the program runs them

    def collectives(self) -> list[Collective]:
        """Every collective the program runs (a bucket counts once)."""
        bucketed = {id(r) for b in self.buckets for r in b.members}
        out = [c for r in self.redistributions if id(r) not in bucketed for c in r.collectives]
        return out + [c for b in self.buckets for c in b.collectives]

    def placement(self, value: Value) -> Placements:
        node, i = value
        if node.op == "placeholder":
            return self.inputs[_placeholders(self.graph).index(node)]
        out = self.nodes[node].outs[i]
        assert out is not None
        return out


def to_placements(s: NamedSharding) -> Placements:
    return tuple(s.placements)


# -- graph facts ------------------------------------------------------------------------------


_GETITEM = operator.getitem  # the fx target of tuple indexing


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _value(arg: torch.fx.Node) -> Value:
    """The (producer, output index) a graph argument refers to (``getitem`` nodes resolved)."""
    if arg.op == "call_function" and arg.target is _GETITEM:
        return (arg.args[0], arg.args[1])
    return (arg, 0)


def _outputs_meta(node: torch.fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _tensor_args(node: torch.fx.Node) -> list[Value]:
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [_value(a) for a in leaves if isinstance(a, torch.fx.Node) and _is_tensor_node(a)]


def _is_tensor_node(n: torch.fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _meta(v: Value) -> torch.Tensor:
    out = _outputs_meta(v[0])[v[1]]
    assert out is not None
    return out


def _tmeta(t: torch.Tensor) -> Any:
    return _compat.TensorMeta(t.shape, t.stride(), t.dtype)


def _op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr") and n.target is not _GETITEM]


def _user_line(node: torch.fx.Node) -> str:
    from vsf.trace import source_line

    line = source_line(node)
    return f" at {line}" if line else ""


# -- per-axis strategies ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Strategy:
    ins: tuple[Placement, ...]
    outs: tuple[Placement | None, ...]


def _sig(x: Any) -> Any:
    if isinstance(x, torch.fx.Node):
        t = x.meta.get("val")
        return ("T", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("N", str(x))
    if isinstance(x, (list, tuple)):
        return tuple(_sig(a) for a in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _sig(v)) for k, v in x.items()))
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)) else repr(x)


class Strategies:
    """DTensor's candidate strategies per op and axis size, cached by op signature."""

    def __init__(self, allow_replicated_fallback: bool) -> None:
        self.fallback = allow_replicated_fallback
        self.cache: dict[Any, tuple[list[Strategy], bool]] = {}
        self.constants: dict[int, set[torch.fx.Node]] = {}

    def of(self, node: torch.fx.Node, n: int, ragged: Sequence[tuple[RaggedPlacement, int]] = ()) -> tuple[list[Strategy], bool]:
        """``(strategies, is_fallback)`` for ``node`` on an axis of ``n`` ranks; ``ragged`` lists the
        ragged splits ``(placement, rows)`` values on this axis have (they join per-row rules)."""
        constant = self.is_constant(node)
        key = (node.target, _sig(node.args), _sig(node.kwargs), n, tuple(ragged), constant)
        if key not in self.cache:
            found, fallback = self._compute(node, n, constant)
            if ragged and (node.target in RAGGED_REDUCTIONS or (_kind_of(node.target) == "single" and node.target not in _SPECIAL)):
                found = found + _ragged_variants(node, found, ragged)
            self.cache[key] = (found, fallback)
        return self.cache[key]

    def is_constant(self, node: torch.fx.Node) -> bool:
        """Is ``node`` an op with no DTensor strategy that computes a constant (only from values the
        traced function made itself)? It needs none: it runs replicated, and its users take the
        value in the layout they want (a local slice of a replicated value moves nothing)."""
        if node.op != "call_function" or node.target is constraint.CONSTRAINT_OP or node.target in VALUE_BLIND_OPS or _kind_of(node.target) is not None:
            return False  # (a constraint on a constant still lays it out as it says)
        graph = node.graph
        if id(graph) not in self.constants:
            self.constants[id(graph)] = constant_nodes(graph)
        return node in self.constants[id(graph)]

    def _compute(self, node: torch.fx.Node, n: int, constant: bool = False) -> tuple[list[Strategy], bool]:
        ins = _tensor_args(node)
        outs = _outputs_meta(node)
        if node.op == "get_attr" or not ins or constant:
            return [Strategy(tuple(R for _ in ins), tuple(R if o is not None else None for o in outs))], False
        if node.target is constraint.CONSTRAINT_OP:
            return [Strategy((p,), (p,)) for p in _candidates(_meta(ins[0]), n)], False
        if node.target in VALUE_BLIND_OPS:
            inputs = [*_candidates(_meta(ins[0]), n), Partial("avg"), Partial("max"), Partial("min")]
            return [Strategy((p,), (p if _is_shard(p) else R,)) for p in inputs], False
        found = _single_dim(node, n) if _kind_of(node.target) == "single" else _by_each_input(node, n) if _kind_of(node.target) else None
        if found:
            return _valid(found, node, n), False
        if self.fallback:
            return [Strategy(tuple(R for _ in ins), tuple(R if o is not None else None for o in outs))], True
        raise PlanError(
            f"{node.target} has no DTensor sharding strategy, so vsf cannot shard it{_user_line(node)}. "
            "Set vsf.config.allow_replicated_fallback = True to run it replicated (the plan flags it)."
        )


aten = torch.ops.aten


def constant_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The values of ``graph`` computed from constants alone: tensors the traced function made
    itself (``get_attr`` constants, factory ops such as ``arange``/``full``/``scalar_tensor``) and
    deterministic ops on those (a causal mask built in ``forward``). Random ops are not constants."""
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            found.add(node)
        elif node.op == "call_function" and not _is_random(node.target) and all(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _is_random(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


# Ops whose DTensor strategy gives wrong numbers on some inputs: they are decomposed (and the pieces
# planned) as if they had none. nll_loss's mean over a sharded batch is DTensor's Partial("avg") of
# the shards' means, which is the mean only when every shard counts as many targets (ignore_index
# or class weights make them differ: BERT's masked-LM labels).
UNTRUSTED_STRATEGIES = frozenset({aten.nll_loss_forward.default, aten.nll_loss2d_forward.default})


def unplanned_ops(gm: torch.fx.GraphModule) -> set[Any]:
    """The aten ops of ``gm`` that the planner has no (trusted) strategy for: no DTensor (or vsf)
    strategy, or one in :data:`UNTRUSTED_STRATEGIES`, and not computing a constant, a factory op
    or a sharding constraint (which need none). :func:`vsf.trace.trace` decomposes them; what is
    left is a :class:`PlanError`.

    Example::

        >>> gm = make_fx(lambda x, y: torch.nn.functional.mse_loss(x, y))(torch.randn(4), torch.randn(4))
        >>> unplanned_ops(gm)
        {<OpOverload(op='aten.mse_loss', overload='default')>}
    """
    constants = constant_nodes(gm.graph)
    return {node.target for node in _op_nodes(gm) if node.target in UNTRUSTED_STRATEGIES} | {
        node.target for node in _op_nodes(gm)
        if node.op == "call_function" and hasattr(node.target, "_schema") and _tensor_args(node) and node not in constants
        and node.target is not constraint.CONSTRAINT_OP and node.target not in VALUE_BLIND_OPS
        and _kind_of(node.target) is None and not _adopt_inplace_strategy(node.target)
    }


def _adopt_inplace_strategy(op: Any) -> bool:
    """Functionalization turns ``x.foo_(...)`` into ``foo(x, ...)``; where DTensor registers a
    strategy only for the in-place ``foo_`` (``copy_``: T5's ``shifted[..., 1:] = ids[..., :-1]``),
    the functional op takes it (it computes the same values into a new tensor)."""
    namespace, _, base = op._schema.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), base + "_", None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or len(twin._schema.arguments) != len(op._schema.arguments):
        return False
    return _compat.register_like(op, twin)


# Ops whose result depends only on their input's shape, not its values: any placement of the input
# will do (a partial sum has the full shape everywhere), and the result is replicated or sharded
# like the input. DTensor asks for a reduced input; a loss's backward then waits for the loss to be
# all-reduced, which the planner can instead defer (and bucket with the gradients).
VALUE_BLIND_OPS = frozenset({
    aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default,
})


# Reductions that run on a rank's own rows as they are (a sum or a norm of rows is a partial result
# of that kind, and an empty shard gives the identity); DTensor's dispatcher, which they would
# otherwise go through, has no ragged rules. (A max has no identity on a rank that holds no rows.)
RAGGED_REDUCTIONS = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.linalg_vector_norm.default})


def _ragged_variants(node: torch.fx.Node, strategies: list[Strategy], ragged: Sequence[tuple[RaggedPlacement, int]]) -> list[Strategy]:
    """Per-row rules (every shard on dim 0 of a tensor with that many rows) run on a ragged split
    of those rows too: an elementwise op keeps ragged rows ragged, a sum over the rows of ragged
    operands is a partial sum."""
    metas = [_meta(v) for v in _tensor_args(node)] + _outputs_meta(node)
    out = []
    for g, rows in ragged:
        for st in strategies:
            placed = [*st.ins, *st.outs]
            shards = [(t, p) for t, p in zip(metas, placed) if t is not None and p is not None and _is_shard(p)]
            if not any(_is_shard(p) for p in st.ins) or not all(isinstance(p, Shard) and p.dim == 0 and t.shape[0] == rows for t, p in shards):
                continue
            if any(isinstance(p, Partial) and p.reduce_op == "avg" for p in st.outs if p is not None):
                continue  # an average of per-rank averages is wrong when ranks hold different row counts
            swap = lambda p: g if isinstance(p, Shard) else p  # noqa: E731
            out.append(Strategy(tuple(swap(p) for p in st.ins), tuple(None if p is None else swap(p) for p in st.outs)))
    return out


def _kind_of(op: Any) -> str | None:
    prop = _compat.sharding_propagator()
    if op in prop.op_single_dim_strategy_funcs:
        return "single"
    if op in prop.op_strategy_funcs or op in prop.op_to_rules:
        return "full"
    return None


def _meta_args(node: torch.fx.Node) -> tuple[Any, Any]:
    conv = lambda a: _tmeta(a.meta["val"]) if isinstance(a, torch.fx.Node) and _is_tensor_node(a) else a  # noqa: E731
    return pytree.tree_map(conv, node.args), pytree.tree_map(conv, node.kwargs)


def _single_dim(node: torch.fx.Node, n: int) -> list[Strategy] | None:
    args, kwargs = _meta_args(node)
    outs = _outputs_meta(node)
    out_meta = _tmeta(outs[0]) if isinstance(node.meta.get("val"), torch.Tensor) else [None if o is None else _tmeta(o) for o in outs]
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
    ins = _tensor_args(node)
    found: dict[Strategy, None] = {}
    leads = [i for i, a in enumerate(ins) if i == 0 or _meta(a).ndim > 0]
    for lead, placement in ((i, c) for i in leads for c in _candidates(_meta(ins[i]), n)):
        seen = [0]

        def spec(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and _is_tensor_node(a):
                p = placement if seen[0] == lead else R
                seen[0] += 1
                return _compat.DTensorSpec(mesh, (p,), tensor_meta=_tmeta(a.meta["val"]))
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
    n_in = len(_tensor_args(node))
    if func is not None:
        schema = _compat.op_schema(op, tuple(_wrap(a) for a in args), {k: _wrap(v) for k, v in kwargs.items()})
        result = func(schema)
        specs = result.strategies if isinstance(result, _compat.OpStrategy) else _tuple_strategy_specs(result)
        out = []
        for s in specs:
            outs = s.output_specs if isinstance(s.output_specs, (tuple, list)) else (s.output_specs,)
            ins = s.input_specs if s.input_specs is not None else (s.output_specs,) * n_in
            out.append(Strategy(tuple(i.placements[0] for i in ins), tuple(None if o is None else o.placements[0] for o in outs)))
        return out
    schema = _compat.op_schema(op, tuple(args), dict(kwargs))
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
    metas = [_meta(v) for v in _tensor_args(node)] + _outputs_meta(node)
    ok = []
    for s in strategies:
        placed = [*s.ins, *s.outs]
        if len(placed) != len(metas):
            continue
        if all(t is None or p is None or not isinstance(p, Shard) or (p.dim < t.ndim and t.shape[p.dim] >= n) for t, p in zip(metas, placed)):
            ok.append(s)
    return ok


# -- per-axis solver --------------------------------------------------------------------------

# Taking a local slice of a replicated value sends nothing; it is charged a token cost so that
# the planner does not reshard values gratuitously (a later op would pay to undo it).
_SLICE_COST = 1e-3
# Each collective also costs a start-up latency, charged as this many bytes: with equal bytes, one
# all-reduce beats a reduce-scatter plus an all-gather.
COLLECTIVE_LATENCY_BYTES = 4096.0
_COLLECTIVE_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})
_TIE = 1e-9
_NOT_PARTIAL = object()  # requirement of a graph output with no out_sharding: anything but Partial


def _transition_bytes(kind: str, n: int, full_bytes: float) -> float:
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n / n,
        "slice": _SLICE_COST,
    }
    return factor[kind] * full_bytes


def _is_shard(p: Any) -> bool:
    return isinstance(p, (Shard, _compat.StridedShard, RaggedPlacement))


def _split_dim(p: Any) -> int:
    """The tensor dim a shard-like placement splits (a ragged split of leading dims: dim 0)."""
    return 0 if isinstance(p, RaggedPlacement) else p.dim


def _kind(src: Placement, dst: Placement) -> str | None:
    if src == dst:
        return None
    if isinstance(src, Replicate) and _is_shard(dst):
        return "slice"
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return "partition"  # local (one rank keeps the value): DTensor may ask for it, the planner never does
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter" if _is_shard(dst) else "invalid"
    if _is_shard(src):
        return "all_gather" if isinstance(dst, Replicate) else "all_to_all" if _is_shard(dst) else "invalid"
    return "invalid"


class _Codes:
    """Placements of one axis as small ints, with the byte factor and the fixed (per-collective)
    cost of every transition."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.of: dict[Any, int] = {}
        self.placements: list[Any] = []
        self.factor: list[list[float]] = []
        self.fixed: list[list[float]] = []
        self.code(R)

    def code(self, p: Any) -> int:
        if p not in self.of:
            self.of[p] = len(self.placements)
            self.placements.append(p)
            self.factor = [[self._factor(a, b) for b in self.placements] for a in self.placements]
            self.fixed = [[self._fixed(a, b) for b in self.placements] for a in self.placements]
            self.shard = [_is_shard(q) for q in self.placements]
        return self.of[p]

    def _fixed(self, a: Any, b: Any) -> float:
        if b is _NOT_PARTIAL:
            return self._fixed(a, R) if isinstance(a, Partial) else 0.0
        return COLLECTIVE_LATENCY_BYTES if _kind(a, b) in _COLLECTIVE_KINDS else 0.0

    def _factor(self, a: Any, b: Any) -> float:
        if b is _NOT_PARTIAL:
            return self._factor(a, R) if isinstance(a, Partial) else 0.0
        if a is _NOT_PARTIAL:
            return _INF
        kind = _kind(a, b)
        return 0.0 if kind is None else _INF if kind in ("invalid", "partition") else _transition_bytes(kind, self.n, 1.0)

    def is_shard(self, c: int) -> bool:
        return self.shard[c]

    def is_partial(self, c: int) -> bool:
        return isinstance(self.placements[c], Partial)


def _encode(codes: "_Codes", strategies: list[Strategy]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(codes.code(p) for p in st.ins), tuple(-1 if p is None else codes.code(p) for p in st.outs)) for st in strategies]


class _AxisSolver:
    """Chooses one strategy per op for one mesh axis (greedy in graph order, then local repair)."""

    def __init__(self, problem: "_Problem", axis: str, codes: "_Codes", encoded: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> None:
        self.p = problem
        self.axis = axis
        self.n = problem.mesh.axis_size(axis)
        self.codes = codes
        vid = problem.value_ids
        self.fb = [self._full_bytes(v) for v in problem.values]
        self.label = [codes.code(R)] * len(problem.values)
        self.need: list[dict[int, int]] = [{} for _ in problem.values]
        for v, pl in problem.seeds[axis].items():
            self.label[vid[v]] = codes.code(pl)
        self.final: dict[int, int] = {}  # graph outputs with a required placement
        for v, req in problem.out_req[axis]:
            c = codes.code(req)
            self.need[vid[v]][c] = self.need[vid[v]].get(c, 0) + 1
            if req is not _NOT_PARTIAL:
                self.final[vid[v]] = c
        self.ins = [tuple(vid[v] for v in problem.inputs[node]) for node in problem.ops]
        self.outs = [tuple(vid.get((node, i), -1) for i in range(len(_outputs_meta(node)))) for node in problem.ops]
        self.strategies: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []
        for node in problem.ops:
            allowed = problem.strategies.of(node, self.n, problem.ragged[axis])[0]
            pinned = problem.pinned[axis].get(node)
            if pinned is not None:
                allowed = [st for st in allowed if st.outs[0] in pinned]
                if not allowed:
                    raise PlanError(f"no strategy of {node.target} can give the constrained sharding on axis {axis!r}{_user_line(node)}")
                self.strategies.append(_encode(codes, allowed))
                continue
            if id(allowed) not in encoded:  # ops with one signature share one list: encode it once
                encoded[id(allowed)] = _encode(codes, allowed)
            self.strategies.append(encoded[id(allowed)])
        self.choice = [-1] * len(problem.ops)
        self.reorder = self._reorders()
        self.hints = self._hints()

    def _hints(self) -> list[frozenset[int]]:
        """Shardings each value will be wanted in later, propagated backwards (as GSPMD does) from
        the outputs' required shardings through ops that keep a sharding as it is (elementwise
        ones: the same placement in and out). The greedy pass may shard a value into one of its
        hints even where no input is sharded yet, e.g. reduce-scatter a gradient that a ZeRO
        optimizer will want sharded, before a norm of it decides for a full reduction."""
        hints: list[set[int]] = [set() for _ in self.p.values]
        for v, need in enumerate(self.need):
            hints[v].update(c for c in need if self.codes.is_shard(c))
        for k in range(len(self.p.ops) - 1, -1, -1):
            wanted = [hints[v] if v >= 0 else set() for v in self.outs[k]]
            if not any(wanted):
                continue
            for ins, outs in self.strategies[k]:
                if any(o >= 0 and o in w for o, w in zip(outs, wanted)):
                    for v, req in zip(self.ins[k], ins):
                        if self.codes.is_shard(req) and req in outs:
                            hints[v].add(req)
        return [frozenset(h) for h in hints]

    def _reorders(self) -> dict[int, dict[int, float]]:
        """For values that a later mesh axis already shards on some dim: what sharding that dim on
        this (earlier, hence major) axis as well costs besides this axis's own move. The nested
        layout changes which block the later axis's ranks hold, so DTensor gathers over it first."""
        order = list(self.p.mesh.device_axes)
        here = order.index(self.axis)
        out: dict[int, dict[int, float]] = {}
        for other, solver in self.p.solved.items():
            if other == self.axis or order.index(other) < here:
                continue
            for v, c in enumerate(solver.label):
                p = solver.codes.placements[c]
                if _is_shard(p):
                    out.setdefault(v, {})[_split_dim(p)] = _transition_bytes("all_gather", solver.n, self.fb[v])
        return out

    def _full_bytes(self, v: Value) -> float:
        t = _meta(v)
        size = float(t.numel() * t.element_size())
        for other, solver in self.p.solved.items():
            if other != self.axis and solver.codes.is_shard(solver.label[self.p.value_ids[v]]):
                size /= solver.n
        return size

    def _value_cost(self, v: int, label: int, need: dict[int, int]) -> float:
        row, fixed = self.codes.factor[label], self.codes.fixed[label]
        return sum(self.fb[v] * row[req] + fixed[req] for req, c in need.items() if c > 0)

    def _gratuitous(self, k: int, ins: tuple[int, ...]) -> bool:
        """Does this strategy shard an input on this axis when no input already arrives sharded
        here, and no later op wants it so (:meth:`_hints`)?"""
        is_shard, label, hints = self.codes.is_shard, self.label, self.hints
        reshards = anchored = False
        for v, req in zip(self.ins[k], ins):
            if is_shard(req):
                if req == label[v] or req in hints[v]:
                    anchored = True
                else:
                    reshards = True
        return reshards and not anchored

    def _evaluate(self, k: int, j: int, greedy: bool, strict: bool) -> float:
        ins, outs = self.strategies[k][j]
        if strict and self._gratuitous(k, ins):
            return _INF
        factor, label, need, fb = self.codes.factor, self.label, self.need, self.fb
        total = 0.0
        shard, placements, reorder = self.codes.is_shard, self.codes.placements, self.reorder
        hints = self.hints
        for v, req in zip(self.ins[k], ins):
            if req != label[v]:
                # ties go to using a value where it is (redistribute as late as possible), or else
                # to moving it where a later op wants it anyway
                total += _TIE * fb[v] * (0.5 if req in hints[v] else 1.0)
                if v in reorder and shard(req) and not shard(label[v]) and req not in hints[v]:
                    # (a sharding wanted later comes from a layout that already orders the axes:
                    # ZeRO's minor axis, say)
                    total += reorder[v].get(_split_dim(placements[req]), 0.0)
        if greedy:
            for v, req in zip(self.ins[k], ins):
                cur = label[v]
                if req != cur and not need[v].get(req):
                    total += factor[cur][req] * fb[v] + self.codes.fixed[cur][req]
        else:
            old = self.strategies[k][self.choice[k]][0]
            changed: dict[int, dict[int, int]] = {}
            for v, req in zip(self.ins[k], ins):
                d = changed.setdefault(v, dict(need[v]))
                d[req] = d.get(req, 0) + 1
            for v, req in zip(self.ins[k], old):
                changed[v][req] -= 1
            for v, d in changed.items():
                total += self._value_cost(v, label[v], d) - self._value_cost(v, label[v], need[v])
        for v, lab in zip(self.outs[k], outs):
            if v < 0 or lab < 0:
                continue
            total += self._value_cost(v, lab, need[v])
            if self.final.get(v, lab) != lab:
                # ties go to computing a result in the layout it leaves in: moved after the last
                # op it lands in a fresh buffer, where a donated input's buffer could have held it
                total += _TIE * fb[v]
            if greedy and self.codes.is_partial(lab):
                # a partial will have to be reduced: charge an all-reduce's bytes (not its start-up:
                # independent reductions share one bucket)
                total += factor[lab][0] * fb[v]
        return total

    def _apply(self, k: int, j: int) -> None:
        need = self.need
        if self.choice[k] >= 0:
            for v, req in zip(self.ins[k], self.strategies[k][self.choice[k]][0]):
                need[v][req] -= 1
        self.choice[k] = j
        ins, outs = self.strategies[k][j]
        for v, req in zip(self.ins[k], ins):
            need[v][req] = need[v].get(req, 0) + 1
        for v, lab in zip(self.outs[k], outs):
            if v >= 0 and lab >= 0:
                self.label[v] = lab

    def _pick(self, k: int, greedy: bool) -> bool:
        options = range(len(self.strategies[k]))
        if len(options) == 1 and not greedy:
            return False
        # The first, greedy pass never shards inputs no other input is sharded like (it cannot see
        # that a later op will want them so); the repair passes take any strategy that pays.
        costs = [(self._evaluate(k, j, greedy, greedy), j) for j in options]
        if all(c == _INF for c, _ in costs):
            costs = [(self._evaluate(k, j, greedy, False), j) for j in options]
        best_cost, best = min(costs)
        if best_cost == _INF:
            node = self.p.ops[k]
            raise PlanError(f"{node.target} cannot be placed on axis {self.axis!r}{_user_line(node)}: every strategy needs an impossible redistribution")
        if not greedy and (best == self.choice[k] or best_cost >= costs[[j for _, j in costs].index(self.choice[k])][0] - 1e-9):
            return False
        self._apply(k, best)
        return True

    def solve(self, max_repairs: int = 3) -> None:
        for k in range(len(self.p.ops)):
            self._pick(k, greedy=True)
        producers = self.p.producer_of
        consumers = self.p.consumers_of
        work = list(range(len(self.p.ops) - 1, -1, -1))
        queued = set(work)
        budget = max_repairs * len(work)
        while work and budget > 0:
            budget -= 1
            k = work.pop()
            queued.discard(k)
            if self._pick(k, greedy=False):
                for other in [producers.get(v) for v in self.ins[k]] + [c for v in self.outs[k] if v >= 0 for c in consumers.get(v, ())]:
                    if other is not None and other not in queued:
                        queued.add(other)
                        work.append(other)

    def placement_of(self, node_index: int) -> tuple[list[Any], list[Any]]:
        ins, outs = self.strategies[node_index][self.choice[node_index]]
        pl = self.codes.placements
        return [pl[c] for c in ins], [None if c < 0 else pl[c] for c in outs]


@dataclasses.dataclass
class _Problem:
    mesh: Mesh
    gm: torch.fx.GraphModule
    ops: list[torch.fx.Node]
    inputs: dict[torch.fx.Node, list[Value]]
    strategies: Strategies
    seeds: dict[str, dict[Value, Placement]]
    out_req: dict[str, list[tuple[Value, Any]]]
    pinned: dict[str, dict[torch.fx.Node, set[Placement]]]
    solved: dict[str, _AxisSolver]
    ragged: dict[str, list[tuple[RaggedPlacement, int]]] = dataclasses.field(default_factory=dict)
    values: list[Value] = dataclasses.field(default_factory=list)
    value_ids: dict[Value, int] = dataclasses.field(default_factory=dict)
    producer_of: dict[int, int] = dataclasses.field(default_factory=dict)
    consumers_of: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def index(self) -> None:
        """Number the values and record which op produces and which ops consume each."""
        for ph in _placeholders(self.gm):
            self._add((ph, 0))
        for k, node in enumerate(self.ops):
            for i, meta in enumerate(_outputs_meta(node)):
                if meta is not None:
                    self.producer_of[self._add((node, i))] = k
        for k, node in enumerate(self.ops):
            for v in self.inputs[node]:
                self.consumers_of.setdefault(self.value_ids[v], []).append(k)

    def _add(self, v: Value) -> int:
        self.value_ids[v] = len(self.values)
        self.values.append(v)
        return self.value_ids[v]


# -- combining the axes and checking with DTensor ---------------------------------------------


def propagate(
    gm: torch.fx.GraphModule,
    mesh: Mesh,
    in_placements: Sequence[Placements],
    out_shardings: Sequence[NamedSharding | None],
    *,
    allow_replicated_fallback: bool = False,
) -> Plan:
    """Plan ``gm`` (a traced graph on global shapes) over ``mesh``.

    ``in_placements`` gives each placeholder's DTensor placements (over ``mesh.device_axes``);
    ``out_shardings`` each output's required sharding, ``None`` to let propagation choose
    (anything but an unreduced partial).
    """
    axes = [a for a in mesh.device_axes if mesh.axis_size(a) > 1]
    placeholders = _placeholders(gm)
    outputs = [_value(a) for a in pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)]
    ops = _op_nodes(gm)
    problem = _Problem(
        mesh=mesh, gm=gm, ops=ops,
        inputs={n: _tensor_args(n) for n in ops},
        strategies=Strategies(allow_replicated_fallback),
        seeds={}, out_req={}, pinned={}, solved={},
    )
    problem.index()
    for ph, pl in zip(placeholders, in_placements):
        for p in pl:
            if isinstance(p, RaggedPlacement) and p.ragged.dims != 1:
                raise PlanError(f"vsf.jit takes ragged inputs that split dim 0 only; input %{ph.name} is {p.ragged!r} (dims={p.ragged.dims})")
    dm_axes = list(mesh.device_axes)
    for axis in axes:
        k = dm_axes.index(axis)
        problem.seeds[axis] = {(ph, 0): _one_d(pl[k]) for ph, pl in zip(placeholders, in_placements)}
        problem.ragged[axis] = sorted(
            {(pl[k], ph.meta["val"].shape[0]) for ph, pl in zip(placeholders, in_placements) if isinstance(pl[k], RaggedPlacement)},
            key=repr,
        )
        problem.out_req[axis] = [
            (v, _NOT_PARTIAL if s is None else _one_d(to_placements(s)[k])) for v, s in zip(outputs, out_shardings)
        ]
        problem.pinned[axis] = {n: _pinned(n, mesh, axis) for n in ops if n.target is constraint.CONSTRAINT_OP}
    with _compat.local_mode_disabled():
        codes = {axis: _Codes(mesh.axis_size(axis)) for axis in axes}
        encoded: dict[str, dict[int, list[Any]]] = {axis: {} for axis in axes}
        for _sweep in range(2 if len(axes) > 1 else 1):  # a second sweep sees the other axes' choices
            for axis in axes:
                solver = _AxisSolver(problem, axis, codes[axis], encoded[axis])
                solver.solve()
                problem.solved[axis] = solver
        return _check_with_dtensor(problem, axes, in_placements, out_shardings)


def _one_d(p: Placement) -> Placement:
    """A placement as the 1D solver sees it (strided shards are shards of their dim)."""
    return Shard(p.dim) if isinstance(p, _compat.StridedShard) else p


def _pinned(node: torch.fx.Node, mesh: Mesh, axis: str) -> set[Placement]:
    s = constraint.parse(node.args[1])
    if axis in s.spec.axes:
        return {_one_d(to_placements(s)[list(mesh.device_axes).index(axis)])}
    free = {R} | {Shard(d) for d, e in enumerate(s.spec) if e is UNCONSTRAINED}
    return free


def _check_with_dtensor(problem: _Problem, axes: list[str], in_placements: Sequence[Placements], out_shardings: Sequence[NamedSharding | None]) -> Plan:
    mesh, gm = problem.mesh, problem.gm
    dm = mesh.device_mesh
    dm_axes = list(mesh.device_axes)
    actual: dict[Value, Placements] = {(ph, 0): tuple(pl) for ph, pl in zip(_placeholders(gm), in_placements)}
    plans: dict[torch.fx.Node, NodePlan] = {}
    moves: dict[tuple[Value, Placements], Redistribution] = {}
    asked: dict[Any, Any] = {}

    def combined(per_axis: dict[str, Placement | None]) -> Placements:
        return tuple(per_axis.get(a, R) if mesh.axis_size(a) > 1 else R for a in dm_axes)

    users: dict[tuple[Value, Placements], list[torch.fx.Node]] = {}
    nestings = _input_nestings(gm, in_placements)

    def nest(t: torch.Tensor | None, p: Placements | None) -> Placements | None:
        return None if t is None or p is None else _nested(nestings, t, p)

    def move(v: Value, dst: Placements, before: torch.fx.Node) -> None:
        src = actual[v]
        if src != dst:
            users.setdefault((v, dst), []).append(before)
            if (v, dst) not in moves:
                moves[(v, dst)] = Redistribution(v, src, dst, _collectives(mesh, _meta(v), src, dst), before)

    for k, node in enumerate(problem.ops):
        ins = problem.inputs[node]
        choice = {a: problem.solved[a].placement_of(k) for a in axes}
        want_in = [combined({a: choice[a][0][i] for a in axes}) for i in range(len(ins))]
        n_out = len(_outputs_meta(node))
        want_out = [
            None if _outputs_meta(node)[i] is None else combined({a: choice[a][1][i] for a in axes})
            for i in range(n_out)
        ]
        fallback = bool(ins) and problem.strategies.of(node, 2)[1]
        direct = False
        if node.target is constraint.CONSTRAINT_OP:
            s = constraint.parse(node.args[1])
            target = want_out[0] if any(e is UNCONSTRAINED for e in s.spec) else to_placements(s)
            want_in, want_out = [target], [target]
        elif node.target in VALUE_BLIND_OPS or problem.strategies.is_constant(node):
            direct = True
        elif ins and not fallback and node.op == "call_function":
            direct = (_kind_of(node.target) == "single" and node.target not in _SPECIAL) or (node.target in RAGGED_REDUCTIONS and _has_ragged(want_in))
            preferred = [nest(_meta(v), w) for v, w in zip(ins, want_in)] + [nest(t, w) for t, w in zip(_outputs_meta(node), want_out)]
            if direct and not _has_ragged(want_in):
                want_in, want_out = _keep_strided([actual[v] for v in ins], want_in, want_out, preferred)
                direct = _shardable(node, dm, want_in)
            if not direct:
                want_in, want_out = _dtensor_decision(node, dm, [p if p is not None else w for p, w in zip(preferred, want_in)], asked)
        for v, dst in zip(ins, want_in):
            move(v, dst, node)
        plans[node] = NodePlan(tuple(want_in), tuple(want_out), fallback, direct)
        for i, out in enumerate(want_out):
            if out is not None:
                actual[(node, i)] = out
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [_value(a) for a in pytree.tree_leaves(output_node.args)]
    final = []
    for v, s in zip(outs, out_shardings):
        dst = to_placements(s) if s is not None else tuple(R if isinstance(p, Partial) else p for p in actual[v])
        move(v, dst, output_node)
        final.append(dst)
    moved = tuple(moves.values())
    buckets, order = _buckets(mesh, gm, moved, {id(r): users[(r.value, r.dst)] for r in moved})
    return Plan(mesh, gm, plans, tuple(tuple(p) for p in in_placements), tuple(final), moved, buckets, order)


BUCKET_BYTES = 32 * 2**20  # a flat buffer per bucket: bigger buckets trade memory for fewer collectives


def _buckets(mesh: Mesh, gm: torch.fx.GraphModule, moves: Sequence[Redistribution], users: dict[int, list[torch.fx.Node]]) -> tuple[tuple[Bucket, ...], tuple[Any, ...]]:
    """Group single-axis all-reduces (same axis and dtype; sums or averages of evenly sharded
    values) that do not depend on each other, so each group runs as one collective; and an
    execution order that runs each group after all its values exist and before any use."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    anc: dict[torch.fx.Node, int] = {}
    for n in nodes:
        mask = 0
        for p in n.all_input_nodes:
            mask |= anc[p] | (1 << index[p])
        anc[n] = mask
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[Redistribution]] = {}
    for r in moves:
        dims = tuple(k for k, (a, b) in enumerate(zip(r.src, r.dst)) if a != b)
        if (
            dims
            and all(type(r.src[k]) is Partial for k in dims)  # subclasses (a norm's partial) reduce differently
            and all(r.src[k].reduce_op in ("sum", "avg") and isinstance(r.dst[k], Replicate) for k in dims)
            and _even(mesh, _meta(r.value), r.src)
        ):
            groups.setdefault((dims, _meta(r.value).dtype), []).append(r)
    formed: list[tuple[tuple[int, ...], list[Redistribution]]] = []
    for (k, _dtype), rs in groups.items():
        rs.sort(key=lambda r: index[r.value[0]])
        current: list[Redistribution] = []
        consumers = producers = size = 0
        for r in rs:
            p = r.value[0]
            mine = sum(1 << index[u] for u in users[id(r)])
            fits = not (anc[p] & consumers) and not (producers & mine) and size < BUCKET_BYTES
            if current and not fits:
                formed.append((k, current))
                current, consumers, producers, size = [], 0, 0, 0
            current.append(r)
            consumers |= mine
            producers |= anc[p] | (1 << index[p])
            size += sum(c.bytes for c in r.collectives)
        formed.append((k, current))
    formed = [(k, rs) for k, rs in formed if len(rs) > 1]
    while True:
        order = _schedule(nodes, index, formed, users)
        if order is not None:
            break
        formed.pop()  # two groups wait on each other: give up the last one
    first_use = {id(item): i for i, item in enumerate(order)}
    buckets = []
    for k, rs in formed:
        before = min((u for r in rs for u in users[id(r)]), key=lambda u: first_use[id(u)])
        buckets.append(_bucket(mesh, rs, k, before))
    marker = {id(rs): b for (_, rs), b in zip(formed, buckets)}
    return tuple(buckets), tuple(marker.get(id(item), item) for item in order)


def _schedule(nodes: list[torch.fx.Node], index: dict[torch.fx.Node, int], formed: list[tuple[tuple[int, ...], list[Redistribution]]], users: dict[int, list[torch.fx.Node]]) -> list[Any] | None:
    """A topological order of the graph plus one step per group (``None`` if groups form a cycle),
    keeping the original order wherever the groups allow."""
    deps: dict[int, set[int]] = {id(n): {id(p) for p in n.all_input_nodes} for n in nodes}
    items: dict[int, Any] = {id(n): n for n in nodes}
    rank: dict[int, float] = {id(n): index[n] for n in nodes}
    for _, rs in formed:
        items[id(rs)] = rs
        deps[id(rs)] = {id(r.value[0]) for r in rs}
        rank[id(rs)] = max(index[r.value[0]] for r in rs) + 0.5
        for r in rs:
            for u in users[id(r)]:
                deps[id(u)].add(id(rs))
    waiting = {k: len(v) for k, v in deps.items()}
    after: dict[int, list[int]] = {}
    for k, v in deps.items():
        for d in v:
            after.setdefault(d, []).append(k)
    ready = [(rank[k], k) for k, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(items[k])
        for nxt in after.get(k, ()):
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(ready, (rank[nxt], nxt))
    return order if len(order) == len(items) else None


def _even(mesh: Mesh, t: torch.Tensor, placements: Placements) -> bool:
    return all(not _is_shard(p) or (not isinstance(p, RaggedPlacement) and t.shape[p.dim] % mesh.axis_size(a) == 0) for a, p in zip(mesh.device_axes, placements))


def _bucket(mesh: Mesh, members: list[Redistribution], mesh_dims: tuple[int, ...], before: torch.fx.Node) -> Bucket:
    numel = sum(math.prod(local_shape(mesh, _meta(r.value), r.src)) for r in members)
    dtype = _meta(members[0].value).dtype
    collectives = tuple(
        Collective("all_reduce", axis, (numel,), dtype, sum(c.bytes for r in members for c in r.collectives if c.axis == axis))
        for axis in (mesh.device_axes[k] for k in mesh_dims)
    )
    return Bucket(tuple(members), mesh_dims, before, collectives)


_SPECIAL = _compat.dispatcher_special_ops()

# Attention keeps a real strategy (decomposed, it would materialise a T x T product): the CPU
# kernels SDPA traces to split over batch and heads, as DTensor's CUDA flash kernel does.
ATTENTION_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
for _op in ATTENTION_OPS:
    if _kind_of(_op) is None:
        _compat.register_attention(_op)


def _has_ragged(placements: Sequence[Placements]) -> bool:
    return any(isinstance(p, RaggedPlacement) for pl in placements for p in pl)


def _keep_strided(
    actual: list[Placements], ins: list[Placements], outs: list[Placements | None], preferred: Sequence[Placements | None]
) -> tuple[list[Placements], list[Placements | None]]:
    """A per-mesh-dim strategy chosen with plain shards, applied to inputs that arrive with strided
    shards kept as they are: on each mesh dim where the inputs that keep their shard all carry the
    same split factor, every shard of the strategy takes it (DTensor fills its single-dim rules the
    same way), so an elementwise op on a ``P(("tp", "dp"))`` value moves nothing. ``preferred``
    (per input, then per output: see :func:`_nested`) counts like an input arriving strided."""
    ins, outs = [list(p) for p in ins], [None if p is None else list(p) for p in outs]
    for k in range(len(ins[0]) if ins else 0):
        factors = {
            a[k].split_factor for a, want in zip(actual, ins)
            if isinstance(a[k], _compat.StridedShard) and isinstance(want[k], Shard) and want[k].dim == a[k].dim
        } | {p[k].split_factor for p in preferred if p is not None and isinstance(p[k], _compat.StridedShard)}
        if len(factors) != 1:
            continue
        sf = factors.pop()
        for p in [*ins, *(o for o in outs if o is not None)]:
            if isinstance(p[k], Shard):
                p[k] = _compat.StridedShard(p[k].dim, split_factor=sf)
    return [tuple(p) for p in ins], [None if o is None else tuple(o) for o in outs]


def _input_nestings(gm: torch.fx.GraphModule, in_placements: Sequence[Placements]) -> dict[tuple[int, ...], list[Placements]]:
    """The strided layouts of the graph's inputs, by shape: a ZeRO state leaf ``P(("fsdp", "dp"))``
    nests ``dp`` inside ``fsdp``, against mesh order."""
    found: dict[tuple[int, ...], list[Placements]] = {}
    for ph, pl in zip(_placeholders(gm), in_placements):
        same_shape = found.setdefault(tuple(ph.meta["val"].shape), [])
        if any(isinstance(p, _compat.StridedShard) for p in pl) and tuple(pl) not in same_shape:
            same_shape.append(tuple(pl))
    return found


def _nested(nestings: dict[tuple[int, ...], list[Placements]], t: torch.Tensor, placements: Placements) -> Placements | None:
    """The strided layout of an input of ``t``'s shape whose mesh dims split the same tensor dims
    as ``placements`` do (in mesh order), if there is one: values shaped like a ZeRO state leaf
    (its gradient, its update) are split as the state is, so they reach it without regathering.
    ``None`` if there is none."""
    candidates = nestings.get(tuple(t.shape))
    if not candidates or any(isinstance(p, _compat.StridedShard) for p in placements):
        return None
    plain = tuple(_one_d(p) for p in placements)
    return next((pl for pl in candidates if tuple(_one_d(p) for p in pl) == plain), None)


def _shardable(node: torch.fx.Node, dm: Any, want_in: list[Placements]) -> bool:
    """DTensor's own filter on a combined strategy: every sharded input dim has a row per shard."""
    return all(
        _compat.is_tensor_shardable(_meta(v).shape, _compat.DTensorSpec(dm, pl, tensor_meta=_tmeta(_meta(v))))
        for v, pl in zip(_tensor_args(node), want_in)
    )


def _dtensor_decision(node: torch.fx.Node, dm: Any, want_in: list[Placements], asked: dict[Any, Any]) -> tuple[list[Placements], list[Placements | None]]:
    """What DTensor does for ``node`` when its inputs arrive as ``want_in`` (asked once per op
    signature and input placements in ``asked``: a model's repeated layers ask the same questions)."""
    key = (node.target, _sig(node.args), _sig(node.kwargs), tuple(want_in))
    if key not in asked:
        asked[key] = _ask_dtensor(node, dm, want_in)
    return asked[key]


def _ask_dtensor(node: torch.fx.Node, dm: Any, want_in: list[Placements]) -> tuple[list[Placements], list[Placements | None]]:
    it = iter(want_in)

    def spec(a: Any) -> Any:
        if isinstance(a, torch.fx.Node) and _is_tensor_node(a):
            return _compat.DTensorSpec(dm, next(it), tensor_meta=_tmeta(a.meta["val"]))
        return a

    schema = _compat.op_schema(node.target, pytree.tree_map(spec, node.args), pytree.tree_map(spec, node.kwargs))
    out = _compat.sharding_propagator().propagate_op_sharding(schema)
    suggested = want_in
    if out.needs_redistribute and out.redistribute_schema is not None:
        suggested = [s.placements for s in pytree.tree_leaves((out.redistribute_schema.args_schema, out.redistribute_schema.kwargs_schema)) if isinstance(s, _compat.DTensorSpec)]
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else (out.output_spec,)
    return [tuple(p) for p in suggested], [None if s is None else tuple(s.placements) for s in specs]


def local_shape(mesh: Mesh, t: torch.Tensor, placements: Placements) -> tuple[int, ...]:
    """Shape of the largest local shard of ``t`` laid out as ``placements`` (over ``mesh.device_axes``)."""
    shape = list(t.shape)
    for axis, p in zip(mesh.device_axes, placements):
        if _is_shard(p):
            d = _split_dim(p)
            shape[d] = -(-shape[d] // mesh.axis_size(axis))
    return tuple(shape)


def local_bytes(mesh: Mesh, t: torch.Tensor, placements: Placements) -> int:
    """Bytes of the largest local shard of ``t`` laid out as ``placements``."""
    return math.prod(local_shape(mesh, t, placements)) * t.element_size()


_STEP_ORDER = {"slice": 0, "partition": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4, "all_gather": 5}


def minor_step(mesh: Mesh, src: Placements, dst: Placements) -> tuple[int, int] | None:
    """``(mesh_dim, tensor_dim)`` when ``src`` -> ``dst`` changes one mesh dim between replicated,
    partial and a strided shard that is *minor* to every other mesh dim splitting that tensor dim
    (ZeRO's ``P(("fsdp", "dp"))``). Such a step is a plain 1D collective of the local shard along
    the tensor dim (a reduce-scatter into a ZeRO layout), where DTensor would all-reduce and slice."""
    changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(changed) != 1:
        return None
    k = changed[0]
    strided = [p for p in (src[k], dst[k]) if isinstance(p, _compat.StridedShard)]
    if not strided or any(not isinstance(p, (Replicate, Partial, _compat.StridedShard)) for p in (src[k], dst[k])):
        return None
    d = strided[0].dim
    if any(p.dim != d for p in strided) or any(isinstance(p, Partial) and p.reduce_op != "sum" for p in (src[k], dst[k])):
        return None
    later = math.prod(mesh.axis_size(a) for j, a in enumerate(mesh.device_axes) if j > k and _is_shard(src[j]) and _split_dim(src[j]) == d)
    earlier = any(_is_shard(src[j]) and _split_dim(src[j]) == d for j in range(k))
    return (k, d) if not earlier and all(p.split_factor == later for p in strided) else None


def transition_path(mesh: Mesh, src: Placements, dst: Placements) -> list[Placements]:
    """The placements a value passes through from ``src`` to ``dst``, one mesh dim at a time, in the
    order that moves the fewest bytes: local slices first, then reductions (a reduce-scatter shrinks
    what later steps move), then all-to-alls, then all-gathers. Strided shards move in one step
    (their order is part of the layout): DTensor's, except that a strided shard minor to the
    other splits of its dim is taken last, as a :func:`minor_step` after the other mesh dims moved
    (a gradient reduce-scattered over ``fsdp``, then over ``dp`` on its local shard: ZeRO's
    ``P(("fsdp", "dp"))``)."""
    if any(isinstance(p, _compat.StridedShard) for p in (*src, *dst)):
        last = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b and isinstance(b, _compat.StridedShard)]
        if len(last) == 1:
            mid = tuple(src[k] if k == last[0] else p for k, p in enumerate(dst))
            if mid != tuple(src) and not any(isinstance(p, _compat.StridedShard) for p in (*src, *mid)) and minor_step(mesh, mid, dst) is not None:
                return [*transition_path(mesh, src, mid), tuple(dst)]
        return [tuple(dst)]
    dims = sorted((k for k, (a, b) in enumerate(zip(src, dst)) if a != b), key=lambda k: (_STEP_ORDER.get(_kind(src[k], dst[k]), 9), k))
    path, current = [], list(src)
    for k in dims:
        current[k] = dst[k]
        path.append(tuple(current))
    return path


def _collectives(mesh: Mesh, t: torch.Tensor, src: Placements, dst: Placements) -> tuple[Collective, ...]:
    """The collectives that move ``t`` from ``src`` to ``dst`` (along :func:`transition_path`, each
    step as DTensor runs it, or vsf's ragged collectives for a ragged step), with the bytes each
    rank sends."""
    dm = mesh.device_mesh
    meta = _tmeta(t)
    dm_axes = list(mesh.device_axes)
    out = []
    prev = tuple(src)
    for nxt in transition_path(mesh, src, dst):
        current = list(prev)
        if _has_ragged([prev, nxt]) or minor_step(mesh, prev, nxt) is not None:
            steps = [(k, a, b) for k, (a, b) in enumerate(zip(prev, nxt)) if a != b]
        else:
            steps = [(k, a, b) for k, a, b, _ in _compat.redistribute_steps(_compat.DTensorSpec(dm, prev, tensor_meta=meta), _compat.DTensorSpec(dm, nxt, tensor_meta=meta))]
        for mesh_dim, a, b in steps:
            before = local_shape(mesh, t, tuple(current))
            current[mesh_dim] = b
            after = local_shape(mesh, t, tuple(current))
            kind = _kind(_one_d(a), _one_d(b))
            if kind in (None, "slice", "partition"):
                continue
            n = mesh.axis_size(dm_axes[mesh_dim])
            shape = after if kind == "all_gather" else before
            full = math.prod(shape) * t.element_size() * (n if kind == "all_to_all" else 1)
            out.append(Collective(kind, dm_axes[mesh_dim], shape, t.dtype, int(round(_transition_bytes(kind, n, full)))))
        prev = nxt
    return tuple(out)
