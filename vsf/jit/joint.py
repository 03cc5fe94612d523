"""The joint graph of a jitted call that torch autograd will differentiate: forward and vjp traced
as one functional aten graph on global fake tensors (as AOTAutograd traces its joint graph).

Its inputs are the call's tensor leaves (*primals*), then one *cotangent* per floating-point tensor
output; its outputs are the function's tensor outputs, then the gradient of every primal that
requires grad and gets one. :mod:`vsf.jit.partition` splits the planned joint graph into the
forward and backward programs.

Example::

    >>> joint = trace_joint(fun, avals, rebuild, mask, out_avals, "cpu")
    >>> joint.differentiable, joint.has_grad      # which outputs carry a gradient, which inputs get one
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from vsf import tree
from vsf.config import PlanOptions
from vsf.jit.trace import Traced, trace
from vsf.sharding.named import NamedSharding

__all__ = ["Joint", "runs_backward", "trace_joint"]


@dataclasses.dataclass(frozen=True)
class Joint:
    """A traced joint graph: ``traced.graph`` maps primals + cotangents to outputs + gradients.

    ``out_tree`` / ``out_consts``: the function's own result structure (as :class:`Traced` has
    them); ``differentiable[j]``: does tensor output ``j`` depend on an input that requires grad
    (its cotangent is used); ``has_grad[i]``: does input ``i`` (among those requiring grad) get a
    gradient (``None`` otherwise, as torch gives for an unused input).
    """

    traced: Traced
    out_tree: tree.PyTreeSpec
    out_consts: tuple[Any, ...]
    n_primals: int
    n_outputs: int
    differentiable: tuple[bool, ...]
    has_grad: tuple[bool, ...]


def trace_joint(
    fun: Callable[..., Any],
    avals: Sequence[tuple[tuple[int, ...], torch.dtype]],
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]],
    mask: Sequence[bool],
    out_avals: Sequence[tuple[tuple[int, ...], torch.dtype]],
    device: str,
    unplanned: Callable[[torch.fx.GraphModule], set[Any]] = lambda gm: set(),
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    *,
    allow_unkeyed_random: bool = False,
    shardings: Sequence[NamedSharding | None] = (),
    names: Callable[[int], str] = lambda i: f"input #{i}",
    options: PlanOptions | None = None,
) -> Joint:
    """Trace ``fun``'s forward and its vjp with respect to the inputs ``mask`` marks, for a call
    whose tensor leaves have ``avals`` and whose tensor outputs have ``out_avals`` (one cotangent
    placeholder each; an output that is not differentiable leaves its cotangent unused).
    ``shardings`` / ``names`` / ``options``: as :func:`vsf.jit.trace.trace`'s."""
    n, info = len(avals), {}

    @functools.wraps(fun)
    def joint(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        primals, cotangents = tensors[:n], tensors[n:]
        watched = [p.requires_grad_(True) if m else p for p, m in zip(primals, mask)]
        args, kwargs = rebuild(watched)
        with torch.enable_grad():
            out = fun(*args, **kwargs)
        leaves, treedef = tree.flatten(out)
        info["tree"], info["consts"] = treedef, tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
        outs = [x for x in leaves if isinstance(x, torch.Tensor)]
        diff = [o.requires_grad and _floating(o) for o in outs]
        wrt = [w for w, m in zip(watched, mask) if m]
        used = [(o, c) for o, c, d in zip(outs, cotangents, diff) if d]
        grads = (
            torch.autograd.grad([o for o, _ in used], wrt, [c for _, c in used], allow_unused=True)
            if used
            else [None] * len(wrt)
        )
        info["diff"], info["has_grad"] = tuple(diff), tuple(g is not None for g in grads)
        return outs + [g for g in grads if g is not None]

    traced = trace(
        joint,
        [*avals, *out_avals],
        lambda ts: ((ts,), {}),
        device,
        unplanned,
        decompositions,
        allow_unkeyed_random=allow_unkeyed_random,
        shardings=shardings,
        names=names,
        options=options,
    )
    return Joint(traced, info["tree"], info["consts"], n, len(out_avals), info["diff"], info["has_grad"])


def _floating(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@contextlib.contextmanager
def runs_backward() -> Iterator[list[bool]]:
    """Notice whether the code inside asks torch autograd for a gradient (``torch.autograd.grad``,
    as ``vsf.grad`` does): a traced step that runs its own backward. Yields a list that holds
    ``True`` once it has.

    Example::

        >>> with runs_backward() as seen:
        ...     traced = trace(step, avals, rebuild, "cpu")
        >>> bool(seen)
    """
    with _GradCalls() as mode:
        yield mode.seen


_ASKS_GRAD = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


class _GradCalls(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _ASKS_GRAD and not self.seen:
            self.seen.append(True)
        return func(*args, **(kwargs or {}))
