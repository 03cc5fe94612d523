"""What kind each op is, from DTensor's registries: the sets of ops the planner treats specially
(value-blind ops, ragged reductions, ops DTensor's dispatcher runs its own way) and which kind of
strategy DTensor registers for an op (per mesh dim, or for the whole op).

Example::

    >>> rules_of(torch.ops.aten.mm.default)
    'single'
"""

from __future__ import annotations

from typing import Any

import torch

from vsf import _compat

__all__ = ["DISPATCHER_SPECIAL", "RAGGED_REDUCTIONS", "VALUE_BLIND_OPS", "rules_of"]

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


def rules_of(op: Any) -> str | None:
    prop = _compat.sharding_propagator()
    if op in prop.op_single_dim_strategy_funcs:
        return "single"
    if op in prop.op_strategy_funcs or op in prop.op_to_rules:
        return "full"
    return None
