"""Moving a value between two placements: the path it takes one mesh dim at a time
(:func:`transition_path`), the collectives of that path with their bytes (:func:`collectives_of`,
at plan time), and each step run on a rank's local shard (:func:`move_local`, at run time).

Example::

    >>> transition_path(mesh, (Partial(), Replicate()), (Shard(0), Shard(0)))
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import _compat
from vsf.jit.cost import local_shape, through_whole, transition_bytes, transition_kind
from vsf.errors import PlanError
from vsf.jit.plan import Collective, Placements
from vsf.sharding import ragged
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import from_placements
from vsf.sharding.placement import (
    as_contiguous,
    balanced_order,
    has_balanced,
    has_ragged,
    has_strided,
    is_shard,
    kind_of,
    layout_of,
    on_dim,
    one_d,
    split_dim,
)

__all__ = [
    "Regather",
    "collectives_of",
    "local_step",
    "minor_step",
    "move_local",
    "strided_regather",
    "transition_path",
]


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
    strided = [p for p in (src[k], dst[k]) if kind_of(p) == "strided"]
    if not strided or any(kind_of(p) not in ("replicate", "partial", "strided") for p in (src[k], dst[k])):
        return None
    d = strided[0].dim
    if any(p.dim != d for p in strided) or any(
        isinstance(p, Partial) and p.reduce_op != "sum" for p in (src[k], dst[k])
    ):
        return None
    inner = [j for j in range(k + 1, len(src)) if is_shard(src[j]) and split_dim(src[j]) == d]
    if any(
        kind_of(src[j]) != "shard" for j in inner
    ):  # a strided split inside: not the one 1D split of the local shard
        return None
    later = math.prod(mesh.axis_size(mesh.device_axes[j]) for j in inner)
    earlier = any(is_shard(src[j]) and split_dim(src[j]) == d for j in range(k))
    return (k, d) if not earlier and all(p.split_factor == later for p in strided) else None


def local_step(mesh: Mesh, t: torch.Tensor, src: Placements, dst: Placements) -> tuple[int, int] | None:
    """``(mesh_dim, tensor_dim)`` when moving ``t`` from ``src`` to ``dst`` is one 1D collective
    (or slice) of the local shard along ``tensor_dim`` over ``mesh_dim``: a :func:`minor_step`, or
    a move through strided shards whose local shards are, index for index, the pieces of DTensor's
    1D split of the unsplit side's over that mesh dim (checked on the indices along the dim, at
    every coordinate of the mesh dims splitting it). DTensor cannot make those moves itself: a
    view merging ``[b@dp, t@cp]`` into ``b*t`` on a mesh ``("cp", "dp")`` gives ``S(0)/sf4, S(0)``,
    which gathers over ``dp`` to ``S(0)/sf4, R``; on a mesh ``("fsdp", "cp")``, ``S(1), S(1)/sf2``
    gathers over ``fsdp`` to ``R, S(1)/sf4`` (cp's split factor counts the pieces it splits)."""
    shape, src, dst = tuple(t.shape), tuple(src), tuple(dst)
    return (
        minor_step(mesh, src, dst)
        or _strided_split_step(mesh, shape, src, dst)
        or _exchange_step(mesh, shape, src, dst)
    )


def _exchange_step(mesh: Mesh, shape: tuple[int, ...], src: Placements, dst: Placements) -> tuple[int, int] | None:
    """``(mesh_dim, tensor_dim)`` (the dim ``dst`` splits) when ``src`` -> ``dst`` moves one mesh
    dim's split from one tensor dim to another, a strided shard on either side, as one 1D all-to-all
    of the local shard: at every mesh coordinate, each side's local shard is, index for index, the
    piece of DTensor's 1D split of that dim of what the other mesh dims leave (checked). DTensor
    cannot make it: the tokens ``[batch@ep, seq@cp]`` on a mesh ``("cp", "ep")`` (``S(1), S(0)``)
    split over the batch ep-major for an expert dispatch, ``P(("ep", "cp"))`` (``S(0)/sf2, S(0)``),
    which it gathers over both axes; each rank's batch rows only change hands within its ep group."""
    if has_ragged([src, dst]) or has_balanced([src, dst]) or not has_strided([src, dst]):
        return None
    changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(changed) != 1:
        return None
    (k,) = changed
    a, b = src[k], dst[k]
    if kind_of(a) not in ("shard", "strided") or kind_of(b) not in ("shard", "strided") or a.dim == b.dim:
        return None
    sizes = tuple(mesh.axis_size(x) for x in mesh.device_axes)
    whole = tuple(Replicate() if j == k else p for j, p in enumerate(src))
    if any(
        shape[d] % math.prod(n for n, p in zip(sizes, pl) if is_shard(p) and split_dim(p) == d)
        for pl in (src, dst)
        for d in (a.dim, b.dim)
    ):
        return None  # uneven: DTensor's 1D collective pads the largest shard
    return (k, b.dim) if _exchanged(shape, whole, src, dst, k, sizes) else None


@functools.cache
def _exchanged(
    shape: tuple[int, ...], whole: Placements, src: Placements, dst: Placements, k: int, sizes: tuple[int, ...]
) -> bool:
    """Is, at every mesh coordinate, the local shard of ``arange`` (of ``shape``) laid out as
    ``src`` (and as ``dst``) the ``k``-th coordinate's piece of DTensor's 1D split over mesh dim
    ``k`` of its shard laid out as ``whole``, on the tensor dim ``src`` (``dst``) splits there?"""
    with _compat.local_mode_disabled():  # plain indices, whether or not ranks are simulated
        index = torch.arange(math.prod(shape)).view(shape)
        coords = itertools.product(*(range(n) for n in sizes))
        return all(
            torch.equal(
                torch.tensor_split(_compat.shard_of(index, whole, sizes, c), sizes[k], dim=pl[k].dim)[c[k]],
                _compat.shard_of(index, pl, sizes, c),
            )
            for c in coords
            for pl in (src, dst)
        )


def _strided_split_step(mesh: Mesh, shape: tuple[int, ...], src: Placements, dst: Placements) -> tuple[int, int] | None:
    found = _split_step(mesh, shape, src, dst)
    return found[:2] if found is not None and found[2] == 1 else None


def _split_step(mesh: Mesh, shape: tuple[int, ...], src: Placements, dst: Placements) -> tuple[int, int, int] | None:
    """``(mesh_dim, tensor_dim, factor)`` when ``src`` -> ``dst`` splits (or gathers) one mesh dim's
    share of a dim through strided shards, the other mesh dims' splits of that dim holding the same
    rows, so that at every mesh coordinate the split side's local shard is the mesh dim's 1D piece
    of the whole side's local shard: contiguous (``factor`` 1), or strided, the local dim viewed as
    ``[factor, n, m]`` with ``[:, rank, :]`` kept (checked on the indices along the dim). The rows
    of the tokens ``[batch@ep, seq@cp]`` merged on a mesh ``("cp", "ep")`` (``S(0)/sf4, S(0)``)
    gather over cp alone to ep's blocks of whole sequences (``R, S(0)``): the gathered
    ``[cp, sequence, position]`` is ``[sequence, cp, position]`` transposed, factor 2."""
    if not has_strided([src, dst]) or has_ragged([src, dst]) or has_balanced([src, dst]):
        return None
    sizes = tuple(mesh.axis_size(a) for a in mesh.device_axes)
    for k, (a, b) in enumerate(zip(src, dst)):
        whole, split = (src, dst) if isinstance(a, (Replicate, Partial)) else (dst, src)
        if (
            a == b
            or not isinstance(whole[k], (Replicate, Partial))
            or isinstance(dst[k], Partial)
            or not is_shard(split[k])
        ):
            continue
        if isinstance(whole[k], Partial) and whole[k].reduce_op != "sum":
            return None
        d = split[k].dim
        splits_d = lambda p: is_shard(p) and split_dim(p) == d  # noqa: E731
        if any(j != k and p != q and not (splits_d(p) and splits_d(q)) for j, (p, q) in enumerate(zip(src, dst))):
            return None
        if any(shape[d] % math.prod(n for n, p in zip(sizes, pl) if splits_d(p)) for pl in (src, dst)):
            return None  # uneven: DTensor's 1D collective pads the largest shard
        along = lambda pl: tuple(on_dim(p, 0) if splits_d(p) else Replicate() for p in pl)  # noqa: E731
        factor = _piece_factor(shape[d], along(whole), along(split), k, sizes)
        return None if factor is None else (k, d, factor)
    return None


@functools.cache
def _piece_factor(size: int, whole: Placements, split: Placements, k: int, sizes: tuple[int, ...]) -> int | None:
    """The factor ``f`` (1 first) for which, at every mesh coordinate, the local shard of
    ``arange(size)`` laid out as ``split`` is the ``k``-th coordinate's piece of its shard laid out
    as ``whole``, viewed as ``[f, n, m]`` with ``[:, coordinate, :]`` kept (``f`` 1: DTensor's 1D
    split); ``None`` if no factor makes it."""
    with _compat.local_mode_disabled():  # plain indices, whether or not ranks are simulated
        index = torch.arange(size)
        coords = list(
            itertools.product(
                *(range(n) if is_shard(p) or is_shard(q) else (0,) for n, p, q in zip(sizes, whole, split))
            )
        )
        wholes = [_compat.shard_of(index, whole, sizes, c) for c in coords]
        splits = [_compat.shard_of(index, split, sizes, c) for c in coords]
        rows = len(wholes[0]) // sizes[k]
        for f in (f for f in range(1, rows + 1) if rows % f == 0):
            if all(
                len(w) == f * sizes[k] * (rows // f) and torch.equal(w.view(f, sizes[k], -1)[:, c[k]].reshape(-1), s)
                for w, s, c in zip(wholes, splits, coords)
            ):
                return f
        return None


@dataclasses.dataclass(frozen=True)
class Regather:
    """How vsf itself moves a value laid out with strided shards, which DTensor's redistribution
    does not always regather right: ``reduces``, the mesh dims whose partial sums are all-reduced
    first; ``gathers``, for each tensor dim whose splits change, the source's splits undone from
    the last mesh dim back to the first one that differs; then ``slices``, the destination's made
    from there on. Each gather or slice is ``(mesh_dim, dim, placement, length)``, ``length``
    being the dim's local length before it. Every gather is a 1D all-gather along its dim and
    every slice local, a strided shard's interleaving put right by a local permutation; splits of
    different dims are independent, so the gathers can all go first. A move of one mesh dim's
    strided piece of the local shard (:func:`_split_step`) is that one gather or slice."""

    reduces: tuple[int, ...]
    gathers: tuple[tuple[int, int, Any, int], ...]
    slices: tuple[tuple[int, int, Any, int], ...]


def strided_regather(mesh: Mesh, shape: tuple[int, ...], src: Placements, dst: Placements) -> Regather | None:
    """The :class:`Regather` of a move between layouts holding a strided shard (``None`` for
    other moves, a ragged or balanced split, a partial sum made, or a split that does not divide:
    DTensor's own path then). It serves the moves :func:`local_step` does not make in one
    collective, such as ``S(0), S(0)/sf2 -> R, S(0)/sf2`` on a mesh ``("fsdp", "cp")``: gathering
    over ``fsdp`` alone would leave cp's shard interleaved as ``S(0)/sf4``, and DTensor's all-to-all
    of ``S(1), S(0)/sf4 -> S(0), S(0)/sf4`` splits the rows cp kept rather than the whole dim."""
    src, dst = tuple(src), tuple(dst)
    if not has_strided([src, dst]) or has_ragged([src, dst]) or has_balanced([src, dst]) or src == dst:
        return None
    if any(isinstance(b, Partial) and a != b for a, b in zip(src, dst)) or any(
        isinstance(a, Partial) and a.reduce_op != "sum" and a != b for a, b in zip(src, dst)
    ):
        return None
    sizes = [mesh.axis_size(a) for a in mesh.device_axes]
    reduces = tuple(k for k, (a, b) in enumerate(zip(src, dst)) if isinstance(a, Partial) and a != b)
    step = _split_step(mesh, shape, src, dst)
    if step is not None:  # one mesh dim's strided piece (a plain one is a local_step)
        k, d, f = step
        whole = src if isinstance(src[k], (Replicate, Partial)) else dst
        length = shape[d] // math.prod(n for n, p in zip(sizes, whole) if is_shard(p) and split_dim(p) == d)
        piece = ((k, d, _compat.StridedShard(d, split_factor=f), length),)
        return Regather(reduces, piece, ()) if whole is dst else Regather(reduces, (), piece)
    gathers, slices = [], []
    for d in range(len(shape)):
        mine = lambda p: p if is_shard(p) and split_dim(p) == d else None  # noqa: E731
        before, after = (
            _lengths(shape[d], sizes, [mine(p) for p in src]),
            _lengths(shape[d], sizes, [mine(p) for p in dst]),
        )
        if before is None or after is None:
            return None
        first = next((k for k, (a, b) in enumerate(zip(src, dst)) if mine(a) != mine(b)), None)
        if first is None:
            continue
        gathers += [(k, d, src[k], before[k]) for k in range(len(src) - 1, first - 1, -1) if mine(src[k]) is not None]
        slices += [(k, d, dst[k], after[k]) for k in range(first, len(dst)) if mine(dst[k]) is not None]
    return Regather(reduces, tuple(gathers), tuple(slices))


def _lengths(n: int, sizes: Sequence[int], splits: Sequence[Any]) -> list[int] | None:
    """A dim's local length before each mesh dim, splitting it as ``splits`` say (``None``: does
    not), or ``None`` where a split does not divide it."""
    out = []
    for size, p in zip(sizes, splits):
        out.append(n)
        if p is not None:
            if n % (size * getattr(p, "split_factor", 1)):
                return None
            n //= size
    return out


def _regather_collectives(mesh: Mesh, t: torch.Tensor, src: Placements, r: Regather) -> list[Collective]:
    """The all-reduces and all-gathers of ``r`` (its slices send nothing), with the bytes each rank sends."""
    shape = list(local_shape(mesh, t, src))
    out = []
    for kind, k, d, length in [("all_reduce", k, None, None) for k in r.reduces] + [
        ("all_gather", k, d, n) for k, d, _, n in r.gathers
    ]:
        if d is not None:
            shape[d] = length
        n = mesh.axis_size(mesh.device_axes[k])
        out.append(
            Collective(
                kind,
                mesh.device_axes[k],
                tuple(shape),
                t.dtype,
                int(round(transition_bytes(kind, n, math.prod(shape) * t.element_size()))),
            )
        )
    return out


def _run_regather(mesh: Mesh, t: torch.Tensor, local: torch.Tensor, src: Placements, r: Regather) -> torch.Tensor:
    """``r`` on this rank's ``local`` shard. A strided shard ``S(d)/sf`` over ``n`` ranks views the
    dim as ``[sf, n, m]`` and keeps ``[:, rank, :]``: gathered as a plain shard it comes back as
    ``[n, sf, m]``, which one transpose puts in order (and the reverse, before a slice)."""
    dm = mesh.device_mesh
    shape = list(local_shape(mesh, t, src))

    def lone(k: int, p: Any) -> tuple[Any, ...]:
        return tuple(p if j == k else Replicate() for j in range(len(src)))

    def move(x: torch.Tensor, k: int, a: Any, b: Any) -> torch.Tensor:
        return _compat.redistribute_local(
            x, dm, lone(k, a), lone(k, b), shape=tuple(shape), stride=_contiguous(shape), dtype=t.dtype
        )

    def swap(x: torch.Tensor, d: int, a: int, b: int) -> torch.Tensor:  # [a, b, m] -> [b, a, m] along d
        return x.unflatten(d, (a, b, -1)).transpose(d, d + 1).flatten(d, d + 2)

    for k in r.reduces:
        local = move(local, k, src[k], Replicate())
    for k, d, p, length in r.gathers:
        shape[d] = length
        local = move(local, k, Shard(d), Replicate())
        if kind_of(p) == "strided":
            local = swap(local, d, mesh.axis_size(mesh.device_axes[k]), p.split_factor)
    for k, d, p, length in r.slices:
        shape[d] = length
        if kind_of(p) == "strided":
            local = swap(local, d, p.split_factor, mesh.axis_size(mesh.device_axes[k]))
        local = move(local, k, Replicate(), Shard(d))
    return local


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
    (``(S(0)/sf2, R) -> (R, S(0))`` left each rank all rows, wrongly ordered). A shard wanted as a
    partial sum is gathered, then partitioned last (:func:`~vsf.jit.cost.reachable`)."""
    if (whole := through_whole(src, dst)) != tuple(dst):
        return [*transition_path(mesh, src, whole), tuple(dst)]
    if has_strided([src, dst]):
        last = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b and kind_of(b) == "strided"]
        if len(last) == 1:
            mid = tuple(src[k] if k == last[0] else p for k, p in enumerate(dst))
            if mid != tuple(src) and not has_strided([src, mid]) and minor_step(mesh, mid, dst) is not None:
                return [*transition_path(mesh, src, mid), tuple(dst)]
        changed = [k for k, (a, b) in enumerate(zip(src, dst)) if a != b]
        alone = lambda k: not any(j != k and is_shard(p) and split_dim(p) == src[k].dim for j, p in enumerate(src))  # noqa: E731
        first = [k for k in changed if kind_of(src[k]) == "strided" and kind_of(dst[k]) != "strided" and alone(k)]
        if first and len(first) < len(changed):
            mid = tuple(dst[k] if k in first else p for k, p in enumerate(src))
            return [mid, *transition_path(mesh, mid, dst)]
        return [tuple(dst)]
    dims = sorted(
        (k for k, (a, b) in enumerate(zip(src, dst)) if a != b),
        key=lambda k: (_STEP_ORDER.get(transition_kind(src[k], dst[k]), 9), k),
    )
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
        one = local_step(mesh, t, prev, nxt)
        regather = strided_regather(mesh, tuple(t.shape), prev, nxt) if one is None else None
        if regather is not None:
            out.extend(_regather_collectives(mesh, t, prev, regather))
            prev = nxt
            continue
        if one is not None:
            steps = [(one[0], prev[one[0]], nxt[one[0]])]
        elif has_ragged([prev, nxt]) or has_balanced([prev, nxt]):
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
    """One step of a redistribution on this rank's local shard: DTensor's, or vsf's own for a
    :func:`local_step`, a :func:`strided_regather` or a ragged or balanced split (one mesh dim
    at a time)."""
    dm = mesh.device_mesh
    minor = local_step(mesh, t, src, dst)
    if minor is not None:  # a 1D collective of the local shard: the other mesh dims have split it already
        k, d = minor
        level = list(src)
        level[k] = Replicate()
        shape = local_shape(mesh, t, tuple(level))
        lone = lambda p: tuple(one_d(p) if j == k else Replicate() for j in range(len(src)))  # noqa: E731
        return _compat.redistribute_local(
            local, dm, lone(src[k]), lone(dst[k]), shape=shape, stride=_contiguous(shape), dtype=t.dtype
        )
    regather = strided_regather(mesh, tuple(t.shape), src, dst)
    if regather is not None:
        return _run_regather(mesh, t, local, src, regather)
    if has_balanced([src, dst]):
        return _move_balanced(mesh, t, local, src, dst)
    if not has_ragged([src, dst]):
        return _compat.redistribute_local(local, dm, src, dst, shape=t.shape, stride=t.stride(), dtype=t.dtype)
    for k, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        mid = tuple(b if j == k else p for j, p in enumerate(src))
        if kind_of(a) == "ragged" or kind_of(b) == "ragged":
            axis = mesh.device_axes[k]
            shape = ragged.group_shape(from_placements(mesh, src, t.ndim), axis, tuple(t.shape))
            local = ragged.reshard(local, shape, layout_of(a), layout_of(b), mesh=mesh)
        else:  # another mesh dim: DTensor moves it; the ragged rows are just rows there
            plain = lambda pl: tuple(Replicate() if kind_of(p) == "ragged" else p for p in pl)  # noqa: E731
            local = move_local(mesh, t, local, plain(src), plain(mid))
        src = mid
    return local


def _check_balanced(mesh: Mesh, placements: Placements) -> None:
    """A balanced split is its dim's last split: its chunks are of the whole dim, or with a split
    factor of each group of the block that earlier mesh dims' plain shards leave."""
    for k, p in enumerate(placements):
        if kind_of(p) == "balanced":
            others = [
                mesh.device_axes[j]
                for j, q in enumerate(placements)
                if j != k and is_shard(q) and split_dim(q) == p.dim and (j > k or kind_of(q) != "shard")
            ]
            if others:
                raise PlanError(
                    f"dim {p.dim} is split balanced over {mesh.device_axes[k]!r} and over {others} too ({placements}): vsf has no such layout"
                )


def _move_balanced(mesh: Mesh, t: torch.Tensor, local: torch.Tensor, src: Placements, dst: Placements) -> torch.Tensor:
    """A redistribution where a balanced split takes part, one mesh dim at a time: DTensor moves
    the local shards as contiguous shards of the balanced view; leaving a balanced split gathers
    the dim and puts its chunks back in order, entering one puts them in the ranks' order (a
    replicated or partial value holds the whole dim) and keeps this rank's block."""
    dm = mesh.device_mesh
    move = lambda x, a, b: _compat.redistribute_local(
        x, dm, as_contiguous(a), as_contiguous(b), shape=t.shape, stride=t.stride(), dtype=t.dtype
    )  # noqa: E731
    current = tuple(src)
    for k, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        n = mesh.axis_size(mesh.device_axes[k])
        if kind_of(a) == "balanced":
            whole = tuple(Replicate() if j == k else p for j, p in enumerate(current))
            local = move(local, current, whole)
            local = local.index_select(a.dim, torch.argsort(balanced_order(local.shape[a.dim], n, a.groups)))
            current = whole
        nxt = tuple(b if j == k else p for j, p in enumerate(current))
        if kind_of(b) == "balanced":
            local = local.index_select(b.dim, balanced_order(local.shape[b.dim], n, b.groups))
        if nxt != current:
            local = move(local, current, nxt)
        current = nxt
    return local


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
