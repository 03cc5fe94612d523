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

from vsf import _compat
from vsf.errors import PlanError
from vsf.jit.classify import OpClass
from vsf.jit.graph import is_tensor_node, meta_of, outputs_meta, signature, tensor_args, user_line
from vsf.jit.plan import PARTIAL, Placements, R, is_shard
from vsf.sharding.named import RaggedPlacement

__all__ = ["Strategies", "Strategy", "dtensor_decision", "shardable"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an op on one mesh axis: its tensor inputs' placements -> its outputs'."""

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
        if op.kind == "region":
            return [], False  # one strategy per axis, from the region's specs (vsf.jit.manual)
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


def _single_dim(node: torch.fx.Node, n: int) -> list[Strategy] | None:
    fake = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a  # noqa: E731
    outs = outputs_meta(node)
    out = outs[0] if isinstance(node.meta.get("val"), torch.Tensor) else outs
    rules = _compat.single_dim_strategies(node.target, _compat.torch_tree_map(fake, node.args), _compat.torch_tree_map(fake, node.kwargs), out)
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
    if _compat.registered_rules(node.target) != "full":
        return None
    ins = tensor_args(node)
    found: dict[Strategy, None] = {}
    leads = [i for i, a in enumerate(ins) if i == 0 or meta_of(a).ndim > 0]
    for lead, placement in ((i, c) for i in leads for c in _candidates(meta_of(ins[i]), n)):
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
            continue
        for ins_, outs in strategy:
            found.setdefault(Strategy(ins_, outs))
    return list(found)


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
    return all(_compat.is_shardable(meta_of(v), dm, pl) for v, pl in zip(tensor_args(node), want_in))


def dtensor_decision(node: torch.fx.Node, dm: Any, want_in: list[Placements], asked: dict[Any, Any]) -> tuple[list[Placements], list[Placements | None]]:
    """What DTensor does for ``node`` when its inputs arrive as ``want_in`` (asked once per op
    signature and input placements in ``asked``: a model's repeated layers ask the same questions)."""
    key = (node.target, signature(node.args), signature(node.kwargs), tuple(want_in))
    if key not in asked:
        it = iter(want_in)
        placed = lambda a: _compat.Placed(a.meta["val"], next(it)) if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a  # noqa: E731
        args = _compat.torch_tree_map(placed, node.args)
        asked[key] = _compat.dtensor_decision(node.target, args, _compat.torch_tree_map(placed, node.kwargs), dm)
    return asked[key]
