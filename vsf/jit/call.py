"""One call of a jitted function, its arguments prepared (:class:`Call`), and the
``args[0]['w']``-style names its messages and plans give the arguments' leaves.

Example::

    >>> call = jitted._prepare((params, batch), {})
    >>> call.names[:2], call.leaves_of([0])[:2]
    (["args[0]['w1']", "args[0]['w2']"], [0, 1])
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import tree
from vsf.config import PlanOptions
from vsf.jit.plan import Placements
from vsf.sharding.mesh import Mesh

__all__ = ["Call", "all_names", "arg_name", "leaf_names", "param_names"]


@dataclasses.dataclass
class Call:
    """One call's arguments, prepared: every tensor leaf a DTensor on ``mesh``."""

    mesh: Mesh
    key: tuple[Any, ...]
    inputs: list[DTensor]
    dyn: tuple[tuple[Any, ...], dict[str, Any]]
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]]
    positions: list[int]  # each dynamic positional argument's position in the call
    leaves: list[Any]  # the leaves as passed (autograd's graph attaches to these)

    @property
    def grad(self) -> tuple[Any, ...] | None:
        """:func:`vsf.jit.differentiable.grad_mask` of the call's leaves."""
        return self.key[4]

    @property
    def options(self) -> PlanOptions:
        """The switches the call plans with (:func:`vsf.config.plan_options`, read as it was prepared)."""
        return self.key[5]

    def leaves_of(self, argnums: Sequence[int]) -> list[int]:
        """Positions, among the call's leaves, of the leaves of positional arguments ``argnums``."""
        out, offset = [], 0
        for pos, a in zip(self.positions, self.dyn[0]):
            n = len(tree.leaves(a))
            if pos in argnums:
                out.extend(range(offset, offset + n))
            offset += n
        return out

    @property
    def names(self) -> list[str]:
        """``args[0]['w']``-style names of the tensor leaves (computed only when needed)."""
        return all_names(self.dyn)

    @property
    def arg_trees(self) -> list[tuple[tree.PyTreeSpec, list[tuple[tuple[int, ...], torch.dtype, Placements]]]]:
        """Each positional argument's structure and its leaves' (shape, dtype, placements)."""
        out, offset = [], 0
        for a in self.dyn[0]:
            n = len(tree.leaves(a))
            out.append((tree.structure(a), [k[:3] for k in self.key[1][offset : offset + n]]))
            offset += n
        return out


def param_names(fun: Callable[..., Any]) -> list[str]:
    """``fun``'s parameter names, in order (none where Python cannot read its signature)."""
    try:
        return list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        return []


def leaf_names(dyn: Any) -> Callable[[int], str]:
    """``name(i)``: the ``args[0]['w']``-style name of leaf ``i`` of ``dyn``; the names are
    computed once, on the first call (only messages need them)."""
    names = functools.cache(lambda: all_names(dyn))
    return lambda i: names()[i]


def all_names(dyn: Any) -> list[str]:
    """The ``args[0]['w']``-style names of every leaf of ``dyn``."""
    return [arg_name(p) for p, _ in tree.leaves_with_path(dyn)]


def arg_name(path: Any) -> str:
    """``args[0]['w']``-style name of an argument leaf (path into ``(args, kwargs)``)."""
    entries = list(path)
    head = "args" if entries and entries[0].entry == 0 else "kwargs"
    return head + tree.keystr(tuple(entries[1:]), brackets=True)
