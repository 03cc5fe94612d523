"""What kind each op of a traced graph is, decided once per node (:func:`classify`) and carried
on the plan (``NodePlan.op``), so that strategies, the full-mesh check and lowering agree.

* ``constant``: no tensor input (a ``get_attr`` constant, a factory op): replicated, needs no strategy;
* ``constraint``: a ``with_sharding_constraint``: its value takes the sharding asked for;
* ``region``: a ``shard_map`` region or its backward (:mod:`vsf.ops.region`): its inputs and
  results take the region's shardings, and its body runs on local shards;
* ``value_blind``: the result depends on the input's shape only (``ones_like``): any placement will do;
* ``strategy``: DTensor registers a strategy for it, per mesh dim (``rules == "single"``) or for
  the whole op (``"full"``); ``local`` ops run as they are on local shards (their rules are per
  mesh dim and DTensor's dispatcher has no special handler for them), the others run through
  DTensor's dispatcher;
* ``none``: no strategy: a ``PlanError``, or replicated under ``allow_replicated_fallback``.

``ragged_reduction`` ops (sums, norms) also run on a rank's own ragged rows.

Example::

    >>> classify(mm_node)
    OpClass(kind='strategy', rules='single', local=True, ragged_reduction=False)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from vsf import _compat
from vsf.jit.graph import tensor_args
from vsf.ops import region
from vsf.sharding import constraint

__all__ = ["DISPATCHER_SPECIAL", "RAGGED_REDUCTIONS", "VALUE_BLIND_OPS", "OpClass", "classify"]

aten = torch.ops.aten


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


DISPATCHER_SPECIAL = _compat.dispatcher_special_ops()


@dataclasses.dataclass(frozen=True)
class OpClass:
    """What kind an op is (see the module docs)."""

    kind: str
    rules: str | None
    local: bool
    ragged_reduction: bool


def classify(node: torch.fx.Node) -> OpClass:
    """The kind of the op ``node`` runs (a ``call_function`` or ``get_attr`` node)."""
    rules = _compat.registered_rules(node.target)
    local = rules == "single" and node.target not in DISPATCHER_SPECIAL
    ragged_reduction = node.target in RAGGED_REDUCTIONS
    if node.op == "get_attr" or not tensor_args(node):
        kind = "constant"
    elif node.target is constraint.CONSTRAINT_OP:
        kind = "constraint"
    elif node.target in (region.REGION_OP, region.REGION_VJP_OP):
        kind = "region"
    elif node.target in VALUE_BLIND_OPS:
        kind = "value_blind"
    else:
        kind = "strategy" if rules is not None else "none"
    return OpClass(kind, rules, local, ragged_reduction)
