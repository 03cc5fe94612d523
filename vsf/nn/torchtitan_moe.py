"""torchtitan's mixture of experts (0.3's ``RoutedExperts``: separate ``w1_EFD``, ``w3_EFD`` and
``w2_EDF`` weights, the expert dim first) run through :func:`vsf.nn.expert_parallel` inside
``vsf.jit`` where its weights' specs split the expert dim, as :mod:`vsf.nn.moe` runs a
``transformers`` experts module.

Example::

    >>> specs = {k: P("ep") if ".inner_experts." in k else P() for k in params}
    >>> p, s, loss = vsf.jit(train_step)(vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)), s, batch)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vsf.config import PlanOptions
from vsf.jit.trace import rewrite_while_tracing
from vsf.nn.moe import dispatch_split, expert_parallel

__all__ = ["dispatching_torchtitan_experts"]


@contextlib.contextmanager
def dispatching_torchtitan_experts(options: PlanOptions) -> Iterator[None]:
    """Inside, torchtitan's routed experts (``torchtitan.models.common.moe.RoutedExperts``, torchtitan
    0.3: the token dispatcher and the grouped experts, whose separate weights ``w1_EFD``, ``w3_EFD``
    and ``w2_EDF`` have the expert dim first) run through :func:`expert_parallel` where those
    weights are step inputs split on the expert dim (``P("ep")``, efsdp's ``P("ep", "fsdp")``),
    the tokens split over every mesh axis but those that split the weights' ffn dims alone, as for
    :func:`dispatching_transformers_experts`; the local experts are torchtitan's own
    ``GroupedExperts`` on the rows each rank receives, and its token dispatcher is not run. Any
    other routed experts module runs as torchtitan's. ``vsf.jit`` enters it while it traces a step,
    with the plan's ``options``: nothing changes where ``vsf.config.dispatch_experts`` is off, or
    where torchtitan's MoE is not imported.

    Example::

        >>> specs = {k: P("ep") if ".inner_experts." in k else P() for k in params}
        >>> p, s, loss = vsf.jit(train_step)(vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)), s, batch)
    """
    found = sys.modules.get("torchtitan.models.common.moe")
    routed = getattr(found, "RoutedExperts", None)
    if (
        routed is None or not options.dispatch_experts or hasattr(routed.forward, "__wrapped__")
    ):  # (already in force: a trace inside a trace)
        yield
        return
    forward = routed.forward
    routed.forward = _torchtitan_dispatch_if_split(forward)
    try:
        yield
    finally:
        routed.forward = forward


_TORCHTITAN_EXPERTS = {"w1_EFD": 2, "w3_EFD": 2, "w2_EDF": 1}  # torchtitan's GroupedExperts: each weight's hidden dim


def _torchtitan_dispatch_if_split(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torchtitan's ``RoutedExperts.forward``, or the dispatch where its experts' weights say so."""

    @functools.wraps(forward)
    def routed(
        module: Any, x: torch.Tensor, scores: torch.Tensor, index: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        experts = module.inner_experts
        b, length, d = x.shape
        split = dispatch_split(experts, _TORCHTITAN_EXPERTS, b * length)
        if split is None:
            return forward(module, x, scores, index, counts)
        mesh, axis, token_axes = split

        def grouped(rows: torch.Tensor, offsets: torch.Tensor, *local: torch.Tensor) -> torch.Tensor:
            per_expert = torch.diff(offsets, prepend=offsets.new_zeros(1))
            return torch.func.functional_call(experts, dict(zip(_TORCHTITAN_EXPERTS, local)), (rows, per_expert))

        y = expert_parallel(
            grouped,
            x.reshape(b * length, d),
            index.reshape(b * length, -1),
            scores.reshape(b * length, -1),
            tuple(getattr(experts, k) for k in _TORCHTITAN_EXPERTS),
            axis=axis,
            token_axes=token_axes,
            mesh=mesh,
        )
        return y.view(b, length, d)

    return routed


rewrite_while_tracing(dispatching_torchtitan_experts)
