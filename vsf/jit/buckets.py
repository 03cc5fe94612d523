"""Collective bucketing and scheduling: independent all-reduces over one mesh axis run as one
collective on a flat buffer (DDP's gradient buckets, found in the graph instead of at hook time),
placed in an execution order after all their values exist and before any use.

Example::

    >>> buckets, order = form_buckets(mesh, gm, moves, users)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate

from vsf.jit.cost import local_shape
from vsf.jit.graph import meta_of
from vsf.jit.plan import Bucket, Collective, Placements, Redistribution, is_shard
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import RaggedPlacement

__all__ = ["BUCKET_BYTES", "form_buckets"]


BUCKET_BYTES = 32 * 2**20  # a flat buffer per bucket: bigger buckets trade memory for fewer collectives


def form_buckets(mesh: Mesh, gm: torch.fx.GraphModule, moves: Sequence[Redistribution], users: dict[int, list[torch.fx.Node]]) -> tuple[tuple[Bucket, ...], tuple[Any, ...]]:
    """Group single-axis all-reduces (same axis and dtype; sums or averages of evenly sharded
    values) that do not depend on each other, so each group runs as one collective; and an
    execution order that runs each group after all its values exist and before any use."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    anc: dict[torch.fx.Node, int] = {}
    for n in nodes:
        mask = 0
        for p in n.all_input_nodes:
            mask |= anc[p] | (1 << index[p])
        anc[n] = mask
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[Redistribution]] = {}
    for r in moves:
        dims = tuple(k for k, (a, b) in enumerate(zip(r.src, r.dst)) if a != b)
        if (
            dims
            and all(type(r.src[k]) is Partial for k in dims)  # subclasses (a norm's partial) reduce differently
            and all(r.src[k].reduce_op in ("sum", "avg") and isinstance(r.dst[k], Replicate) for k in dims)
            and _even(mesh, meta_of(r.value), r.src)
        ):
            groups.setdefault((dims, meta_of(r.value).dtype), []).append(r)
    formed: list[tuple[tuple[int, ...], list[Redistribution]]] = []
    for (k, _dtype), rs in groups.items():
        rs.sort(key=lambda r: index[r.value[0]])
        current: list[Redistribution] = []
        consumers = producers = size = 0
        for r in rs:
            p = r.value[0]
            mine = sum(1 << index[u] for u in users[id(r)])
            fits = not (anc[p] & consumers) and not (producers & mine) and size < BUCKET_BYTES
            if current and not fits:
                formed.append((k, current))
                current, consumers, producers, size = [], 0, 0, 0
            current.append(r)
            consumers |= mine
            producers |= anc[p] | (1 << index[p])
            size += sum(c.bytes for c in r.collectives)
        formed.append((k, current))
    formed = [(k, rs) for k, rs in formed if len(rs) > 1]
    while True:
        order = _schedule(nodes, index, formed, users)
        if order is not None:
            break
        formed.pop()  # two groups wait on each other: give up the last one
    first_use = {id(item): i for i, item in enumerate(order)}
    buckets = []
    for k, rs in formed:
        before = min((u for r in rs for u in users[id(r)]), key=lambda u: first_use[id(u)])
        buckets.append(_bucket(mesh, rs, k, before))
    marker = {id(rs): b for (_, rs), b in zip(formed, buckets)}
    return tuple(buckets), tuple(marker.get(id(item), item) for item in order)


def _schedule(nodes: list[torch.fx.Node], index: dict[torch.fx.Node, int], formed: list[tuple[tuple[int, ...], list[Redistribution]]], users: dict[int, list[torch.fx.Node]]) -> list[Any] | None:
    """A topological order of the graph plus one step per group (``None`` if groups form a cycle),
    keeping the original order wherever the groups allow."""
    deps: dict[int, set[int]] = {id(n): {id(p) for p in n.all_input_nodes} for n in nodes}
    items: dict[int, Any] = {id(n): n for n in nodes}
    rank: dict[int, float] = {id(n): index[n] for n in nodes}
    for _, rs in formed:
        items[id(rs)] = rs
        deps[id(rs)] = {id(r.value[0]) for r in rs}
        rank[id(rs)] = max(index[r.value[0]] for r in rs) + 0.5
        for r in rs:
            for u in users[id(r)]:
                deps[id(u)].add(id(rs))
    waiting = {k: len(v) for k, v in deps.items()}
    after: dict[int, list[int]] = {}
    for k, v in deps.items():
        for d in v:
            after.setdefault(d, []).append(k)
    ready = [(rank[k], k) for k, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(items[k])
        for nxt in after.get(k, ()):
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(ready, (rank[nxt], nxt))
    return order if len(order) == len(items) else None


def _even(mesh: Mesh, t: torch.Tensor, placements: Placements) -> bool:
    return all(not is_shard(p) or (not isinstance(p, RaggedPlacement) and t.shape[p.dim] % mesh.axis_size(a) == 0) for a, p in zip(mesh.device_axes, placements))


def _bucket(mesh: Mesh, members: list[Redistribution], mesh_dims: tuple[int, ...], before: torch.fx.Node) -> Bucket:
    numel = sum(math.prod(local_shape(mesh, meta_of(r.value), r.src)) for r in members)
    dtype = meta_of(members[0].value).dtype
    collectives = tuple(
        Collective("all_reduce", axis, (numel,), dtype, sum(c.bytes for r in members for c in r.collectives if c.axis == axis))
        for axis in (mesh.device_axes[k] for k in mesh_dims)
    )
    return Bucket(tuple(members), mesh_dims, before, collectives)
