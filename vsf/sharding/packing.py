"""Flat-buffer FSDP on a ragged axis: pack a pytree of params into per-rank ragged shards.

:func:`ragged_plan` gives every leaf a ``P(vsf.ragged(axis, units, block=b))`` so that each rank
of ``axis`` holds whole blocks (``b`` rows, or whole leaves) and the ranks hold about the same
number of bytes. Because every leaf is split contiguously in rank order, a rank's pieces of all
leaves, concatenated, are its part of one flat buffer: :func:`gather_group` all-gathers the
whole group with ONE :func:`vsf.ops.all_gather_v`, and :func:`reduce_scatter_group` reduces
gradients back with ONE :func:`vsf.ops.reduce_scatter_v`.

Example::

    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((4,), ("fsdp",))
    ...     plan = vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh, block=32)
    ...     params = vsf.device_put(params, plan)              # ragged DTensors, ~equal bytes per rank
    ...     full = vsf.sharding.gather_group(params)           # one collective for the whole tree
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, ops, tree
from vsf.ops import backend
from vsf.sharding import ragged
from vsf.sharding.mesh import Mesh, current_mesh
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import from_local
from vsf.sharding.spec import PartitionSpec

__all__ = ["gather_group", "ragged_plan", "reduce_scatter_group"]

BALANCES = ("bytes", "numel")


def ragged_plan(params: Any, axis: str, *, block: Any = None, balance: str = "bytes", mesh: Mesh | None = None) -> Any:
    """Shardings that split every leaf of ``params`` over ``axis`` in whole blocks, balancing
    ``balance`` (``"bytes"`` or ``"numel"``) across its ranks.

    ``block`` says what a rank holds whole, as one value or a pytree prefix of ``params``:
    ``None`` (a row of dim 0), an int ``b`` (blocks of ``b`` rows, e.g. 32 for block-wise
    quantization; it must divide the leaf's rows), or ``"leaf"`` (the whole leaf on one rank,
    e.g. for Muon). Whole leaves are placed first, largest first on the least loaded rank; the
    blocks of the others then fill the ranks, in flatten order, up to the common level that
    balances them best, so each leaf covers a run of consecutive ranks and every rank ends
    within one block of that level (or above it, holding only whole leaves). ``mesh`` defaults to the current mesh (:func:`vsf.use_mesh`).

    Returns a pytree of ``NamedSharding`` (``P(vsf.ragged(axis, units, block=b))`` per leaf) for
    :func:`vsf.device_put`; ``vsf.debug.memory_report`` of the placed params shows the balance.

    Example::

        >>> plan = vsf.sharding.ragged_plan(params, "fsdp", block={"w": "leaf", "b": None}, mesh=mesh)
        >>> plan["w"].spec
        P(RaggedShard('fsdp', units=(0, 0, 1, 0), dims=1, block=1))
    """
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError("ragged_plan needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
    if balance not in BALANCES:
        raise ValueError(f"ragged_plan balances one of {BALANCES}, got balance={balance!r}")
    n = mesh.axis_size(axis)
    pairs, treedef = tree.flatten_with_path(params)
    blocks = tree.broadcast_prefix(block, params, is_leaf=_is_block, what="block")
    items = [_item(path, leaf, b, balance) for (path, leaf), b in zip(pairs, blocks)]
    counts = _assign(items, n)
    return tree.unflatten(
        treedef,
        [
            NamedSharding(mesh, PartitionSpec(ragged.ragged(axis, c, block=it.rows_per_block)))
            for it, c in zip(items, counts)
        ],
    )


class _Item(NamedTuple):
    rows_per_block: int
    blocks: int  # 1 for a whole leaf
    weight: int  # bytes or elements of one block
    whole: bool


def _is_block(b: Any) -> bool:
    return b is None or b == "leaf" or (isinstance(b, int) and not isinstance(b, bool))


def _item(path: tree.KeyPath, leaf: Any, block: Any, balance: str) -> _Item:
    where = tree.keystr(path)
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(f"ragged_plan: params leaf {where} is a {type(leaf).__name__}, not a tensor")
    if leaf.ndim == 0 or leaf.shape[0] == 0:
        raise ValueError(
            f"ragged_plan: params leaf {where} has shape {tuple(leaf.shape)}; a ragged split needs rows (dim 0 > 0)"
        )
    rows = leaf.shape[0]
    per_row = math.prod(leaf.shape[1:]) * (leaf.element_size() if balance == "bytes" else 1)
    if block == "leaf":
        return _Item(1, 1, rows * per_row, True)
    b = 1 if block is None else block
    if b < 1 or rows % b:
        raise ValueError(
            f"ragged_plan: block={b} rows does not divide the {rows} rows of params leaf {where} (shape {tuple(leaf.shape)})"
        )
    return _Item(b, rows // b, b * per_row, False)


def _assign(items: Sequence[_Item], n: int) -> list[tuple[int, ...]]:
    """Per item, the blocks each rank holds (the RaggedShard units)."""
    loads = [0] * n
    counts: list[list[int]] = [[0] * n for _ in items]
    whole = sorted((i for i, it in enumerate(items) if it.whole), key=lambda i: -items[i].weight)
    for i in whole:  # largest first onto the least loaded rank (LPT)
        r = min(range(n), key=lambda j: (loads[j], j))
        counts[i][r] = 1
        loads[r] += items[i].weight
    level = _level(loads, sum(it.weight * it.blocks for it in items if not it.whole))
    bounds, room = [], 0.0  # cumulative room of ranks 0..j-1 up to the level (the last rank takes the rest)
    for j in range(n - 1):
        room += max(0.0, level - loads[j])
        bounds.append(room)
    at = 0.0
    for i, it in enumerate(items):
        if it.whole:
            continue
        # a block goes to the first rank whose cumulative room reaches its middle
        before = [min(it.blocks, max(0, math.floor((b - at) / it.weight + 0.5))) for b in bounds] + [it.blocks]
        counts[i] = [hi - lo for lo, hi in zip([0, *before[:-1]], before)]
        at += it.weight * it.blocks
    return [tuple(c) for c in counts]


def _level(loads: Sequence[float], weight: float) -> float:
    """The water level ``L`` at which ranks of these ``loads`` take ``weight`` more in all:
    ``sum(max(0, L - load)) == weight`` (the lowest possible most-loaded rank)."""
    low = sorted(loads)
    for k in range(1, len(low) + 1):
        level = (weight + sum(low[:k])) / k
        if k == len(low) or level <= low[k]:
            return level
    raise AssertionError("unreachable")


# -- one collective for the whole group ------------------------------------------------------------


class _Group(NamedTuple):
    """The leaves of a group ragged over one axis, and how many elements of each leaf each rank
    of the axis holds (its part of the flat buffer is its pieces of every leaf, in order)."""

    mesh: Mesh
    axis: str
    shardings: list[NamedSharding]
    shapes: list[tuple[int, ...]]  # each leaf's group shape (cut by the other axes)
    counts: list[tuple[int, ...]]  # elements of each leaf on each rank of the axis

    def sizes(self, scale: Sequence[int]) -> tuple[int, ...]:
        """Length of each rank's part of the flat buffer, leaf ``i`` taking ``scale[i]`` slots per element."""
        return tuple(sum(c[j] * k for c, k in zip(self.counts, scale)) for j in range(self.mesh.axis_size(self.axis)))

    def split(self, part: torch.Tensor, j: int, scale: Sequence[int]) -> list[torch.Tensor]:
        """Rank ``j``'s part of the flat buffer cut into its pieces of each leaf."""
        return list(part.split([c[j] * k for c, k in zip(self.counts, scale)]))


def _group(xs: Sequence[Any], paths: Sequence[tree.KeyPath], what: str) -> _Group:
    shardings = []
    for path, x in zip(paths, xs):
        s = sharding_of(x) if isinstance(x, torch.Tensor) else None
        if s is None or s.ragged is None:
            got = "not a DTensor" if s is None else f"laid out as {s.spec!r}"
            raise ValueError(
                f"{what}: leaf {tree.keystr(path)} is {got}; every leaf must be ragged (vsf.device_put it with a ragged_plan)"
            )
        first = shardings[0] if shardings else s
        if s.mesh != first.mesh or s.ragged.axis != first.ragged.axis:
            raise ValueError(
                f"{what}: leaf {tree.keystr(path)} is ragged over {s.ragged.axis!r} on {s.mesh!r}, but {tree.keystr(paths[0])} "
                f"over {first.ragged.axis!r} on {first.mesh!r}; one collective needs one axis"
            )
        shardings.append(s)
    if not shardings:
        raise ValueError(f"{what}: the tree has no leaves")
    axis = shardings[0].ragged.axis
    shapes = [ragged.group_shape(s, axis, tuple(x.shape)) for s, x in zip(shardings, xs)]
    counts = [
        tuple(rows * math.prod(shape[s.ragged.dims :]) for rows in s.ragged.row_counts(shape))
        for s, shape in zip(shardings, shapes)
    ]
    return _Group(shardings[0].mesh, axis, shardings, shapes, counts)


def _flat(pairs: list[tuple[tree.KeyPath, Any]]) -> tuple[list[tree.KeyPath], list[Any]]:
    return [p for p, _ in pairs], [x for _, x in pairs]


def gather_group(params: Any) -> Any:
    """Every leaf of a ragged pytree (all over one axis, e.g. placed by :func:`ragged_plan`)
    gathered over that axis with ONE :func:`vsf.ops.all_gather_v` of a flat buffer.

    Each leaf comes back as a DTensor replicated over the ragged axis (its other axes as they
    were), equal to ``vsf.device_put`` of each leaf to that layout but in one collective instead
    of one per leaf. Leaves of different dtypes travel together as bytes, so this is not
    differentiable; gradients go back with :func:`reduce_scatter_group`.

    Example::

        >>> full = vsf.sharding.gather_group(params)      # then full["w"].to_local() on each rank
    """
    pairs, treedef = tree.flatten_with_path(params)
    paths, xs = _flat(pairs)
    g = _group(xs, paths, "gather_group")
    width = [x.element_size() for x in xs]
    flat = torch.cat([_compat.dtensor_local(x).detach().contiguous().reshape(-1).view(torch.uint8) for x in xs])
    full = ops.all_gather_v(flat, g.axis, g.sizes(width), mesh=g.mesh)
    n = g.mesh.axis_size(g.axis)
    parts = [g.split(part, j, width) for j, part in enumerate(full.split(g.sizes(width)))]
    out = []
    for i, (x, s, shape) in enumerate(zip(xs, g.shardings, g.shapes)):
        value = torch.cat([parts[j][i] for j in range(n)]).view(x.dtype).reshape(shape)
        out.append(from_local(value, ragged.without_ragged(s), x.shape))
    return tree.unflatten(treedef, out)


def reduce_scatter_group(grads: Any, like: Any) -> Any:
    """Sum ``grads`` over the ragged axis of ``like`` and keep each rank's ragged piece, with ONE
    :func:`vsf.ops.reduce_scatter_v` for the whole tree (the transpose of :func:`gather_group`).

    ``grads`` has ``like``'s structure and shapes; each leaf is a DTensor laid out like
    :func:`gather_group`'s result but unreduced over the ragged axis, or a plain tensor holding
    this rank's contribution. The sum runs in the dtype all leaves promote to; each result has
    its gradient's dtype and ``like``'s layout.

    Example::

        >>> grads = vsf.sharding.reduce_scatter_group(grads, params)   # ragged, like params
    """
    pairs, treedef = tree.flatten_with_path(like)
    paths, xs = _flat(pairs)
    g = _group(xs, paths, "reduce_scatter_group")
    gs = tree.leaves(grads)
    if len(gs) != len(xs):
        raise ValueError(f"reduce_scatter_group: grads have {len(gs)} leaves, like has {len(xs)}")
    rows = [
        _contribution(grad, path, s, g.axis).reshape(math.prod(shape[: s.ragged.dims]), -1)
        for grad, path, s, shape in zip(gs, paths, g.shardings, g.shapes)
    ]
    dtype = functools.reduce(torch.promote_types, [r.dtype for r in rows])
    n, one = g.mesh.axis_size(g.axis), [1] * len(xs)
    ranges = [[s.ragged.row_range(shape, j) for s, shape in zip(g.shardings, g.shapes)] for j in range(n)]
    flat = torch.cat([rows[i][a:b].reshape(-1).to(dtype) for j in range(n) for i, (a, b) in enumerate(ranges[j])])
    mine = ops.reduce_scatter_v(flat, g.axis, g.sizes(one), mesh=g.mesh)
    axis_group = backend.axis_group(g.mesh, g.axis)
    out = []
    for i, (x, s, shape) in enumerate(zip(xs, g.shardings, g.shapes)):
        piece = backend.per_rank(mine, axis_group, lambda t, me, i=i: g.split(t, me, one)[i])
        out.append(from_local(piece.reshape(-1, *shape[s.ragged.dims :]).to(rows[i].dtype), s, x.shape))
    return tree.unflatten(treedef, out)


def _contribution(grad: Any, path: tree.KeyPath, s: NamedSharding, axis: str) -> torch.Tensor:
    """This rank's local contribution to a gradient that is unreduced over ``axis``."""
    if isinstance(grad, DTensor):
        want = NamedSharding(s.mesh, PartitionSpec(*ragged.without_ragged(s).spec, unreduced=(*s.spec.unreduced, axis)))
        if sharding_of(grad) != want:
            raise ValueError(
                f"reduce_scatter_group: grads leaf {tree.keystr(path)} is laid out as {sharding_of(grad).spec!r}, expected {want.spec!r}"
            )
        return grad.to_local()
    if not isinstance(grad, torch.Tensor):
        raise TypeError(
            f"reduce_scatter_group: grads leaf {tree.keystr(path)} is a {type(grad).__name__}, not a tensor"
        )
    return grad
