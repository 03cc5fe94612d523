"""Collective bucketing and scheduling: independent collectives of one kind over one mesh axis
run as one collective on a flat buffer, found in the graph instead of at hook time: gradient
all-reduces (DDP's buckets), parameter all-gathers and gradient reduce-scatters (FSDP's
per-layer groups), each bucket at most ``bucket_bytes`` (the plan's ``vsf.config.bucket_bytes``)
and, in a step that recomputes blocks in its backward (:func:`vsf.jit.remat.recompute_blocks`),
within one block's backward: its params gathered again, and its gradients reduce-scattered as
soon as they exist, as FSDP2 runs each checkpointed block, so that no more than about a block's
gathered params and unreduced gradients are alive at once. Each bucket is placed in the
execution order after all its values exist and before any use: reductions (a lone one too) as
soon as their values exist, gathers just before their first use. The ops that use a reduction's
result run after the ops that do not (the optimizer's updates of the first gradient bucket
before those of the second, all after the backward that the later buckets' collectives overlap),
and a reduction of values computed from the inputs alone by ops that produce little (the count of
a mean's tokens) starts first, with its inputs.

Example::

    >>> buckets, order = form_buckets(mesh, gm, moves, users, 4 * 2**20)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import _compat
from vsf.jit.cost import local_shape
from vsf.jit.graph import meta_of
from vsf.jit.plan import Bucket, Collective, Placements, Redistribution, is_shard, splits_evenly
from vsf.jit.remat import recompute_blocks
from vsf.sharding.mesh import Mesh
from vsf.sharding.placement import dtensor_native

__all__ = ["SMALL_BYTES", "bucket_kind", "form_buckets"]


# what the ops computing a reduction's values from the inputs alone may produce in all, for the
# reduction to start first (a token count, a mask's sum), not where they stand in the graph
SMALL_BYTES = 64 * 2**10


def form_buckets(
    mesh: Mesh,
    gm: torch.fx.GraphModule,
    moves: Sequence[Redistribution],
    users: dict[int, list[torch.fx.Node]],
    bucket_bytes: int,
) -> tuple[tuple[Bucket, ...], tuple[Any, ...]]:
    """Group single-axis collectives of one kind (same axis and dtype, evenly sharded values;
    see :func:`bucket_kind`) that do not depend on each other, so each group runs as one
    collective on a flat buffer of at most ``bucket_bytes``; and an execution order
    (graph nodes, buckets, and the lone reductions that start early, as their
    :class:`Redistribution`) that runs each group after all its values exist and before any use.
    Reductions group in the order their values are produced, gathers in the order they are
    first used."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    first_use = {id(r): min(index[u] for u in users[id(r)]) for r in moves if users[id(r)]}
    groups: dict[tuple[str, tuple[int, ...], torch.dtype], list[Redistribution]] = {}
    # bucket_kind by what it reads: the layouts (by object: the moves hold them, and a plan's
    # repeated blocks move their values between a few layout objects) and the value's shape
    kinds: dict[tuple[int, int, torch.Size], tuple[str, tuple[int, ...]] | None] = {}
    for r in moves:
        t = meta_of(r.value)
        read = (id(r.src), id(r.dst), t.shape)
        if read not in kinds:
            kinds[read] = bucket_kind(mesh, r)
        kind = kinds[read]
        if kind is not None and id(r) in first_use:
            groups.setdefault((*kind, t.dtype), []).append(r)
    formed: list[tuple[str, tuple[int, ...], list[Redistribution]]] = []
    block = recompute_blocks(gm)
    for (kind, k, _dtype), rs in groups.items():
        gather = kind == "all_gather"
        at = (lambda r: first_use[id(r)]) if gather else (lambda r: index[r.value[0]])  # noqa: E731
        rs.sort(key=at)
        cap = bucket_bytes
        current: list[Redistribution] = []
        after = _Descendants(index)
        values: set[torch.fx.Node] = set()
        size, last = 0, -1
        for r in rs:
            p = r.value[0]
            same_block = not block or not current or block[nodes[at(r)]] == block[nodes[at(current[0])]]
            fits = not after.holds(p) and not _reaches(index, users[id(r)], values, last) and size < cap and same_block
            if current and not fits:
                formed.append((kind, k, current))
                current, after, values, size, last = [], _Descendants(index), set(), 0, -1
            current.append(r)
            after.add(users[id(r)])
            values.add(p)
            last = max(last, index[p])
            size += _buffer_bytes(mesh, r, kind)
        formed.append((kind, k, current))
    lone = [rs[0] for kind, _, rs in formed if len(rs) == 1 and kind != "all_gather"]
    formed = [f for f in formed if len(f[2]) > 1]
    while True:
        order = _schedule(nodes, index, formed, lone, users, first_use)
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


class _Descendants:
    """The nodes that depend on some node added (not those added themselves, unless they depend
    on another), found lazily in the graph's order: only as far as the latest node asked about,
    so a bucket whose values precede its members' uses (gradients before the optimizer, params
    before the forward) walks nothing."""

    def __init__(self, index: dict[torch.fx.Node, int]) -> None:
        self.index = index
        self.found: set[torch.fx.Node] = set()
        self.frontier: list[tuple[int, torch.fx.Node]] = []  # found, their users not yet found

    def add(self, sources: Sequence[torch.fx.Node]) -> None:
        for n in sources:
            self._reach(n)

    def holds(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` depends on a node added: every found node before it has had its users found."""
        while self.frontier and self.frontier[0][0] < self.index[node]:
            self._reach(heapq.heappop(self.frontier)[1])
        return node in self.found

    def _reach(self, n: torch.fx.Node) -> None:
        for u in n.users:
            if u not in self.found:
                self.found.add(u)
                heapq.heappush(self.frontier, (self.index[u], u))


def _reaches(
    index: dict[torch.fx.Node, int], sources: Sequence[torch.fx.Node], targets: set[torch.fx.Node], last: int
) -> bool:
    """Whether a node of ``targets`` (the last at ``last`` in the graph) is one of ``sources`` or
    depends on one, walking only the nodes up to the last target (none when the sources come
    after the targets, as a value's users do)."""
    if all(index[s] > last for s in sources):
        return False
    seen = {s for s in sources if index[s] <= last}
    stack = list(seen)
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        for u in n.users:
            if u not in seen and index[u] <= last:
                seen.add(u)
                stack.append(u)
    return False


def bucket_kind(mesh: Mesh, r: Redistribution) -> tuple[str, tuple[int, ...]] | None:
    """``(kind, mesh dims)`` of a redistribution that can join a bucket, else ``None``: partial
    sums or averages reduced to replicated on some mesh dims (``all_reduce``); on one mesh dim, a
    plain shard gathered (``all_gather``) or a partial sum or average reduced into a plain shard
    (``reduce_scatter``) of a tensor dim no other mesh dim splits, and then, where it is also
    reduced to replicated on other mesh dims, all-reduced over those (``reduce_scatter``, its
    scattering mesh dim first: a gradient reduce-scattered over fsdp and all-reduced over dp, as
    HSDP reduces it). Values must be evenly sharded. (Subclasses of ``Partial``, a norm's partial,
    reduce differently; strided and ragged shards are laid out differently.)"""
    dims = tuple(k for k, (a, b) in enumerate(zip(r.src, r.dst)) if a != b)
    t = meta_of(r.value)
    if not dims or not (_even(mesh, t, r.src) and _even(mesh, t, r.dst)):
        return None
    summed = [k for k in dims if _reduced(r.src[k]) and isinstance(r.dst[k], Replicate)]
    if len(summed) == len(dims):
        return "all_reduce", dims
    if len(summed) < len(dims) - 1:
        return None
    (k,) = [k for k in dims if k not in summed]
    src, dst = r.src[k], r.dst[k]
    if not summed and type(src) is Shard and isinstance(dst, Replicate) and _alone(r.src, k):
        return "all_gather", dims
    if _reduced(src) and type(dst) is Shard and _alone(r.dst, k):
        return "reduce_scatter", (k, *summed)
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
    lone: list[Redistribution],
    users: dict[int, list[torch.fx.Node]],
    first_use: dict[int, int],
) -> list[Any] | None:
    """A topological order of the graph plus one step per group and per lone reduction (``None``
    if groups form a cycle): a reduction right after its last value exists, a gather right
    before its first use, the rest in the graph's order, except that what uses a reduction's
    result waits for what does not (:func:`_levels`) and a reduction of little values computed
    from the inputs alone starts first, with them (:func:`_light`). The steps are numbered: a
    node by its place in the graph, the groups and then the lone reductions after the nodes, in
    their order (ties between equal ranks are broken by these numbers, alike on every rank)."""
    deps: list[list[int]] = [[index[p] for p in n.all_input_nodes] for n in nodes]
    items: list[Any] = list(nodes)
    rank: list[float] = list(range(len(nodes)))
    reductions = set()
    for kind, rs in [(kind, rs) for kind, _, rs in formed] + [("lone", [r]) for r in lone]:
        key = len(items)
        items.append(rs if kind != "lone" else rs[0])
        deps.append(list({index[r.value[0]] for r in rs}))
        if kind == "all_gather":
            rank.append(min(first_use[id(r)] for r in rs) - 0.5)
        else:
            rank.append(max(index[r.value[0]] for r in rs) + 0.5)
            reductions.add(key)
        for u in {index[u] for r in rs for u in users[id(r)]}:
            deps[u].append(key)
    after: list[list[int]] = [[] for _ in items]
    for k, ds in enumerate(deps):
        for d in ds:
            after[d].append(k)
    first = _light(nodes, deps, reductions)
    for k in first:
        rank[k] -= len(nodes) + 1
    base = _topological(deps, after, list(zip(rank, range(len(items)))))
    if base is None:
        return None
    level = _levels(base, deps, after, reductions)
    key = [(-1 if k in first else level[k], rank[k], k) for k in range(len(items))]
    for k, n in enumerate(nodes):
        if n.op == "placeholder":
            key[k] = (-2, rank[k], k)
    return [items[k] for k in _topological(deps, after, key) or ()]


def _topological(deps: list[list[int]], after: list[list[int]], key: list[Any]) -> list[int] | None:
    """The steps in dependency order, the ready step of least ``key`` (unique) first (``None`` on a cycle)."""
    by_key = sorted(range(len(key)), key=key.__getitem__)
    place = [0] * len(key)  # (the ready steps kept as their places: ints compare fast)
    for i, k in enumerate(by_key):
        place[k] = i
    waiting = [len(v) for v in deps]
    ready = [place[k] for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = by_key[heapq.heappop(ready)]
        order.append(k)
        for nxt in after[k]:
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(ready, place[nxt])
    return order if len(order) == len(deps) else None


def _levels(order: list[int], deps: list[list[int]], after: list[list[int]], reductions: set[int]) -> list[int]:
    """Each step's level: the number (in ``order``) of the last reduction it waits for, so that
    what uses a reduction's result runs after what does not; a step that waits for no later
    reduction than its users (a gather, a constant, the optimizer's reads of its state) takes
    its first user's level, so it runs with them, not early (the graph's output, last in
    ``order``, is no user). A reduction keeps its own level (it starts as soon as its values
    exist)."""
    number = [0] * len(order)
    for i, k in enumerate(k for k in order if k in reductions):
        number[k] = i + 1
    up = [0] * len(order)
    waits = [0] * len(order)  # the last reduction a step's users wait for: its own, or that its inputs wait for
    for k in order:
        up[k] = max([waits[d] for d in deps[k]], default=0)
        waits[k] = max(up[k], number[k])
    level = [0] * len(order)
    output = order[-1]  # (it computes nothing)
    for k in reversed(order):
        later = [level[u] for u in after[k] if u != output]
        level[k] = up[k] if k in reductions or not later else max(up[k], min(later))
    return level


def _light(nodes: list[torch.fx.Node], deps: list[list[int]], reductions: set[int]) -> set[int]:
    """The reductions whose values ops compute from the graph's inputs alone, producing at most
    :data:`SMALL_BYTES` in all (a mean's token count), with those ops: they start first (``deps``:
    each step's; a node's inputs are the steps of the nodes among them)."""
    cone: list[set[int] | None] = []
    produced: dict[int, int] = {}  # (of the nodes whose cone is a set)
    for k, n in enumerate(nodes):
        if n.op in ("placeholder", "get_attr"):
            cone.append(set())
            continue
        parts = [cone[p] for p in deps[k] if p < len(nodes)] if n.op == "call_function" else [None]
        mine = None if any(c is None for c in parts) else set().union({k}, *parts)
        if mine is not None:
            produced[k] = _produced(n)
        cone.append(mine if mine is not None and sum(produced[j] for j in mine) <= SMALL_BYTES else None)
    first: set[int] = set()
    for k in reductions:
        parts = [cone[d] for d in deps[k]]
        if all(c is not None for c in parts):
            first |= {k}.union(*parts)
    return first


def _produced(node: torch.fx.Node) -> int:
    """The bytes ``node``'s tensor results take (its traced global values)."""
    return sum(
        t.numel() * t.element_size()
        for t in _compat.torch_tree_leaves(node.meta.get("val"))
        if isinstance(t, torch.Tensor)
    )


def _even(mesh: Mesh, t: torch.Tensor, placements: Placements) -> bool:
    """Does every rank hold a plain shard of one shape: each split dim divided evenly by all the
    mesh dims that split it together (a batch of 6 over dp=2 and fsdp=2 nested is not: 2, 2, 1, 1)?"""
    return all(not is_shard(p) or dtensor_native(p) for p in placements) and splits_evenly(mesh, t, placements)


def _bucket(
    mesh: Mesh, kind: str, members: list[Redistribution], mesh_dims: tuple[int, ...], before: torch.fx.Node
) -> Bucket:
    dtype = meta_of(members[0].value).dtype
    numel = sum(_buffer_bytes(mesh, r, kind) for r in members) // dtype.itemsize
    # (a reduce-scatter's bucket all-reduces its scattered buffer over its further mesh dims)
    scattered = numel // mesh.axis_size(mesh.device_axes[mesh_dims[0]]) if kind == "reduce_scatter" else numel
    collectives = tuple(
        Collective(
            kind if i == 0 else "all_reduce",
            axis,
            (numel if i == 0 else scattered,),
            dtype,
            sum(c.bytes for r in members for c in r.collectives if c.axis == axis),
        )
        for i, axis in enumerate(mesh.device_axes[k] for k in mesh_dims)
    )
    return Bucket(kind, tuple(members), mesh_dims, before, collectives)
