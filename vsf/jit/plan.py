"""The plan ``jit`` makes and runs: a placement for every value, every redistribution between
them, the buckets and the order the program runs in; and the vocabulary of placements the
stages share, re-exported from :mod:`vsf.sharding.placement` (is a placement a shard, which dim
it splits, how the per-axis solver sees it).

Example::

    >>> plan = vsf.jit(f).lower(x).plan
    >>> [c.kind for c in plan.collectives()]
    ['all_reduce']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Replicate

from vsf.config import PlanOptions
from vsf.jit.classify import OpClass
from vsf.jit.graph import Value, placeholders_of
from vsf.ops.recording import CollectiveKind
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.placement import (
    as_contiguous,
    balanced_of,
    has_balanced,
    has_ragged,
    is_shard,
    kind_of,
    one_d,
    split_dim,
)

__all__ = [
    "Bucket",
    "Collective",
    "NodePlan",
    "PARTIAL",
    "Placements",
    "Plan",
    "R",
    "Redistribution",
    "as_contiguous",
    "balanced_of",
    "has_balanced",
    "has_ragged",
    "is_shard",
    "one_d",
    "split_dim",
    "splits_evenly",
    "to_placements",
]


Placements = tuple[Placement, ...]


R, PARTIAL = Replicate(), Partial()


MoveKind = (
    CollectiveKind | Literal["slice", "partition"]
)  # a collective, or a local step of a redistribution (a shard or a partial share kept)
BucketKind = Literal["all_reduce", "all_gather", "reduce_scatter"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the program runs: its kind, mesh axis, the local shape it reduces or gathers
    into (per rank), and the bytes each rank sends (the average rank's where ranks send what the
    step computes: a counted exchange's routing, whose ``most`` one rank may send is given where
    it is more)."""

    kind: MoveKind
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    most: int | None = None


@dataclasses.dataclass(frozen=True)
class Redistribution:
    """Moving ``value`` from placements ``src`` to ``dst`` (before ``before`` uses it), for the ops
    ``users`` (``before`` first, in graph order). A value has one redistribution per placement,
    or, where the plan reshards a gathered input between distant uses (FSDP's reshard after
    forward), one per group of users."""

    value: Value
    src: Placements
    dst: Placements
    collectives: tuple[Collective, ...]
    before: torch.fx.Node
    users: tuple[torch.fx.Node, ...] = ()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Collectives of one ``kind`` (``all_reduce``, ``all_gather``, ``reduce_scatter``) over the
    same mesh dims that run as one collective on a flat buffer, before ``before`` (DDP's gradient
    buckets, FSDP's per-layer gathers and reduce-scatters, found in the graph instead of at hook
    time); a reduce-scatter's scattered buffer then all-reduced over its further mesh dims (HSDP's
    gradients: reduce-scattered over fsdp, all-reduced over dp). Partial averages join partial
    sums: their local values are divided by the axis size first."""

    kind: BucketKind
    members: tuple[Redistribution, ...]
    # the mesh dims it communicates over, one collective each: one dim for a gather; a reduce-scatter's
    # scattering dim first, then those it all-reduces the scattered buffer over
    mesh_dims: tuple[int, ...]
    before: torch.fx.Node
    collectives: tuple[Collective, ...]


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """How one op runs: the placements of its tensor inputs and outputs (``None``: no tensor).

    ``direct``: the op runs as is on the local shards (its strategy is one DTensor's per-mesh-dim
    rules allow); otherwise it runs through DTensor's dispatcher (view ops whose shape arguments
    must become local, random ops). ``fallback``: no strategy exists; it runs replicated.
    ``op``: what kind of op it is (:func:`vsf.jit.classify.classify`). ``collectives``: those the
    op runs itself (a manual region's body).
    """

    ins: tuple[Placements, ...]
    outs: tuple[Placements | None, ...]
    op: OpClass
    fallback: bool = False
    direct: bool = False
    collectives: tuple[Collective, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement for every value of ``graph`` over ``mesh`` and every redistribution between."""

    mesh: Mesh
    graph: torch.fx.GraphModule
    nodes: dict[torch.fx.Node, NodePlan]
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    redistributions: tuple[Redistribution, ...]
    buckets: tuple[Bucket, ...]
    order: tuple[Any, ...]  # graph nodes and buckets, in the order the program runs them
    options: PlanOptions  # the switches it was planned with (vsf.config.plan_options)
    reduce_dtype: torch.dtype | None = (
        None  # floating values are reduced in this dtype (FSDP2's reduce_dtype); None: in their own
    )
    notes: tuple[str, ...] = ()  # what the planner chose and why (memory_budget's decisions), for the plan text
    donated: frozenset[int] = frozenset()  # the inputs (by position) the caller donated: outputs may take their buffers

    def collectives(self) -> list[Collective]:
        """Every collective the program runs (a bucket counts once; a manual region's own too),
        in the dtype it runs in (:meth:`wire`)."""
        bucketed = {id(r) for b in self.buckets for r in b.members}
        out = [c for r in self.redistributions if id(r) not in bucketed for c in self.wire(r)]
        inside = [
            c
            for node in self.order
            if isinstance(node, torch.fx.Node) and node in self.nodes
            for c in self.nodes[node].collectives
        ]
        return out + [c for b in self.buckets for c in self.wire(b)] + inside

    def reduced_in(self, r: Redistribution | Bucket) -> torch.dtype | None:
        """The dtype ``r`` runs in where :attr:`reduce_dtype` changes it: a move that reduces a
        floating value of another dtype (its value is cast for the move, and back after it)."""
        dtype = r.collectives[0].dtype if r.collectives else None
        reduces = any(c.kind in ("all_reduce", "reduce_scatter") for c in r.collectives)
        if (
            self.reduce_dtype is None
            or not reduces
            or dtype is None
            or not dtype.is_floating_point
            or dtype == self.reduce_dtype
        ):
            return None
        return self.reduce_dtype

    def wire(self, r: Redistribution | Bucket) -> tuple[Collective, ...]:
        """``r``'s collectives as they run: in :meth:`reduced_in`'s dtype where it applies, with its bytes."""
        dtype = self.reduced_in(r)
        if dtype is None:
            return r.collectives
        scale = lambda c: c.bytes * dtype.itemsize // c.dtype.itemsize  # noqa: E731
        return tuple(dataclasses.replace(c, dtype=dtype, bytes=scale(c)) for c in r.collectives)

    def serving(self, user: torch.fx.Node, value: Value, dst: Placements) -> Redistribution:
        """The redistribution that gives ``user`` its input ``value`` laid out as ``dst``."""
        return self._served[(user, value, dst)]

    @functools.cached_property
    def _served(self) -> dict[tuple[torch.fx.Node, Value, Placements], Redistribution]:
        return {(u, r.value, r.dst): r for r in self.redistributions for u in r.users}

    def placement(self, value: Value) -> Placements:
        node, i = value
        if node.op == "placeholder":
            return self.inputs[placeholders_of(self.graph).index(node)]
        out = self.nodes[node].outs[i]
        assert out is not None
        return out


def to_placements(s: NamedSharding) -> Placements:
    """``s``'s DTensor placements, one per mesh dim."""
    return tuple(s.placements)


def splits_evenly(mesh: Mesh, t: torch.Tensor, placements: Placements) -> bool:
    """Is every dim of ``t`` split into equal shards by all the mesh dims that split it together
    (a balanced split: into twice as many equal chunks)?

    Example::

        >>> splits_evenly(mesh, torch.empty(10, 4), (Shard(0),))   # mesh of 4 ranks: 3, 3, 3, 1
        False
    """
    ways = [1] * t.ndim
    for axis, p in zip(mesh.device_axes, placements):
        if is_shard(p):
            ways[split_dim(p)] *= mesh.axis_size(axis) * (2 if kind_of(p) == "balanced" else 1)
    return all(size % n == 0 for size, n in zip(t.shape, ways))
