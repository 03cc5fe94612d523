"""DTensor's sharding strategies for an op, as the planner uses them: per mesh axis of ``n``
ranks, the list of (input placements -> output placements) an op allows; and DTensor's own
decision for an op on the full mesh. This is the only module of the planner that asks DTensor's
strategy registry, so the translation of DTensor's strategies into per-axis choices, the rules vsf
registers where DTensor has none, and the fallback are one piece: the only place that knows DTensor's
strategy types.

Example::

    >>> strategies, is_fallback = Strategies(PlanOptions(), {mm_node: classify(mm_node)}).of(mm_node, 2)
    >>> strategies[0]
    Strategy(ins=(Shard(dim=0), Replicate()), outs=(Shard(dim=0),))
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from vsf import _compat
from vsf.config import PlanOptions
from vsf.errors import PlanError
from vsf.jit import context_parallel, packed
from vsf.jit.classify import DISPATCHER_SPECIAL, OpClass
from vsf.jit.graph import Value, is_tensor_node, meta_of, outputs_meta, signature, tensor_args, user_line
from vsf.jit.cost import local_shape
from vsf.jit.plan import PARTIAL, Placements, R, splits_evenly
from vsf.sharding.mesh import Mesh
from vsf.sharding.placement import (
    RaggedPlacement,
    balanced_of,
    has_ragged,
    has_strided,
    is_shard,
    kind_of,
    on_dim,
    one_d,
    split_dim,
)

__all__ = ["Strategies", "Strategy", "decide", "dtensor_decision", "register_elementwise", "row_wise", "runnable"]


def register_elementwise(op: Any, *, outputs: int) -> None:
    """Tell DTensor's sharding propagation that ``op`` is elementwise: its positional tensor
    arguments of the first one's shape and its ``outputs`` results may be split alike on any dim
    (a plain or a strided shard); its other tensor arguments (0-d scalars) stay replicated.

    Example::

        >>> register_elementwise(torch.ops.vsf.adam_step.default, outputs=3)
    """

    def rules(shapes: list[torch.Size]) -> list[list[Placement | int]]:
        shape = shapes[0]
        return [[d] * outputs + [d if s == shape else Replicate() for s in shapes] for d in range(len(shape))]

    _compat.register_single_dim_rules(op, rules)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an op on one mesh axis: its tensor inputs' placements -> its outputs'."""

    ins: tuple[Placement, ...]
    outs: tuple[Placement | None, ...]


class Strategies:
    """DTensor's candidate strategies per op and axis size, cached by op signature and the strided
    shards and partial sums its inputs may arrive with (:meth:`arrivals`); ``classes`` holds each op's
    :class:`~vsf.jit.classify.OpClass`, in graph order; ``options`` the plan's switches (the
    replicated fallback, context parallelism's mode); ``inputs``, where the caller has found them,
    each op's tensor inputs; ``held``, per graph input, the strided shards it arrives with."""

    def __init__(
        self,
        options: PlanOptions,
        classes: dict[torch.fx.Node, OpClass],
        own: Callable[[torch.fx.Node, int], list[Strategy]] | None = None,
        inputs: dict[torch.fx.Node, list[Value]] | None = None,
        leaving: Callable[[torch.fx.Node, int], tuple[tuple[Placement, ...], ...]] | None = None,
        held: dict[torch.fx.Node, tuple[Placement, ...]] | None = None,
    ) -> None:
        self.options = options
        self.fallback = options.allow_replicated_fallback
        self.classes = classes
        self.own = own  # vsf's strategies for the ops it runs itself (kind "manual": vsf.jit.manual)
        # per output of such an op, the strided shards it may give on an axis where its region fixes it
        self.leaving = leaving
        self.held = dict(held or {})  # per graph input, the strided shards it arrives with (packed splits)
        self.cache: dict[Any, tuple[list[Strategy], bool]] = {}
        self.by_node: dict[Any, tuple[list[Strategy], bool]] = {}
        self.order = {node: i for i, node in enumerate(classes)}
        self.arriving: dict[tuple[torch.fx.Node, int], tuple[tuple[Placement, ...], ...]] = {}
        self.given: dict[tuple[int, int], tuple[tuple[Placement, ...], ...]] = {}
        self.arrival_numbers: dict[tuple[Placement, ...], int] = {}  # (:meth:`_numbered`)
        self.numbers: dict[int, tuple[tuple[Placement, ...], int]] = {}  # by id: the tuple (kept alive) and its number
        # each op's tensor inputs (:func:`~vsf.jit.graph.tensor_args`), the caller's or found as asked
        self.inputs = dict(inputs or {})
        self.signatures: dict[torch.fx.Node, tuple[Any, ...]] = {}  # per node, its target and arguments' signature
        self.tensor_signatures: dict[int, tuple[torch.Tensor, Any]] = {}  # (graph.signature's ``seen``)
        self.single: dict[Any, list[Strategy] | None] = {}  # DTensor's per-mesh-dim rules by signature (any size)
        # DTensor's whole-op strategies by signature, lead input, its placement and axis size (:func:`_by_each_input`)
        self.whole: dict[Any, list[Strategy]] = {}

    def of(
        self, node: torch.fx.Node, n: int, ragged: Sequence[tuple[RaggedPlacement, int]] = (), balanced: bool = False
    ) -> tuple[list[Strategy], bool]:
        """``(strategies, is_fallback)`` for ``node`` on an axis of ``n`` ranks; ``ragged`` lists the
        ragged splits ``(placement, rows)`` values on this axis have (they join per-row rules);
        ``balanced``: some value on this axis is split balanced (its variants join the shard rules)."""
        mine = (node, n, tuple(ragged), balanced)
        if mine in self.by_node:  # (asked per op by every axis's solver, every sweep)
            return self.by_node[mine]
        arrivals = self.arrivals(node, n)
        key = (*self.signature(node), n, tuple(ragged), balanced, tuple([self._numbered(a) for a in arrivals]))
        if key not in self.cache:
            op = self.classes[node]
            found, fallback = self._compute(node, op, n, arrivals)
            if ragged and (op.ragged_reduction or op.local):
                found = found + _ragged_variants(node, found, ragged)
            if balanced and op.kind in ("strategy", "value_blind", "constraint") and _blind_to_offsets(node):
                found = found + _balanced_variants(node, found, n)
            if op.rules == "full" and _blind_to_offsets(node):
                found = found + _valid(_strided_variants(node, found, arrivals, n), node, n, arrivals)
            if any(self.held.values()):  # a packed input: its chunks, their cat and regions keep it split
                kept = (
                    packed.passed_through([(st.ins, st.outs) for st in found], arrivals) if op.kind == "manual" else []
                )
                kept += packed.rules(node, arrivals)
                found = found + _valid([Strategy(*r) for r in kept], node, n, arrivals)
            self.cache[key] = (found, fallback)
        self.by_node[mine] = self.cache[key]
        return self.cache[key]

    def arrivals(self, node: torch.fx.Node, n: int) -> tuple[tuple[Placement, ...], ...]:
        """Per tensor input of ``node``, the strided shards and partial sums it may arrive with on
        an axis of ``n`` ranks: those some strategy of its producer gives it (a view merging a dim
        split over this axis into a larger one, ``[b, h@tp] -> [b*h]``, and the ops that keep such
        a split; a sum over split rows), and those a region's boundary op may give where its region
        fixes it (``leaving``)."""
        unknown, stack = set(), [node]
        while stack:
            for p, _ in self._inputs(stack.pop()):
                if p in self.classes and (p, n) not in self.arriving and p not in unknown:
                    unknown.add(p)
                    stack.append(p)
        for p in sorted(unknown, key=self.order.__getitem__):  # producers first: each asks its own inputs
            given = self._given(self.of(p, n)[0], len(outputs_meta(p)))
            if self.leaving is not None and self.classes[p].kind == "manual":
                given = tuple(g + extra for g, extra in zip(given, self.leaving(p, n)))
            self.arriving[(p, n)] = given
        return tuple(
            self.arriving[(p, n)][i] if (p, n) in self.arriving else self.held.get(p, ()) for p, i in self._inputs(node)
        )

    def _numbered(self, arrival: tuple[Placement, ...]) -> int:
        """A number for one input's :meth:`arrivals` (equal numbers: equal placements), found once per
        tuple :meth:`arrivals` hands out (they are kept, one per producer and output): the strided
        shards among them hash slowly, and every op of every block asks."""
        kept = self.numbers.get(id(arrival))
        if kept is None or kept[0] is not arrival:
            kept = self.numbers[id(arrival)] = (
                arrival,
                self.arrival_numbers.setdefault(arrival, len(self.arrival_numbers)),
            )
        return kept[1]

    def signature(self, node: torch.fx.Node) -> tuple[Any, ...]:
        """``node``'s target and its arguments' :func:`~vsf.jit.graph.signature`, found once (the
        repeated blocks' ops share one: what the strategies and DTensor's decision depend on).

        Example::

            >>> strategies.signature(mm_node)
            (aten.mm.default, (('T', (8, 6), torch.float32), ('T', (6, 4), torch.float32)), ())
        """
        if node not in self.signatures:
            seen = self.tensor_signatures
            self.signatures[node] = (node.target, signature(node.args, seen), signature(node.kwargs, seen))
        return self.signatures[node]

    def _single_dim(self, node: torch.fx.Node, strided: tuple[tuple[Placement, ...], ...]) -> list[Strategy] | None:
        """:func:`_single_dim` of ``node``, asked once per signature and strided arrivals: DTensor's
        per-mesh-dim rules do not depend on the axis's size (the sizes' checks are :func:`_valid`'s)."""
        key = (*self.signature(node), strided)
        if key not in self.single:
            self.single[key] = _single_dim(node, strided)
        return self.single[key]

    def _inputs(self, node: torch.fx.Node) -> list[Value]:
        """:func:`~vsf.jit.graph.tensor_args` of ``node``, found once."""
        if node not in self.inputs:
            self.inputs[node] = tensor_args(node)
        return self.inputs[node]

    def _given(self, strategies: list[Strategy], n_out: int) -> tuple[tuple[Placement, ...], ...]:
        """Per output, the strided shards and partial sums some of ``strategies`` give it (once per
        list: ops of one signature share one)."""
        key = (id(strategies), n_out)
        if key not in self.given:
            outs: list[dict[Placement, None]] = [{} for _ in range(n_out)]
            for st in strategies:
                for i, o in enumerate(st.outs):
                    if kind_of(o) in ("strided", "partial"):
                        outs[i].setdefault(o)
            self.given[key] = tuple(tuple(o) for o in outs)
        return self.given[key]

    def _compute(
        self, node: torch.fx.Node, op: OpClass, n: int, arrivals: tuple[tuple[Placement, ...], ...]
    ) -> tuple[list[Strategy], bool]:
        ins = tensor_args(node)
        outs = outputs_meta(node)
        if op.kind == "constant":
            return [Strategy(tuple(R for _ in ins), tuple(R if o is not None else None for o in outs))], False
        if op.kind == "constraint":
            return [Strategy((p,), (p,)) for p in _candidates(meta_of(ins[0]), n)], False
        if op.kind == "manual":
            assert self.own is not None, f"{node.target} needs vsf's own strategies"
            return self.own(node, n), False
        if op.kind == "value_blind":
            inputs = [*_candidates(meta_of(ins[0]), n), Partial("avg"), Partial("max"), Partial("min")]
            return [Strategy((p,), (p if is_shard(p) else R,)) for p in inputs], False
        strided = tuple(tuple(p for p in ps if kind_of(p) == "strided") for ps in arrivals)
        found = (
            self._single_dim(node, strided)
            if op.rules == "single"
            else _by_each_input(node, n, strided, self.whole, self.signature(node))
            if op.rules
            else None
        )
        if found:
            return _valid(found + _context_parallel(node, self.options), node, n, arrivals), False
        if self.fallback:
            return [Strategy(tuple(R for _ in ins), tuple(R if o is not None else None for o in outs))], True
        raise PlanError(
            f"{node.target} has no DTensor sharding strategy, so vsf cannot shard it{user_line(node)}. "
            "Register its rules with torch.distributed.tensor.experimental.register_sharding (vsf plans with them), "
            "or set vsf.config.allow_replicated_fallback = True to run it replicated (the plan flags it)."
        )


def _ragged_variants(
    node: torch.fx.Node, strategies: list[Strategy], ragged: Sequence[tuple[RaggedPlacement, int]]
) -> list[Strategy]:
    """Per-row rules (every shard on dim 0 of a tensor with that many rows) run on a ragged split
    of those rows too: an elementwise op keeps ragged rows ragged, a sum over the rows of ragged
    operands is a partial sum."""
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    out = []
    for g, rows in ragged:
        for st in strategies:
            placed = [*st.ins, *st.outs]
            shards = [(t, p) for t, p in zip(metas, placed) if t is not None and p is not None and is_shard(p)]
            if not any(is_shard(p) for p in st.ins) or not all(
                isinstance(p, Shard) and p.dim == 0 and t.shape[0] == rows for t, p in shards
            ):
                continue
            if any(isinstance(p, Partial) and p.reduce_op == "avg" for p in st.outs if p is not None):
                continue  # an average of per-rank averages is wrong when ranks hold different row counts
            swap = lambda p: g if isinstance(p, Shard) else p  # noqa: E731
            out.append(Strategy(tuple(swap(p) for p in st.ins), tuple(None if p is None else swap(p) for p in st.outs)))
    return out


def _blind_to_offsets(node: torch.fx.Node) -> bool:
    """Does ``node`` compute a shard without knowing where it starts? Random ops (their numbers
    follow the global index) and the ops DTensor's dispatcher treats specially (an argmax's
    indices) do not; attention without dropout does (its kernel is tagged random for dropout)."""
    seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
    return node.target not in DISPATCHER_SPECIAL and (not seeded or context_parallel.is_attention(node))


def _balanced_variants(node: torch.fx.Node, strategies: list[Strategy], n: int) -> list[Strategy]:
    """Each rule whose shards on this axis are all plain or strided shards, with every one a
    balanced split instead (:class:`~vsf.sharding.placement.BalancedPlacement`; a strided shard, a
    view's merge of a split dim into a larger one, becomes a balanced split of each of its
    groups), where each split dim cuts into ``2n`` equal chunks (per group). A rule that computes
    every contiguous block of a dim on its own (what a shard rule says, for any number of ranks)
    computes every chunk on its own, so it holds on chunks held in any order, as long as every
    split operand holds the same ones: all of the rule's shards become balanced together.
    (Causal attention, which does know where its queries start, runs its balanced blocks itself:
    :mod:`vsf.jit.context_parallel`.)"""
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    out = []
    for st in strategies:
        placed = [*st.ins, *st.outs]
        shards = [(t, p) for t, p in zip(metas, placed) if p is not None and is_shard(p)]
        plain = all(kind_of(p) in ("shard", "strided") for _, p in shards)
        if (
            not shards
            or not plain
            or any(t is None or t.shape[p.dim] % (2 * n * balanced_of(p).groups) for t, p in shards)
        ):
            continue
        swap = lambda p: balanced_of(p) if p is not None and is_shard(p) else p  # noqa: E731
        out.append(Strategy(tuple(swap(p) for p in st.ins), tuple(swap(p) for p in st.outs)))
    return out


def _strided_variants(
    node: torch.fx.Node, strategies: list[Strategy], arrivals: tuple[tuple[Placement, ...], ...], n: int
) -> list[Strategy]:
    """Each row rule (every shard a plain ``Shard(d)`` of one dim ``d``, each of the same size)
    with every shard a strided shard of ``d`` that an input may arrive with instead. The argument
    of :func:`_balanced_variants`: a rule that computes each contiguous block of rows on its own
    computes any set of rows on its own, so it holds on the rows a strided shard holds (a view's
    merge of a split dim into a larger one: the rows of ``[b@dp, t@cp] -> [b*t]`` over ``cp``), as
    long as every sharded operand holds the same ones. DTensor's whole-op rules name plain shards
    only (``gather``'s, which a cross-entropy over those rows runs), so without these the rows
    would be gathered. Such a rule runs on the local shards (:func:`row_wise`), so only one whose
    arguments hold there is offered."""
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    strided = list(dict.fromkeys(p for ps in arrivals for p in ps if kind_of(p) == "strided"))
    out = []
    for st in strategies:
        shards = [(t, p) for t, p in zip(metas, [*st.ins, *st.outs]) if t is not None and p is not None and is_shard(p)]
        if (
            not shards
            or any(kind_of(p) != "shard" for _, p in shards)
            or len({(p.dim, t.shape[p.dim]) for t, p in shards}) != 1
        ):
            continue
        d = shards[0][1].dim
        local = [
            None
            if t is None
            else tuple(k // n if p is not None and is_shard(p) and i == d else k for i, k in enumerate(t.shape))
            for t, p in zip(metas, [*st.ins, *st.outs])
        ]
        if not any(g.dim == d for g in strided) or not _local_shapes_hold(
            node, local[: len(st.ins)], local[len(st.ins) :]
        ):
            continue
        for g in strided:
            if g.dim == d:
                swap = lambda p: g if p is not None and is_shard(p) else p  # noqa: E731
                out.append(Strategy(tuple(swap(p) for p in st.ins), tuple(swap(p) for p in st.outs)))
    return out


def row_wise(
    node: torch.fx.Node,
    mesh: Mesh,
    arrived: list[Placements],
    ins: list[Placements],
    outs: list[Placements | None],
    asked: dict[Any, Any],
) -> tuple[list[Placements], list[Placements | None]] | None:
    """The full-mesh placements ``node`` runs with on local shards, row for row, where the per-axis
    choices ``ins``/``outs`` took a :func:`_strided_variants` rule; ``None`` where they did not, or
    it cannot. On each mesh dim every operand the choices split is split as the inputs arriving
    split there are (all alike: a strided shard's factor on the full mesh is the arriving value's),
    one arriving replicated is cut there locally, so every rank holds the same rows of each. It
    runs when the op does not read where its rows start, every split operand is split evenly on
    one dim of one size, DTensor runs the same layout with plain shards in place of the strided
    ones as a row rule, and the op's arguments hold on local shards (run on meta tensors of the
    local shapes, it gives the outputs' local shapes: an ``expand`` to a global size does not)."""
    if (
        not has_strided(ins)
        or not _blind_to_offsets(node)
        or any(isinstance(q, Partial) for p in [*arrived, *ins] for q in p)
    ):
        return None
    metas = [meta_of(v) for v in tensor_args(node)]
    dims = {(split_dim(q), t.shape[split_dim(q)]) for t, p in zip(metas, ins) for q in p if is_shard(q)}
    if len(dims) != 1:
        return None
    (d, _), common = dims.pop(), []
    for k in range(len(mesh.device_axes)):
        split = [a[k] for a, p in zip(arrived, ins) if is_shard(p[k])]
        came = {q for q in split if is_shard(q) and split_dim(q) == d}
        if len(came) > 1 or (split and not came and any(kind_of(p[k]) == "strided" for p in ins)):
            return None
        common.append(came.pop() if came else next((p[k] for p in ins if is_shard(p[k])), R))
    placed = lambda p: None if p is None else tuple(common[k] if is_shard(q) else q for k, q in enumerate(p))  # noqa: E731
    got_in, got_out = [placed(p) for p in ins], [placed(o) for o in outs]
    if any(isinstance(q, Partial) for o in got_out if o is not None for q in o) or not all(
        splits_evenly(mesh, t, p) for t, p in zip(metas, got_in)
    ):
        return None
    plain = lambda p: None if p is None else tuple(one_d(q) for q in p)  # noqa: E731
    want = [plain(p) for p in got_in]
    if dtensor_decision(node, mesh.device_mesh, want, asked) != (want, [plain(o) for o in got_out]) or not runnable(
        mesh, node, got_in, got_out
    ):
        return None
    shapes = lambda ts, ps: [None if t is None or p is None else local_shape(mesh, t, p) for t, p in zip(ts, ps)]  # noqa: E731
    return (
        (got_in, got_out)
        if _local_shapes_hold(node, shapes(metas, got_in), shapes(outputs_meta(node), got_out))
        else None
    )


def _local_shapes_hold(
    node: torch.fx.Node, ins: Sequence[tuple[int, ...]], outs: Sequence[tuple[int, ...] | None]
) -> bool:
    """Does ``node`` run on meta tensors of its inputs' local shapes ``ins`` give its outputs'
    local shapes ``outs`` (``None``: an output not checked)? An argument naming a global size
    (``expand``'s) makes it raise or give the global shape."""
    shards = iter(
        [torch.empty(shape, dtype=meta_of(v).dtype, device="meta") for v, shape in zip(tensor_args(node), ins)]
    )
    local = lambda a: next(shards) if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a  # noqa: E731
    with _compat.local_mode_disabled():
        args = _compat.torch_tree_map(local, node.args)
        kwargs = _compat.torch_tree_map(local, node.kwargs)
        try:
            out = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the op refuses the local shapes: it does not run on them
            return False
    got = out if isinstance(out, (tuple, list)) else [out]
    return len(got) == len(outs) and all(
        want is None or (isinstance(o, torch.Tensor) and tuple(o.shape) == want) for o, want in zip(got, outs)
    )


def _context_parallel(node: torch.fx.Node, options: PlanOptions) -> list[Strategy]:
    """vsf's own splits of an attention node over its queries' sequence (:mod:`vsf.jit.context_parallel`)."""
    n_out = len(outputs_meta(node))
    return [
        Strategy(tuple(rule[n_out:]), tuple(rule[:n_out])) for rule in context_parallel.sequence_rules(node, options)
    ]


def _single_dim(node: torch.fx.Node, strided: tuple[tuple[Placement, ...], ...]) -> list[Strategy] | None:
    fake = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a  # noqa: E731
    outs = outputs_meta(node)
    out = outs[0] if isinstance(node.meta.get("val"), torch.Tensor) else outs
    shards = list(dict.fromkeys(p for ps in strided for p in ps))
    rules = _compat.single_dim_strategies(
        node.target, _compat.torch_tree_map(fake, node.args), _compat.torch_tree_map(fake, node.kwargs), out, shards
    )
    if rules is None:
        return None
    n_out = len(outs)
    return [Strategy(tuple(R if p is None else p for p in rule[n_out:]), tuple(rule[:n_out])) for rule in rules]


def _candidates(t: torch.Tensor, n: int) -> list[Placement]:
    return [R, PARTIAL] + [Shard(d) for d in range(t.ndim) if t.shape[d] >= n and t.shape[d] > 1]


def _by_each_input(
    node: torch.fx.Node,
    n: int,
    strided: tuple[tuple[Placement, ...], ...],
    asked: dict[Any, list[Strategy]],
    sig: tuple[Any, ...],
) -> list[Strategy] | None:
    """Ask a whole-op strategy function (or rule) once per candidate placement of each tensor input
    that is not a scalar (and each strided shard it may arrive with), the other inputs replicated:
    most functions follow their first input, some another one (``nll_loss_backward`` follows
    ``self``, its second). Each question is asked once per op signature ``sig`` (target, arguments'
    shapes, strides, dtypes and other values: all DTensor's function reads of the op), lead input,
    its placement and ``n``, in ``asked``: ops of one signature whose inputs may arrive otherwise
    (other strided shards or partial sums: :meth:`Strategies.arrivals`) ask its plain candidates
    again (a 24-layer GPT's step on 8 ranks: 631 questions, 464 of them different).

    Example::

        >>> _by_each_input(transpose_node, 2, ((),), {}, strategies.signature(transpose_node))[2]
        Strategy(ins=(Shard(dim=0),), outs=(Shard(dim=1),))
    """
    if _compat.registered_rules(node.target) != "full":
        return None
    ins = tensor_args(node)
    found: dict[Strategy, None] = {}
    leads = [i for i, a in enumerate(ins) if i == 0 or meta_of(a).ndim > 0]
    for lead, placement in ((i, c) for i in leads for c in [*_candidates(meta_of(ins[i]), n), *strided[i]]):
        key = (sig, lead, placement, n)
        if key not in asked:
            asked[key] = _led_by(node, lead, placement, n)
        found.update(dict.fromkeys(asked[key]))
    return list(found)


def _led_by(node: torch.fx.Node, lead: int, placement: Placement, n: int) -> list[Strategy]:
    """The strategies DTensor's whole-op function offers for ``node`` on ``n`` ranks with its
    ``lead``-th tensor input placed as ``placement`` and the others replicated (none where it
    rejects that input)."""
    seen = [0]

    def placed(a: Any) -> Any:
        if isinstance(a, torch.fx.Node) and is_tensor_node(a):
            p = placement if seen[0] == lead else R
            seen[0] += 1
            return _compat.Placed(a.meta["val"], (p,))
        return a

    args = _compat.torch_tree_map(placed, node.args)
    kwargs = _compat.torch_tree_map(placed, node.kwargs)
    try:
        strategy = _compat.whole_op_strategies(node.target, args, kwargs, n) or []
    except Exception:  # noqa: BLE001 - DTensor rejects this candidate input; try the next
        return []
    return [Strategy(ins_, outs) for ins_, outs in strategy]


def _valid(
    strategies: list[Strategy], node: torch.fx.Node, n: int, arrivals: tuple[tuple[Placement, ...], ...]
) -> list[Strategy]:
    """The strategies whose shards have a row per rank and whose partial integer inputs may arrive
    partial (a count summed over split rows): a replicated value becomes partial by keeping a share
    of it on each rank (``v / n``), which an integer (embedding's indices, which DTensor's rule
    would take partial) cannot hold."""
    ins = [meta_of(v) for v in tensor_args(node)]
    metas = ins + outputs_meta(node)
    partitioned = lambda t, p, came: isinstance(p, Partial) and not t.is_floating_point() and p not in came  # noqa: E731
    ok = []
    for s in strategies:
        placed = [*s.ins, *s.outs]
        if len(placed) != len(metas) or any(partitioned(t, p, came) for t, p, came in zip(ins, s.ins, arrivals)):
            continue
        if all(t is None or p is None or not is_shard(p) or _fits(t, p, n) for t, p in zip(metas, placed)):
            ok.append(s)
    return ok


def _fits(t: torch.Tensor, p: Placement, n: int) -> bool:
    """Does ``t``'s dim have a row per shard of ``p`` (a strided shard: its split factor's pieces
    split evenly, as a view merging an evenly split dim into a larger one leaves them)?"""
    if kind_of(p) == "strided":
        return p.dim < t.ndim and t.shape[p.dim] % (p.split_factor * n) == 0
    return not isinstance(p, Shard) or (p.dim < t.ndim and t.shape[p.dim] >= n)


def runnable(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Can ``node`` run on local shards laid out as ``ins``, giving ``outs``? DTensor's own filter
    (every sharded dim of an input *and an output* has a row per shard: per mesh dim each may,
    and not together, as 2 rows over ``S(0), S(0)`` on 2 x 2 ranks), a reshape's dims split evenly
    by all their mesh dims together (as DTensor asks of each alone: 24 elements over
    ``P(("tp", "dp"))`` are 6 per rank, not rows of a ``(6, 4)`` view); a reshape of strided
    shards only where each rank's local view holds its own output shard (:func:`_views_locally`:
    DTensor's rule gets some wrong, ``(24,)`` as ``P(("tp", "dp"))`` viewed as ``(6, 4)`` is not
    ``S(0)`` over tp and a strided ``S(1)`` over dp); an op DTensor's dispatcher runs by a handler
    of its own takes no strided shard (argmax's raises ``NotImplementedError``); and a max or min
    over shards needs a row on every rank (it has no identity for an empty shard). A reshape may
    make any nesting of strided shards (a view of ``S(1), S(0)`` into one dim makes ``S(0)/sf4,
    S(0)``, the tokens ``[batch@ep, seq@cp]`` merged on a mesh ``("cp", "ep")``): DTensor cannot
    regather it, vsf moves it itself (:func:`vsf.jit.redistribute.strided_regather`)."""
    dm = mesh.device_mesh
    metas = [meta_of(v) for v in tensor_args(node)]
    placed = [*zip(metas, ins), *((t, p) for t, p in zip(outputs_meta(node), outs) if t is not None and p is not None)]
    if not all(_compat.is_shardable(t, dm, tuple(p)) for t, p in placed):
        return False
    if node.target in _RESHAPES:
        if not all(splits_evenly(mesh, t, p) for t, p in placed):
            return False  # DTensor's rule checks each mesh dim's split of a merged or split dim alone
        if has_strided(ins) and not _views_locally(mesh, metas[0], ins[0], outputs_meta(node)[0], outs[0]):
            return False
    if node.target in DISPATCHER_SPECIAL and has_strided(ins):
        return False
    extreme = any(isinstance(q, Partial) and q.reduce_op in ("max", "min") for p in outs if p is not None for q in p)
    return not extreme or not any(_has_empty_shard(mesh, t, p) for t, p in zip(metas, ins))


aten = torch.ops.aten
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
# the convolution ops DTensor's dispatcher runs by a handler of its own, by their weight's argument
_CONVOLUTIONS = {aten.convolution.default: 1, aten.convolution_backward.default: 2}


def batch_split_convolution(node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Is ``node`` a convolution (or its backward) that ``ins``/``outs`` split over its batch
    alone: on each mesh dim, its activations (and gradients of activations) either whole or split on
    dim 0 alike, its weight and bias whole, and its weight's and bias's gradients whole or partial
    sums? Such a convolution runs on the local shards, as DTensor's convolution handler runs it,
    without that handler, which reads the placements' dim map and so refuses a batch split over
    two mesh dims (``S(0), S(0)``: a batch over dp and fsdp).

    Example::

        >>> batch_split_convolution(conv, [(S0, S0), (R, R), (R, R)], [(S0, S0)])
        True
    """
    weight = _CONVOLUTIONS.get(node.target)
    if weight is None or not all(q == R or (type(q) is Shard and q.dim == 0) for q in ins[0]):
        return False
    batch, summed = tuple(ins[0]), tuple(R if q == R else Partial() for q in ins[0])
    return (
        all(tuple(p) == batch for p in ins[:weight])
        and all(q == R for p in ins[weight:] for q in p)
        and all(o is None or tuple(o) == (batch if i == 0 else summed) for i, o in enumerate(outs))
    )


def _views_locally(mesh: Mesh, src: torch.Tensor, src_p: Placements, dst: torch.Tensor, dst_p: Placements) -> bool:
    """Does viewing each rank's local shard of ``src`` (laid out as ``src_p``) as its local shape
    give that rank's shard of the reshaped ``dst`` (laid out as ``dst_p``), element for element?
    Checked on the indices of each group of dims the reshape merges or splits, on every coordinate
    of the mesh dims that split the group (:func:`vsf._compat.shard_of`: DTensor's own split)."""
    if has_ragged([src_p, dst_p]):
        return False
    sizes = tuple(mesh.axis_size(a) for a in mesh.device_axes)
    return _groups_view_locally(tuple(src.shape), tuple(src_p), tuple(dst.shape), tuple(dst_p), sizes)


@functools.cache
def _groups_view_locally(
    src: tuple[int, ...], src_p: Placements, dst: tuple[int, ...], dst_p: Placements, sizes: tuple[int, ...]
) -> bool:
    for src_dims, dst_dims in _view_groups(src, dst):
        src_g, dst_g = _in_group(src_p, src_dims), _in_group(dst_p, dst_dims)
        mesh_dims = [k for k, (a, b) in enumerate(zip(src_g, dst_g)) if is_shard(a) or is_shard(b)]
        if not mesh_dims:
            continue
        index = torch.arange(math.prod(src[d] for d in src_dims))
        for coordinate in itertools.product(*(range(sizes[k]) if k in mesh_dims else (0,) for k in range(len(sizes)))):
            mine = _compat.shard_of(index.view([src[d] for d in src_dims]), src_g, sizes, coordinate)
            theirs = _compat.shard_of(index.view([dst[d] for d in dst_dims]), dst_g, sizes, coordinate)
            if not torch.equal(mine.reshape(-1), theirs.reshape(-1)):
                return False
    return True


def _view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The dims of ``src`` and of ``dst`` (same number of elements) that a reshape maps onto each
    other, group by group: a group starts where a dim of each shape starts after as many outer
    elements (the product of the dims before it) (``(8, 4, 32) -> (32, 32)``: ``[0, 1] -> [0]``
    and ``[2] -> [1]``)."""
    starts = lambda shape: [math.prod(shape[:d]) for d in range(len(shape))]  # noqa: E731
    bounds = sorted(set(starts(src)) & set(starts(dst)))
    group = lambda shape: [bisect.bisect_right(bounds, s) - 1 for s in starts(shape)]  # noqa: E731
    of_src, of_dst = group(src), group(dst)
    return [
        ([d for d, g in enumerate(of_src) if g == k], [d for d, g in enumerate(of_dst) if g == k])
        for k in range(len(bounds))
    ]


def _in_group(placements: Placements, dims: list[int]) -> Placements:
    """``placements`` on the tensor made of ``dims`` alone (a shard of another dim: replicated)."""
    out = []
    for p in placements:
        if is_shard(p) and split_dim(p) in dims:
            d = dims.index(split_dim(p))
            out.append(on_dim(p, d) if kind_of(p) == "strided" else Shard(d))
        else:
            out.append(R)
    return tuple(out)


def _has_empty_shard(mesh: Mesh, t: torch.Tensor, placements: Placements) -> bool:
    """Does some rank hold no rows of ``t`` laid out as ``placements`` (``torch.chunk``'s split:
    5 rows on 4 ranks are 2, 2, 1, 0)?"""
    for d, size in enumerate(t.shape):
        pieces = [size]
        for axis, p in zip(mesh.device_axes, placements):
            if kind_of(p) == "shard" and p.dim == d:
                n = mesh.axis_size(axis)
                pieces = [max(0, min(-(-s // n), s - i * -(-s // n))) for s in pieces for i in range(n)]
        if 0 in pieces:
            return True
    return False


def decide(
    node: torch.fx.Node, mesh: Mesh, want_in: list[Placements], asked: dict[Any, Any]
) -> tuple[list[Placements], list[Placements | None]]:
    """What DTensor does for ``node`` when its inputs arrive as ``want_in``; where DTensor refuses
    those inputs (its strategy raises) or answers with a layout it cannot run (:func:`runnable`),
    what it does with them replicated over the last mesh dim, then the last two, and so on: the
    per-axis choices combined may ask for what no single mesh dim does."""
    ndim = len(mesh.device_axes)
    for dropped in range(ndim + 1):
        attempt = [tuple(R if k >= ndim - dropped else p for k, p in enumerate(pl)) for pl in want_in]
        decision = dtensor_decision(node, mesh.device_mesh, attempt, asked)
        if decision is not None and runnable(mesh, node, *decision):
            return decision
    raise PlanError(
        f"DTensor has no strategy that runs {node.target} on this mesh, not even replicated{user_line(node)}"
    )


def dtensor_decision(
    node: torch.fx.Node, dm: Any, want_in: list[Placements], asked: dict[Any, Any]
) -> tuple[list[Placements], list[Placements | None]] | None:
    """What DTensor does for ``node`` when its inputs arrive as ``want_in``, ``None`` if it refuses
    them (asked once per op signature and input placements in ``asked``: a model's repeated layers
    ask the same questions)."""
    key = (node.target, signature(node.args), signature(node.kwargs), tuple(want_in))
    if key not in asked:
        it = iter(want_in)
        placed = lambda a: (
            _compat.Placed(a.meta["val"], next(it)) if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a
        )  # noqa: E731
        args = _compat.torch_tree_map(placed, node.args)
        try:
            asked[key] = _compat.dtensor_decision(node.target, args, _compat.torch_tree_map(placed, node.kwargs), dm)
        except Exception:  # noqa: BLE001 - DTensor's strategy rejects these inputs (an uneven nll_loss, ...)
            asked[key] = None
    return asked[key]
