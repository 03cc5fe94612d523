"""Moving a value between two placements: the path it takes one mesh dim at a time
(:func:`transition_path`), the collectives of that path with their bytes (:func:`collectives_of`,
at plan time), and each step run on a rank's local shard (:func:`move_local`, at run time).

Example::

    >>> transition_path(mesh, (Partial(), Replicate()), (Shard(0), Shard(0)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import _compat
from vsf.jit.cost import local_shape, transition_bytes, transition_kind
from vsf.errors import PlanError
from vsf.jit.plan import Collective, Placements, as_contiguous, has_balanced, has_ragged, is_shard, one_d, split_dim
from vsf.sharding import ragged
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import BalancedPlacement, RaggedPlacement, balanced_order, from_placements

__all__ = ["collectives_of", "minor_step", "move_local", "transition_path"]


_STEP_ORDER = {"slice": 0, "partition": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4, "all_gather": 5}


def minor_step(mesh: Mesh, src: Placements, dst: Placements) -> tuple[int, int] | None:
    """``(mesh_dim, tensor_dim)`` when ``src`` -> ``dst`` changes one mesh dim between replicated,
    partial and a strided shard that is *minor* to every other mesh dim splitting that tensor dim
    (ZeRO's ``P(("fsdp", "dp"))``). Such a step is a plain 1D collective of the local shard along
    the tensor dim (a reduce-scatter into a ZeRO layout), where DTensor would all-reduce and slice."""
    changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(changed) != 1:
        return None
    k = changed[0]
    strided = [p for p in (src[k], dst[k]) if isinstance(p, _compat.StridedShard)]
    if not strided or any(not isinstance(p, (Replicate, Partial, _compat.StridedShard)) for p in (src[k], dst[k])):
        return None
    d = strided[0].dim
    if any(p.dim != d for p in strided) or any(isinstance(p, Partial) and p.reduce_op != "sum" for p in (src[k], dst[k])):
        return None
    later = math.prod(mesh.axis_size(a) for j, a in enumerate(mesh.device_axes) if j > k and is_shard(src[j]) and split_dim(src[j]) == d)
    earlier = any(is_shard(src[j]) and split_dim(src[j]) == d for j in range(k))
    return (k, d) if not earlier and all(p.split_factor == later for p in strided) else None


def transition_path(mesh: Mesh, src: Placements, dst: Placements) -> list[Placements]:
    """The placements a value passes through from ``src`` to ``dst``, one mesh dim at a time, in the
    order that moves the fewest bytes: local slices first, then reductions (a reduce-scatter shrinks
    what later steps move), then all-to-alls, then all-gathers. Strided shards move in one step
    (their order is part of the layout): DTensor's, except that a strided shard minor to the
    other splits of its dim is taken last, as a :func:`minor_step` after the other mesh dims moved
    (a gradient reduce-scattered over ``fsdp``, then over ``dp`` on its local shard: ZeRO's
    ``P(("fsdp", "dp"))``); and a strided shard alone on its dim (a view merged it: not a
    nesting) that becomes a plain placement moves first, alone: DTensor moving it with other mesh
    dims slices those first and then regathers the strided shard as if it split the whole dim
    (``(S(0)/sf2, R) -> (R, S(0))`` left each rank all rows, wrongly ordered)."""
    if any(isinstance(p, _compat.StridedShard) for p in (*src, *dst)):
        last = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b and isinstance(b, _compat.StridedShard)]
        if len(last) == 1:
            mid = tuple(src[k] if k == last[0] else p for k, p in enumerate(dst))
            if mid != tuple(src) and not any(isinstance(p, _compat.StridedShard) for p in (*src, *mid)) and minor_step(mesh, mid, dst) is not None:
                return [*transition_path(mesh, src, mid), tuple(dst)]
        changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
        alone = lambda k: not any(j != k and is_shard(p) and split_dim(p) == src[k].dim for j, p in enumerate(src))  # noqa: E731
        first = [k for k in changed if isinstance(src[k], _compat.StridedShard) and not isinstance(dst[k], _compat.StridedShard) and alone(k)]
        if first and len(first) < len(changed):
            mid = tuple(dst[k] if k in first else p for k, p in enumerate(src))
            return [mid, *transition_path(mesh, mid, dst)]
        return [tuple(dst)]
    dims = sorted((k for k, (a, b) in enumerate(zip(src, dst)) if a != b), key=lambda k: (_STEP_ORDER.get(transition_kind(src[k], dst[k]), 9), k))
    path, current = [], list(src)
    for k in dims:
        current[k] = dst[k]
        path.append(tuple(current))
    return path


def collectives_of(mesh: Mesh, t: torch.Tensor, src: Placements, dst: Placements) -> tuple[Collective, ...]:
    """The collectives that move ``t`` from ``src`` to ``dst`` (along :func:`transition_path`, each
    step as DTensor runs it, or vsf's ragged collectives for a ragged step, or a balanced split's
    gather), with the bytes each rank sends."""
    dm = mesh.device_mesh
    dm_axes = list(mesh.device_axes)
    out = []
    prev = tuple(src)
    for placements in (src, dst):
        _check_balanced(mesh, placements)
    for nxt in transition_path(mesh, src, dst):
        current = list(prev)
        if has_ragged([prev, nxt]) or has_balanced([prev, nxt]) or minor_step(mesh, prev, nxt) is not None:
            steps = [(k, a, b) for k, (a, b) in enumerate(zip(prev, nxt)) if a != b]
        else:
            steps = [(k, a, b) for k, a, b, _ in _compat.redistribute_steps(dm, prev, nxt, t)]
        for mesh_dim, a, b in steps:
            before = local_shape(mesh, t, tuple(current))
            current[mesh_dim] = b
            after = local_shape(mesh, t, tuple(current))
            kind = transition_kind(one_d(a), one_d(b))
            if kind in (None, "slice", "partition"):
                continue
            n = mesh.axis_size(dm_axes[mesh_dim])
            if kind == "all_gather" and is_shard(b):  # a balanced split to another: gathered first
                after = local_shape(mesh, t, tuple(Replicate() if k == mesh_dim else p for k, p in enumerate(current)))
            shape = after if kind == "all_gather" else before
            full = math.prod(shape) * t.element_size() * (n if kind == "all_to_all" else 1)
            out.append(Collective(kind, dm_axes[mesh_dim], shape, t.dtype, int(round(transition_bytes(kind, n, full)))))
        prev = nxt
    return tuple(out)


def move_local(mesh: Mesh, t: torch.Tensor, local: torch.Tensor, src: Placements, dst: Placements) -> torch.Tensor:
    """One step of a redistribution on this rank's local shard: DTensor's, or vsf's ragged
    collectives on a mesh dim where either side is ragged (one mesh dim at a time)."""
    dm = mesh.device_mesh
    minor = minor_step(mesh, src, dst)
    if minor is not None:  # a 1D collective of the local shard: the other mesh dims have split it already
        k, d = minor
        level = list(src)
        level[k] = Replicate()
        shape = local_shape(mesh, t, tuple(level))
        lone = lambda p: tuple(one_d(p) if j == k else Replicate() for j in range(len(src)))  # noqa: E731
        return _compat.redistribute_local(local, dm, lone(src[k]), lone(dst[k]), shape=shape, stride=_contiguous(shape), dtype=t.dtype)
    if has_balanced([src, dst]):
        return _move_balanced(mesh, t, local, src, dst)
    if not any(isinstance(p, RaggedPlacement) for p in (*src, *dst)):
        return _compat.redistribute_local(local, dm, src, dst, shape=t.shape, stride=t.stride(), dtype=t.dtype)
    for k, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        mid = tuple(b if j == k else p for j, p in enumerate(src))
        if isinstance(a, RaggedPlacement) or isinstance(b, RaggedPlacement):
            axis = mesh.device_axes[k]
            shape = ragged.group_shape(from_placements(mesh, src, t.ndim), axis, tuple(t.shape))
            local = ragged.reshard(local, shape, _layout(a), _layout(b), mesh=mesh)
        else:  # another mesh dim: DTensor moves it; the ragged rows are just rows there
            plain = lambda pl: tuple(Replicate() if isinstance(p, RaggedPlacement) else p for p in pl)  # noqa: E731
            local = move_local(mesh, t, local, plain(src), plain(mid))
        src = mid
    return local


def _check_balanced(mesh: Mesh, placements: Placements) -> None:
    """A balanced split is its dim's last split: its chunks are of the whole dim, or with a split
    factor of each group of the block that earlier mesh dims' plain shards leave."""
    for k, p in enumerate(placements):
        if isinstance(p, BalancedPlacement):
            others = [
                mesh.device_axes[j] for j, q in enumerate(placements)
                if j != k and is_shard(q) and split_dim(q) == p.dim and (j > k or type(q) is not Shard)
            ]
            if others:
                raise PlanError(f"dim {p.dim} is split balanced over {mesh.device_axes[k]!r} and over {others} too ({placements}): vsf has no such layout")


def _move_balanced(mesh: Mesh, t: torch.Tensor, local: torch.Tensor, src: Placements, dst: Placements) -> torch.Tensor:
    """A redistribution where a balanced split takes part, one mesh dim at a time: DTensor moves
    the local shards as contiguous shards of the balanced view; leaving a balanced split gathers
    the dim and puts its chunks back in order, entering one puts them in the ranks' order (a
    replicated or partial value holds the whole dim) and keeps this rank's block."""
    dm = mesh.device_mesh
    move = lambda x, a, b: _compat.redistribute_local(x, dm, as_contiguous(a), as_contiguous(b), shape=t.shape, stride=t.stride(), dtype=t.dtype)  # noqa: E731
    current = tuple(src)
    for k, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        n = mesh.axis_size(mesh.device_axes[k])
        if isinstance(a, BalancedPlacement):
            whole = tuple(Replicate() if j == k else p for j, p in enumerate(current))
            local = move(local, current, whole)
            local = local.index_select(a.dim, torch.argsort(balanced_order(local.shape[a.dim], n, a.groups)))
            current = whole
        nxt = tuple(b if j == k else p for j, p in enumerate(current))
        if isinstance(b, BalancedPlacement):
            local = local.index_select(b.dim, balanced_order(local.shape[b.dim], n, b.groups))
        if nxt != current:
            local = move(local, current, nxt)
        current = nxt
    return local


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _layout(p: Any) -> Any:
    return p.ragged if isinstance(p, RaggedPlacement) else p
