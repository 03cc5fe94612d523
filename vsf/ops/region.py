"""The ops a ``shard_map`` region leaves in a traced graph, and what they stand for.

Inside :func:`vsf.jit`, a call of :func:`vsf.shard_map` becomes one node of the step's graph,
``vsf::manual_region(xs, key)``: it takes the region's tensor arguments in their *global* shapes
and returns its results in theirs, and ``key`` names the :class:`Region` (its body, mesh, specs and
the collectives its body runs, found by running the body once on fake local shards). Its backward
(when the step differentiates through the region) is ``vsf::manual_region_vjp(xs, cts, key)``:
the body's own backward on local shards, every collective transposed by :mod:`vsf.ops`, through
the autograd graph the forward node kept (:meth:`Region.run_for_vjp`); a backward node without
its forward node in the program runs the body again first (its forward collectives too).

The planner pins a region's inputs to its ``in_specs`` and its results to its ``out_specs`` and
leaves the body alone; the lowering runs the body on each rank's local shards.

**Replicated values** (vsf's rule, the eager ``shard_map``'s, JAX's ``check_vma=False``): over a
manual axis an input's spec leaves out, every rank gets the whole value, and its gradient is the
sum over those ranks (each rank's gradient is a partial sum); over a manual axis an output's spec
leaves out, the body must give every rank the same value (vsf does not check it), and the
cotangent that comes in is split evenly among those ranks, so a ``psum`` whose backward sums the
ranks' cotangents gives it back once.

**Automatic axes** (``axis_names``, JAX's partial-manual): the specs name only manual axes; over
the others the body sees whole values and, for now, every rank there runs the same body on them
(replicated; planning the body over those axes is not done yet), so their gradients are whole too.

Example::

    >>> region = lookup(node.args[-1])     # a manual_region node's key
    >>> region.ins[0].spec, [c.kind for c in region.sent]
    (P('dp', None), ['all_reduce'])
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate

from vsf.ops.recording import Sent, manual_axes
from vsf.sharding.mesh import Mesh, use_mesh
from vsf.sharding.named import NamedSharding

__all__ = ["REGION_OP", "REGION_VJP_OP", "Region", "copies", "lookup", "register", "summed_over"]

Aval = tuple[tuple[int, ...], torch.dtype]


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """One manual region of a traced step.

    ``body`` maps the flat local tensor arguments to the flat local tensor results; ``manual``
    names the mesh axes it is manual over; ``ins`` and ``outs`` are their shardings over ``mesh``;
    ``out_avals`` the results' global shapes and dtypes; ``sent`` and ``sent_vjp`` the collectives the body runs per rank, forward and backward;
    ``kept`` the forward's autograd graph between the two nodes of one run.
    """

    name: str
    body: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    mesh: Mesh
    manual: tuple[str, ...]
    ins: tuple[NamedSharding, ...]
    outs: tuple[NamedSharding, ...]
    out_avals: tuple[Aval, ...]
    sent: tuple[Sent, ...] = ()
    sent_vjp: tuple[Sent, ...] = ()
    kept: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def run(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The body on this rank's local shards (every simulated rank's, under ``vsf.simulate``)."""
        with use_mesh(self.mesh), manual_axes(self.name, self.manual):
            return list(self.body(list(xs)))

    def run_for_vjp(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`run` with autograd, its graph kept for :meth:`vjp` (this call's backward node);
        the results come back detached."""
        with torch.enable_grad():
            watched = _watched(xs)
            outs = self.run(watched)
        self.kept["graph"] = (watched, outs)
        return [y.detach() for y in outs]

    def vjp(self, xs: Sequence[torch.Tensor], cts: Sequence[torch.Tensor], wanted: Container[int] | None = None) -> list[torch.Tensor]:
        """The gradients of the local inputs, given the local cotangents of the results: the body's
        backward, its collectives transposed (see the module docs for replicated values), through
        the graph :meth:`run_for_vjp` kept, or the body run again (rematerialized) if none was.
        Only the inputs in ``wanted`` (positions; default all) get theirs computed, the others zeros."""
        with torch.enable_grad():
            kept = self.kept.pop("graph", None)
            watched, outs = kept if kept is not None else (_watched(xs), None)
            outs = outs if outs is not None else self.run(watched)
            pairs = [(y, ct / self.copies(i)) for i, (y, ct) in enumerate(zip(outs, cts)) if y.requires_grad]
            asked = [i for i, x in enumerate(watched) if _differentiable(x) and (wanted is None or i in wanted)]
            wrt = [watched[i] for i in asked]
            found = torch.autograd.grad([y for y, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True) if pairs and wrt else [None] * len(wrt)
        grads = dict(zip(asked, found))
        return [_zero_if_none(grads.get(i), x) for i, x in enumerate(watched)]

    def copies(self, i: int) -> int:
        """Over how many ranks result ``i`` is replicated (the manual axes its spec leaves out)."""
        return copies(self.outs[i], self.manual)


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
    axes ``s`` replicates it over (each rank's body gave its own part), as ``s`` elsewhere (the
    automatic axes: every rank there computed the same gradient).

    Example::

        >>> summed_over(NamedSharding(mesh, P("dp")), ("dp", "tp"))   # mesh ("dp", "tp")
        (Shard(dim=0), Partial(sum))
    """
    m = s.mesh
    return tuple(
        Partial() if isinstance(p, Replicate) and a in manual and m.axis_size(a) > 1 else p
        for p, a in zip(s.placements, m.device_axes)
    )


def _watched(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x.detach().requires_grad_(True) if _differentiable(x) else x for x in xs]


def _differentiable(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _zero_if_none(g: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if g is None else g


_REGIONS: dict[int, Region] = {}
_KEYS = itertools.count()


def register(region: Region) -> int:
    """Keep ``region`` for the graph that will name it; its key.

    Example::

        >>> key = register(region); lookup(key) is region
        True
    """
    key = next(_KEYS)
    _REGIONS[key] = region
    return key


def lookup(key: int) -> Region:
    """The region a ``manual_region`` node names (its last argument is the key).

    Example::

        >>> lookup(node.args[-1]).name
        'mlp'
    """
    return _REGIONS[key]


@torch.library.custom_op("vsf::manual_region", mutates_args=())
def _manual_region(xs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    raise RuntimeError(f"shard_map region {lookup(key).name} runs only inside the program vsf.jit lowers it into")


@_manual_region.register_fake
def _(xs: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    device = xs[0].device if xs else torch.device("cpu")
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in lookup(key).out_avals]


@torch.library.custom_op("vsf::manual_region_vjp", mutates_args=())
def _manual_region_vjp(xs: list[torch.Tensor], cts: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    raise RuntimeError(f"the backward of shard_map region {lookup(key).name} runs only inside the program vsf.jit lowers it into")


@_manual_region_vjp.register_fake
def _(xs: list[torch.Tensor], cts: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


REGION_OP = torch.ops.vsf.manual_region.default
REGION_VJP_OP = torch.ops.vsf.manual_region_vjp.default


def _save(ctx: object, inputs: tuple[list[torch.Tensor], int], output: list[torch.Tensor]) -> None:
    ctx.save_for_backward(*inputs[0])
    ctx.key = inputs[1]
    ctx.avals = [(tuple(y.shape), y.dtype) for y in output]


def _backward(ctx: object, cts: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], None]:
    xs = list(ctx.saved_tensors)
    device = xs[0].device if xs else torch.device("cpu")
    full = [ct if ct is not None else torch.zeros(shape, dtype=dtype, device=device) for ct, (shape, dtype) in zip(cts, ctx.avals)]
    grads = REGION_VJP_OP(xs, full, ctx.key)
    return [g if _differentiable(x) else None for g, x in zip(grads, xs)], None


_manual_region.register_autograd(_backward, setup_context=_save)
