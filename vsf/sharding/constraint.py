"""The marker op that ``with_sharding_constraint`` leaves in a traced graph.

``vsf::sharding_constraint(x, sharding)`` is an identity whose second argument is the ``repr``
of a :class:`~vsf.NamedSharding` (value objects round-trip through ``repr``). The propagator pins
the value's sharding there; the lowering redistributes to it.
"""

from __future__ import annotations

from typing import Any

import torch

from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import UNCONSTRAINED, P, PartitionSpec

__all__ = ["CONSTRAINT_OP", "constrain", "parse"]


@torch.library.custom_op("vsf::sharding_constraint", mutates_args=())
def _sharding_constraint(x: torch.Tensor, sharding: str) -> torch.Tensor:
    return x.clone()


@_sharding_constraint.register_fake
def _(x: torch.Tensor, sharding: str) -> torch.Tensor:
    return torch.empty_like(x)


CONSTRAINT_OP = torch.ops.vsf.sharding_constraint.default


def _save_sharding(ctx: Any, inputs: tuple[torch.Tensor, str], output: torch.Tensor) -> None:
    ctx.sharding = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # JAX's transpose rule: the cotangent is pinned to the same sharding
    return CONSTRAINT_OP(grad, ctx.sharding), None


_sharding_constraint.register_autograd(_backward, setup_context=_save_sharding)

_NAMES = {
    "Mesh": Mesh,
    "NamedSharding": NamedSharding,
    "P": P,
    "PartitionSpec": PartitionSpec,
    "UNCONSTRAINED": UNCONSTRAINED,
}


def constrain(x: torch.Tensor, sharding: NamedSharding) -> torch.Tensor:
    """Record in the trace that ``x`` must have ``sharding`` here."""
    return CONSTRAINT_OP(x, repr(sharding))


def parse(text: str) -> NamedSharding:
    """The sharding a constraint node carries."""
    value = eval(text, {"__builtins__": {}}, dict(_NAMES))  # noqa: S307 - our own repr of a value object
    if not isinstance(value, NamedSharding):
        raise ValueError(f"not a sharding constraint: {text!r}")
    return value
