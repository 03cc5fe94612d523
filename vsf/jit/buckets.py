"""Collective bucketing and scheduling: independent collectives of one kind over one mesh axis
run as one collective on a flat buffer, found in the graph instead of at hook time: gradient
all-reduces (DDP's buckets), parameter all-gathers and gradient reduce-scatters (FSDP's
per-layer groups). Each bucket is placed in the execution order after all its values exist
and before any use: reductions as soon as their values exist, gathers just before their first use.

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
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf.jit.cost import local_shape
from vsf.jit.graph import meta_of
from vsf.jit.plan import Bucket, Collective, Placements, Redistribution, is_shard
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import BalancedPlacement, RaggedPlacement

__all__ = ["BUCKET_BYTES", "SHARDING_BUCKET_BYTES", "form_buckets"]


BUCKET_BYTES = 32 * 2**20  # an all-reduce bucket's flat buffer: bigger buckets trade memory for fewer collectives
# An all-gather bucket's gathered buffer, a reduce-scatter bucket's unreduced one: full-size copies
# that live together (a gather's later members are gathered early, a reduction's earlier members
# are freed late), so about one layer's params (FSDP's per-layer groups)
SHARDING_BUCKET_BYTES = 4 * 2**20


def form_buckets(mesh: Mesh, gm: torch.fx.GraphModule, moves: Sequence[Redistribution], users: dict[int, list[torch.fx.Node]]) -> tuple[tuple[Bucket, ...], tuple[Any, ...]]:
    """Group single-axis collectives of one kind (same axis and dtype, evenly sharded values;
    see :func:`bucket_kind`) that do not depend on each other, so each group runs as one
    collective; and an execution order that runs each group after all its values exist and
    before any use. Reductions group in the order their values are produced, gathers in the
    order they are first used."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    anc: dict[torch.fx.Node, int] = {}
    for n in nodes:
        mask = 0
        for p in n.all_input_nodes:
            mask |= anc[p] | (1 << index[p])
        anc[n] = mask
    first_use = {id(r): min(index[u] for u in users[id(r)]) for r in moves if users[id(r)]}
    groups: dict[tuple[str, tuple[int, ...], torch.dtype], list[Redistribution]] = {}
    for r in moves:
        kind = bucket_kind(mesh, r)
        if kind is not None and id(r) in first_use:
            groups.setdefault((*kind, meta_of(r.value).dtype), []).append(r)
    formed: list[tuple[str, tuple[int, ...], list[Redistribution]]] = []
    for (kind, k, _dtype), rs in groups.items():
        gather = kind == "all_gather"
        rs.sort(key=lambda r: first_use[id(r)] if gather else index[r.value[0]])
        cap = BUCKET_BYTES if kind == "all_reduce" else SHARDING_BUCKET_BYTES
        current: list[Redistribution] = []
        consumers = producers = size = 0
        for r in rs:
            p = r.value[0]
            mine = sum(1 << index[u] for u in users[id(r)])
            fits = not (anc[p] & consumers) and not (producers & mine) and size < cap
            if current and not fits:
                formed.append((kind, k, current))
                current, consumers, producers, size = [], 0, 0, 0
            current.append(r)
            consumers |= mine
            producers |= anc[p] | (1 << index[p])
            size += _buffer_bytes(mesh, r, kind)
        formed.append((kind, k, current))
    formed = [f for f in formed if len(f[2]) > 1]
    while True:
        order = _schedule(nodes, index, formed, users, first_use)
        if order is not None:
            break
        formed.pop()  # two groups wait on each other: give up the last one
    position = {id(item): i for i, item in enumerate(order)}
    buckets = []
    for kind, k, rs in formed:
        before = min((u for r in rs for u in users[id(r)]), key=lambda u: position[id(u)])
        buckets.append(_bucket(mesh, kind, rs, k, before))
    marker = {id(rs): b for (_, _, rs), b in zip(formed, buckets)}
    return tuple(buckets), tuple(marker.get(id(item), item) for item in order)


def bucket_kind(mesh: Mesh, r: Redistribution) -> tuple[str, tuple[int, ...]] | None:
    """``(kind, mesh dims)`` of a redistribution that can join a bucket, else ``None``: partial
    sums or averages reduced to replicated on some mesh dims (``all_reduce``); on one mesh dim, a
    plain shard gathered (``all_gather``) or a partial sum or average reduced into a plain shard
    (``reduce_scatter``) of a tensor dim no other mesh dim splits. Values must be evenly sharded.
    (Subclasses of ``Partial``, a norm's partial, reduce differently; strided and ragged shards
    are laid out differently.)"""
    dims = tuple(k for k, (a, b) in enumerate(zip(r.src, r.dst)) if a != b)
    t = meta_of(r.value)
    if not dims or not (_even(mesh, t, r.src) and _even(mesh, t, r.dst)):
        return None
    if all(_reduced(r.src[k]) and isinstance(r.dst[k], Replicate) for k in dims):
        return "all_reduce", dims
    if len(dims) > 1:
        return None
    (k,) = dims
    src, dst = r.src[k], r.dst[k]
    if type(src) is Shard and isinstance(dst, Replicate) and _alone(r.src, k):
        return "all_gather", dims
    if _reduced(src) and type(dst) is Shard and _alone(r.dst, k):
        return "reduce_scatter", dims
    return None


def _reduced(p: Any) -> bool:
    return type(p) is Partial and p.reduce_op in ("sum", "avg")


def _alone(placements: Placements, k: int) -> bool:
    """No mesh dim but ``k`` shards the tensor dim that mesh dim ``k`` shards."""
    return not any(j != k and is_shard(p) and p.dim == placements[k].dim for j, p in enumerate(placements))


def _buffer_bytes(mesh: Mesh, r: Redistribution, kind: str) -> int:
    """The bytes this member adds to its bucket's flat buffer (the gathered or the unreduced local value)."""
    t = meta_of(r.value)
    return math.prod(local_shape(mesh, t, r.dst if kind == "all_gather" else r.src)) * t.element_size()


def _schedule(
    nodes: list[torch.fx.Node],
    index: dict[torch.fx.Node, int],
    formed: list[tuple[str, tuple[int, ...], list[Redistribution]]],
    users: dict[int, list[torch.fx.Node]],
    first_use: dict[int, int],
) -> list[Any] | None:
    """A topological order of the graph plus one step per group (``None`` if groups form a cycle),
    keeping the original order wherever the groups allow: a reduction right after its last
    value exists, a gather right before its first use."""
    deps: dict[int, set[int]] = {id(n): {id(p) for p in n.all_input_nodes} for n in nodes}
    items: dict[int, Any] = {id(n): n for n in nodes}
    rank: dict[int, float] = {id(n): index[n] for n in nodes}
    for kind, _, rs in formed:
        items[id(rs)] = rs
        deps[id(rs)] = {id(r.value[0]) for r in rs}
        if kind == "all_gather":
            rank[id(rs)] = min(first_use[id(r)] for r in rs) - 0.5
        else:
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
    return all(
        not is_shard(p) or (not isinstance(p, (RaggedPlacement, BalancedPlacement)) and t.shape[p.dim] % mesh.axis_size(a) == 0)
        for a, p in zip(mesh.device_axes, placements)
    )


def _bucket(mesh: Mesh, kind: str, members: list[Redistribution], mesh_dims: tuple[int, ...], before: torch.fx.Node) -> Bucket:
    dtype = meta_of(members[0].value).dtype
    numel = sum(_buffer_bytes(mesh, r, kind) for r in members) // dtype.itemsize
    collectives = tuple(
        Collective(kind, axis, (numel,), dtype, sum(c.bytes for r in members for c in r.collectives if c.axis == axis))
        for axis in (mesh.device_axes[k] for k in mesh_dims)
    )
    return Bucket(kind, tuple(members), mesh_dims, before, collectives)
