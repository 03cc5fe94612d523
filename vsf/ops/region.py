"""The ops a ``shard_map`` region leaves in a traced graph, and what they stand for.

Inside :func:`vsf.jit`, a call of :func:`vsf.shard_map` is traced *into* the step's graph: its
body's ops become ops of the graph, on values whose shapes are the body's (local over the
region's manual axes, global over the others). Four boundary ops mark where values cross:

* ``vsf::manual_in(x, key, i)``: argument ``i`` (global shape) -> the body's view of it (each rank
  its block over the manual axes, laid out as ``in_specs`` says);
* ``vsf::manual_out(y, key, i)``: result ``i`` of the body -> the global value ``out_specs`` says
  it is a block of;
* ``vsf::manual_in_grad`` and ``vsf::manual_out_grad``: their transposes, which the backward of a
  step that differentiates through the region runs.

The named-axis collectives the body runs are ``vsf::manual_collective(x, op)`` nodes, a ragged
exchange whose row counts are values of the body (an expert-parallel dispatch) is
``vsf::manual_exchange(x, counts, op)``, and ``axis_index`` is ``vsf::manual_axis_index(op)``; ``key`` and ``op`` name a :class:`Region` or a
:class:`Call` registered here. Their autograd (each collective's transpose, :mod:`vsf.ops.collectives`)
is recorded while the step is traced, so the backward is ops of the same graph.

The planner (:mod:`vsf.jit.manual`) pins every value of the body to "as it is on this rank"
(``Replicate`` placements that mean local) over the manual axes, and plans the body over the
other (automatic) axes like any other ops of the step.

**Replicated values** (vsf's rule, the eager ``shard_map``'s; JAX's gradients without
``check_vma``): over a manual axis an input's spec leaves out, every rank gets the whole value, and
its gradient is the sum over those ranks (each rank's gradient is a partial sum); over a manual
axis an output's spec leaves out, the body must give every rank the same value (with
``check_vma``, the planner refuses one that the body's dataflow lets vary there), and the
cotangent that comes in is split evenly among those ranks, so a ``psum`` whose backward sums the
ranks' cotangents gives it back once.

Example::

    >>> region = lookup(node.args[1])     # a manual_in node's region
    >>> region.ins[0].spec, region.manual
    (P('dp', None), ('dp', 'tp'))
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate

from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding

__all__ = [
    "AXIS_INDEX_OP",
    "BOUNDARY_OPS",
    "COLLECTIVE_OP",
    "COLLECTIVE_OPS",
    "EXCHANGE_OP",
    "REGION_OPS",
    "Call",
    "Region",
    "axis_index",
    "boundary",
    "call",
    "collective",
    "copies",
    "exchange",
    "lookup",
    "register",
    "summed_over",
]


@dataclasses.dataclass(eq=False)
class Region:
    """One manual region of a traced step: its name, mesh, manual axes and the shardings of its
    tensor arguments (``ins``) and results (``outs``, known once the body has returned, with
    ``out_names``, their key paths); ``check_vma``: refuse a result that varies over a manual
    axis its spec replicates it over (:func:`vsf.jit.manual.mark`); ``any_order``: the body does
    not depend on which rank holds which block of a dim split over several axes, so the planner may
    take such an entry's axes in another order, the same for every spec (:func:`vsf.jit.manual.orders`)."""

    name: str
    mesh: Mesh
    manual: tuple[str, ...]
    ins: tuple[NamedSharding, ...]
    check_vma: bool = True
    outs: tuple[NamedSharding, ...] = ()
    out_names: tuple[str, ...] = ()
    any_order: bool = False

    def sharding(self, kind: str, i: int) -> NamedSharding:
        """The sharding of the value boundary op ``kind`` moves (argument ``i`` or result ``i``)."""
        return self.ins[i] if kind.startswith("manual_in") else self.outs[i]


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """What a ``manual_collective`` or ``manual_axis_index`` node runs: ``op`` (a
    :class:`vsf.ops.Linear`, a max, or the axis whose index it is) inside region ``region``."""

    op: Any
    region: int


def copies(s: NamedSharding, manual: Sequence[str]) -> int:
    """Over how many ranks of the ``manual`` axes a value laid out as ``s`` is replicated: the
    ranks that share a result's cotangent (see the module docs).

    Example::

        >>> copies(NamedSharding(mesh, P("dp")), ("dp", "tp"))    # dp=2, tp=4
        4
    """
    return math.prod(s.mesh.axis_size(a) for a in manual if a not in s.spec.axes)


def summed_over(s: NamedSharding, manual: Sequence[str]) -> tuple[Placement, ...]:
    """The placements of the gradient of an input laid out as ``s``: a partial sum over the manual
    axes ``s`` replicates it over (each rank's body gave its own part), as ``s`` elsewhere.

    Example::

        >>> summed_over(NamedSharding(mesh, P("dp")), ("dp", "tp"))   # mesh ("dp", "tp")
        (Shard(dim=0), Partial(sum))
    """
    m = s.mesh
    return tuple(
        Partial() if isinstance(p, Replicate) and a in manual and m.axis_size(a) > 1 else p
        for p, a in zip(s.placements, m.device_axes)
    )


_REGISTRY: dict[int, Any] = {}
_KEYS = itertools.count()


def register(entry: Region | Call) -> int:
    """Keep a region (or a collective call) for the graph that will name it; its key.

    Example::

        >>> key = register(region); lookup(key) is region
        True
    """
    key = next(_KEYS)
    _REGISTRY[key] = entry
    return key


def lookup(key: int) -> Any:
    """The :class:`Region` or :class:`Call` a node names by ``key``.

    Example::

        >>> lookup(node.args[1]).name
        'mlp'
    """
    return _REGISTRY[key]


def _shape(kind: str, region: Region, i: int, shape: Sequence[int]) -> list[int]:
    """The shape boundary op ``kind`` gives a value of ``shape``: into the body, each dim divided by
    its manual split; out of it, multiplied."""
    s = region.sharding(kind, i)
    into = kind in ("manual_in", "manual_out_grad")
    return [n // s.num_shards(d) if into else n * s.num_shards(d) for d, n in enumerate(shape)]


def _define_boundary(kind: str) -> Any:
    @torch.library.custom_op(f"vsf::{kind}", mutates_args=())
    def op(x: torch.Tensor, key: int, i: int) -> torch.Tensor:
        raise RuntimeError(
            f"{kind} of shard_map region {lookup(key).name} runs only inside the program vsf.jit lowers it into"
        )

    @op.register_fake
    def _(x: torch.Tensor, key: int, i: int) -> torch.Tensor:
        return x.new_empty(_shape(kind, lookup(key), i, x.shape))

    return getattr(torch.ops.vsf, kind).default


BOUNDARY_OPS = {
    kind: _define_boundary(kind) for kind in ("manual_in", "manual_in_grad", "manual_out", "manual_out_grad")
}


@torch.library.custom_op("vsf::manual_collective", mutates_args=())
def _manual_collective(x: torch.Tensor, key: int) -> torch.Tensor:
    raise RuntimeError("a shard_map region's collective runs only inside the program vsf.jit lowers it into")


@_manual_collective.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return lookup(key).op.abstract(x)[0]


@torch.library.custom_op("vsf::manual_exchange", mutates_args=())
def _manual_exchange(x: torch.Tensor, counts: torch.Tensor, key: int) -> torch.Tensor:
    raise RuntimeError("a shard_map region's exchange runs only inside the program vsf.jit lowers it into")


@_manual_exchange.register_fake
def _(x: torch.Tensor, counts: torch.Tensor, key: int) -> torch.Tensor:
    return lookup(key).op.abstract(x)[0]


@torch.library.custom_op("vsf::manual_axis_index", mutates_args=())
def _manual_axis_index(key: int) -> torch.Tensor:
    raise RuntimeError("a shard_map region's axis_index runs only inside the program vsf.jit lowers it into")


@_manual_axis_index.register_fake
def _(key: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


COLLECTIVE_OP = torch.ops.vsf.manual_collective.default
EXCHANGE_OP = torch.ops.vsf.manual_exchange.default
COLLECTIVE_OPS = frozenset(
    {COLLECTIVE_OP, EXCHANGE_OP}
)  # the region ops that communicate (their operand first, their Call last)
AXIS_INDEX_OP = torch.ops.vsf.manual_axis_index.default
REGION_OPS = frozenset({*BOUNDARY_OPS.values(), *COLLECTIVE_OPS, AXIS_INDEX_OP})  # every op a traced region leaves


class _Boundary(torch.autograd.Function):
    """A boundary op whose backward is its transpose (``manual_in`` <-> ``manual_in_grad``,
    ``manual_out`` <-> ``manual_out_grad``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: int, i: int, kind: str) -> torch.Tensor:
        ctx.args = (key, i, kind)
        return BOUNDARY_OPS[kind](x, key, i)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        key, i, kind = ctx.args
        return BOUNDARY_OPS[kind + "_grad"](g.contiguous(), key, i), None, None, None


def boundary(x: torch.Tensor, key: int, i: int, kind: str) -> torch.Tensor:
    """``x`` crossing into (``kind="manual_in"``) or out of (``"manual_out"``) region ``key`` as its
    argument or result ``i``, differentiable.

    Example::

        >>> inner = boundary(x, key, 0, "manual_in")
    """
    return _Boundary.apply(x, key, i, kind)


def collective(x: torch.Tensor, c: Call) -> torch.Tensor:
    """The node of a traced region that runs ``c.op`` on ``x`` (autograd is the caller's).

    Example::

        >>> y = collective(x, Call(psum_over_tp, key))
    """
    return COLLECTIVE_OP(x, register(c))


def exchange(x: torch.Tensor, counts: torch.Tensor, c: Call) -> torch.Tensor:
    """The node of a traced region that runs ``c.op`` on ``x`` with the row counts ``counts`` (a
    value of the body, known only when the step runs; autograd is the caller's).

    Example::

        >>> y = exchange(rows, counts, Call(dispatch_over_ep, key))
    """
    return EXCHANGE_OP(x, counts, register(c))


def axis_index(c: Call) -> torch.Tensor:
    """The node of a traced region that gives this rank's index along the axis ``c.op`` names.

    Example::

        >>> i = axis_index(Call(group_of_tp, key))
    """
    return AXIS_INDEX_OP(register(c))


def call(key: int) -> Call:
    """The :class:`Call` a ``manual_collective`` or ``manual_axis_index`` node runs.

    Example::

        >>> call(node.args[-1]).op
        _Psum(g=...)
    """
    c = lookup(key)
    assert isinstance(c, Call)
    return c
