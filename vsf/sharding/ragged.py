"""Moving ragged values: :func:`reshard` between a :class:`RaggedShard` and the other layouts of one axis.

A :class:`RaggedShard` (defined with ``P`` in :mod:`vsf.sharding.spec`, veScale's meaning)
flattens a tensor's leading ``dims`` dims into rows and splits them contiguously over one mesh
axis in proportion to per-rank ``units``; a rank's local tensor has shape
``(rows_i, *shape[dims:])``. ``Shard`` over other mesh axes composes on the later dims.

:func:`reshard` moves a value between ``RaggedShard`` and ``Replicate`` / ``Shard(d)`` /
``Partial`` / another ``RaggedShard`` over the same axis, on local tensors, with the ragged
collectives of :mod:`vsf.ops` (exactly the data on the wire on gloo). :func:`vsf.device_put`
uses it for DTensors; the lowering of a plan can call it on local shards.

**Getting at a ragged DTensor** (e.g. to save it as it is and reload it as ``Shard``)::

    x.to_local()                          # this rank's rows: shape (rows_i, *shape[dims:])
    x.shape                               # the global shape
    s = vsf.sharding.sharding_of(x)       # NamedSharding; s.spec.ragged is the RaggedShard
    r = s.spec.ragged                     # r.axis, r.units, r.dims, r.block
    s.index(x.shape, rank)                # rows slice (of s.index_view(full)), then later dims
    vsf.sharding.from_local(local, s, shape)   # and back to a DTensor, no communication

Example::

    >>> with vsf.use_mesh(mesh):                      # fsdp of size 4
    ...     mine = reshard(full, (8, 3), Replicate(), ragged("fsdp", (1, 2, 1, 0)))
    ...     back = reshard(mine, (8, 3), ragged("fsdp", (1, 2, 1, 0)), Shard(1))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import ops
from vsf.ops import backend
from vsf.sharding.mesh import Mesh, current_mesh
from vsf.sharding.named import NamedSharding, RaggedPlacement, chunk
from vsf.sharding.spec import PartitionSpec, RaggedShard, ragged

__all__ = [
    "Layout",
    "RaggedPlacement",
    "RaggedShard",
    "group_shape",
    "local_shape",
    "ragged",
    "reshard",
    "without_ragged",
]


# -- redistribution over one axis --------------------------------------------------------------------

Layout = Union[RaggedShard, Replicate, Shard, Partial]


def group_shape(s: NamedSharding, axis: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the value this process's group of ``axis`` holds: ``shape`` cut by every
    other mesh axis of ``s`` (the ``shape`` :func:`reshard` takes for a value laid out as ``s``).

    Under simulation one call serves every group, so they must all hold the same shape.

    Example::

        >>> group_shape(vsf.NamedSharding(mesh, P(ragged("fsdp", (1, 3)), "tp")), "fsdp", (8, 6))   # tp=2
        (8, 3)
    """
    shape = tuple(shape)
    entries = [
        None if isinstance(e, RaggedShard) else tuple(a for a in s.spec.entry_axes(d) if a != axis) or None
        for d, e in enumerate(s.spec)
    ]
    others = NamedSharding(s.mesh, PartitionSpec(*entries))
    shapes = {others.shard_shape(shape, r) for r in backend.local_ranks()}
    if len(shapes) > 1:
        raise ValueError(
            f"under vsf.simulate a ragged redistribution over {axis!r} needs the other mesh axes of {s.spec!r} to split "
            f"shape {shape} evenly, but the groups of {axis!r} hold shapes {sorted(shapes)}; real processes have no such limit"
        )
    return shapes.pop()


def without_ragged(s: NamedSharding) -> NamedSharding:
    """``s`` with its ragged entry replaced by ``None``: replicated over that axis, the rest as it is.

    Example::

        >>> without_ragged(vsf.NamedSharding(mesh, P(ragged("fsdp", (1, 3)), "tp"))).spec
        P(None, 'tp')
    """
    return NamedSharding(s.mesh, PartitionSpec(None, *s.spec[1:], unreduced=s.spec.unreduced))


def local_shape(layout: Layout, shape: Sequence[int], index: int, n: int) -> tuple[int, ...]:
    """Shape of the local tensor rank ``index`` of an ``n``-rank axis holds under ``layout``."""
    shape = tuple(shape)
    if isinstance(layout, RaggedShard):
        return layout.local_shape(shape, index)
    if isinstance(layout, Shard):
        lo, hi = chunk(0, shape[layout.dim], n, index)
        return (*shape[: layout.dim], hi - lo, *shape[layout.dim + 1 :])
    return shape


def reshard(
    local: torch.Tensor, shape: Sequence[int], src: Layout, dst: Layout, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Move a value from layout ``src`` to ``dst`` over one mesh axis, on local tensors.

    ``shape`` is the logical shape over that axis (the global shape, or the shard of it that
    the other mesh axes leave to this axis's group). One of ``src`` / ``dst`` is a
    :class:`RaggedShard`, which names the axis; the other is ``Replicate()``, ``Shard(d)``,
    ``Partial()`` or another ``RaggedShard`` over the same axis. Communication:

    * Replicate -> Ragged, Ragged -> Partial: none (slice; zero-fill the other rows).
    * Ragged -> Replicate: :func:`vsf.ops.all_gather_v`; Partial -> Ragged: :func:`vsf.ops.reduce_scatter_v`.
    * Ragged <-> Shard(d), Ragged -> Ragged: one :func:`vsf.ops.all_to_all_v` that sends each
      rank exactly the rows it lacks.

    It is differentiable: the backward runs the transposed redistribution (``dst -> src`` with
    Replicate and Partial swapped), the convention of :mod:`vsf.ops`.

    Example::

        >>> mine = reshard(full, (8, 3), Replicate(), ragged("fsdp", (1, 2, 1, 0)))
        >>> back = reshard(mine, (8, 3), ragged("fsdp", (1, 2, 1, 0)), Shard(1))
    """
    shape = tuple(int(s) for s in shape)
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError("reshard needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
    axis = _ragged_axis(src, dst)
    for layout in (src, dst):
        _check_layout(layout, shape, mesh)
    if src == dst or _same_rows(src, dst, shape):
        return local
    if mesh.axis_size(axis) == 1:
        return local.reshape(local_shape(dst, shape, 0, 1))
    return ops.apply_linear(local, _Reshard(backend.axis_group(mesh, axis), shape, src, dst))


@dataclass(frozen=True)
class _Reshard(ops.Linear):
    """``src -> dst`` over one axis group; its transpose swaps them, Replicate <-> Partial."""

    g: backend.AxisGroup
    shape: tuple[int, ...]
    src: Layout
    dst: Layout

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        g, shape, src, dst = self.g, self.shape, self.src, self.dst
        if isinstance(dst, RaggedShard) and isinstance(src, Replicate):
            return backend.per_rank(
                local, g, lambda t, me: _rows(t, dst.dims)[slice(*dst.row_range(shape, me))].clone()
            )
        if isinstance(src, RaggedShard) and isinstance(dst, Replicate):
            return ops.all_gather_v(local, g.axis, src.row_counts(shape), mesh=g.mesh).reshape(shape)
        if isinstance(dst, RaggedShard) and isinstance(src, Partial):
            return ops.reduce_scatter_v(_rows(local, dst.dims), g.axis, dst.row_counts(shape), mesh=g.mesh)
        if isinstance(src, RaggedShard) and isinstance(dst, Partial):
            return backend.per_rank(local, g, lambda t, me: _zero_filled(t, shape, src, me))
        return _exchange_rows(local, shape, src, dst, g)

    def transpose(self) -> ops.Linear:
        return _Reshard(self.g, self.shape, _adjoint(self.dst), _adjoint(self.src))


def _same_rows(src: Layout, dst: Layout, shape: tuple[int, ...]) -> bool:
    """Two ragged splits that give every rank the same rows of ``shape`` (e.g. units ``(4, 0)`` and ``(1, 0)``)."""
    both = isinstance(src, RaggedShard) and isinstance(dst, RaggedShard)
    return both and src.dims == dst.dims and src.row_counts(shape) == dst.row_counts(shape)


def _adjoint(layout: Layout) -> Layout:
    """The layout of a cotangent: a replicated value's is a partial sum, and the other way round."""
    if isinstance(layout, Replicate):
        return Partial()
    return Replicate() if isinstance(layout, Partial) else layout


def _ragged_axis(src: Layout, dst: Layout) -> str:
    axes = {p.axis for p in (src, dst) if isinstance(p, RaggedShard)}
    if not axes:
        raise ValueError(
            f"reshard moves to or from a RaggedShard, got {src!r} -> {dst!r}; use DTensor.redistribute for the others"
        )
    if len(axes) > 1:
        raise ValueError(f"reshard runs over one mesh axis, but {src!r} and {dst!r} name {sorted(axes)}")
    return axes.pop()


def _check_layout(layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> None:
    if isinstance(layout, RaggedShard):
        layout.check(shape, mesh.axis_size(layout.axis))
    elif isinstance(layout, Shard) and not 0 <= layout.dim < len(shape):
        raise ValueError(f"{layout!r} names dim {layout.dim} but the tensor has shape {shape}")
    elif isinstance(layout, Partial) and layout.reduce_op != "sum":
        raise ValueError(f"reshard handles sum partials only, got {layout!r}")
    elif not isinstance(layout, (RaggedShard, Replicate, Shard, Partial)):
        raise TypeError(f"reshard layouts are RaggedShard, Replicate, Shard or Partial, got {layout!r}")


def _rows(t: torch.Tensor, dims: int) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:dims]), *t.shape[dims:])


def _zero_filled(t: torch.Tensor, shape: tuple[int, ...], r: RaggedShard, me: int) -> torch.Tensor:
    full = t.new_zeros((math.prod(shape[: r.dims]), *shape[r.dims :]))
    start, stop = r.row_range(shape, me)
    full[start:stop] = t
    return full.reshape(shape)


def _exchange_rows(
    local: torch.Tensor, shape: tuple[int, ...], src: Layout, dst: Layout, g: backend.AxisGroup
) -> torch.Tensor:
    """One all-to-all that sends every rank exactly the elements ``dst`` gives it and it lacks.

    A ``Shard`` of a dim the ragged layout keeps whole is a split of columns
    (:func:`_exchange_columns`); otherwise both layouts hold runs of whole rows of the leading
    dims (:func:`_exchange_runs`).
    """
    ragged_layout = src if isinstance(src, RaggedShard) else dst
    shard = next((p for p in (src, dst) if isinstance(p, Shard)), None)
    if shard is not None and shard.dim >= ragged_layout.dims:
        return _exchange_columns(local, shape, ragged_layout, shard.dim, src is ragged_layout, g)
    return _exchange_runs(local, shape, src, dst, g)


def _exchange_columns(
    local: torch.Tensor, shape: tuple[int, ...], r: RaggedShard, d: int, to_shard: bool, g: backend.AxisGroup
) -> torch.Tensor:
    """Ragged rows <-> ``Shard(d)`` with ``d >= r.dims``: rank ``i`` sends rank ``j`` the block
    (ragged rows of one side) x (columns of ``d`` of the other)."""
    n, col = g.size, 1 + d - r.dims
    rows = r.row_counts(shape)
    starts = [sum(rows[:j]) for j in range(n)]
    bounds = [chunk(0, shape[d], n, j) for j in range(n)]

    def trail(j: int) -> tuple[int, ...]:  # a row's shape on the rank holding columns ``j``
        return (*shape[r.dims : d], bounds[j][1] - bounds[j][0], *shape[d + 1 :])

    def block(rows_of: int, cols_of: int) -> int:
        return rows[rows_of] * math.prod(trail(cols_of))

    def received(t: torch.Tensor, me: int, shape_from: Any) -> list[torch.Tensor]:
        return [piece.reshape(shape_from(i)) for i, piece in enumerate(t.split([counts[i][me] for i in range(n)]))]

    if to_shard:  # i holds rows[i] x all columns; j wants all rows x columns j
        counts = tuple(tuple(block(i, j) for j in range(n)) for i in range(n))

        def pack(t: torch.Tensor, me: int) -> torch.Tensor:
            return torch.cat([t.narrow(col, lo, hi - lo).reshape(-1) for lo, hi in bounds])

        def unpack(t: torch.Tensor, me: int) -> torch.Tensor:
            return torch.cat(received(t, me, lambda i: (rows[i], *trail(me)))).reshape(
                local_shape(Shard(d), shape, me, n)
            )
    else:  # i holds all rows x columns i; j wants rows[j] x all columns
        counts = tuple(tuple(block(j, i) for j in range(n)) for i in range(n))

        def pack(t: torch.Tensor, me: int) -> torch.Tensor:
            flat = t.reshape(sum(rows), *trail(me))
            return torch.cat([flat[starts[j] : starts[j] + rows[j]].reshape(-1) for j in range(n)])

        def unpack(t: torch.Tensor, me: int) -> torch.Tensor:
            return torch.cat(received(t, me, lambda i: (rows[me], *trail(i))), col)

    packed = backend.per_rank(local, g, pack)
    return backend.per_rank(ops.all_to_all_v(packed, g.axis, counts, mesh=g.mesh), g, unpack)


Run = tuple[int, int]  # (first global row, number of rows)


def _runs(layout: Layout, shape: tuple[int, ...], lead: int, index: int, n: int) -> list[Run]:
    """The rows of the leading ``lead`` dims that rank ``index`` holds, as runs in its local
    order (which is ascending global order)."""
    if isinstance(layout, RaggedShard):
        start, stop = layout.row_range(shape, index)
        per_row = math.prod(shape[layout.dims : lead])
        return [(start * per_row, (stop - start) * per_row)] if stop > start else []
    lo, hi = chunk(0, shape[layout.dim], n, index)
    inner = math.prod(shape[layout.dim + 1 : lead])
    if hi == lo or inner == 0:
        return []
    return [((a * shape[layout.dim] + lo) * inner, (hi - lo) * inner) for a in range(math.prod(shape[: layout.dim]))]


def _overlaps(a: list[Run], b: list[Run]) -> list[tuple[int, int, int]]:
    """``(length, offset in a's rows, offset in b's rows)`` of every overlap, in global order."""
    out, i, j, off_a, off_b = [], 0, 0, 0, 0
    while i < len(a) and j < len(b):
        (sa, la), (sb, lb) = a[i], b[j]
        lo, hi = max(sa, sb), min(sa + la, sb + lb)
        if lo < hi:
            out.append((hi - lo, off_a + lo - sa, off_b + lo - sb))
        if sa + la <= sb + lb:
            i, off_a = i + 1, off_a + la
        else:
            j, off_b = j + 1, off_b + lb
    return out


def _exchange_runs(
    local: torch.Tensor, shape: tuple[int, ...], src: Layout, dst: Layout, g: backend.AxisGroup
) -> torch.Tensor:
    """Layouts that hold whole rows of the leading dims (RaggedShard, Shard of a leading dim):
    rank ``i`` sends rank ``j`` the runs of rows ``i`` holds and ``j`` wants, and ``j`` puts the
    runs it receives in its local order."""
    n = g.size
    lead = max(p.dims if isinstance(p, RaggedShard) else p.dim + 1 for p in (src, dst))
    trailing = shape[lead:]
    held = [_runs(src, shape, lead, i, n) for i in range(n)]
    wanted = [_runs(dst, shape, lead, j, n) for j in range(n)]
    overlaps = [[_overlaps(held[i], wanted[j]) for j in range(n)] for i in range(n)]
    counts = tuple(tuple(sum(length for length, _, _ in overlaps[i][j]) for j in range(n)) for i in range(n))

    def rows_in_order(rows: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([rows.new_empty((0, *trailing)), *pieces])

    def pack(t: torch.Tensor, me: int) -> torch.Tensor:
        rows = t.reshape(sum(length for _, length in held[me]), *trailing)
        return rows_in_order(rows, [rows[at : at + length] for j in range(n) for length, at, _ in overlaps[me][j]])

    def unpack(t: torch.Tensor, me: int) -> torch.Tensor:
        at, placed = 0, []
        for i in range(n):  # blocks arrive in source order, each block's runs in global order
            for length, _, dst_at in overlaps[i][me]:
                placed.append((dst_at, t[at : at + length]))
                at += length
        return rows_in_order(t, [piece for _, piece in sorted(placed, key=lambda p: p[0])]).reshape(
            local_shape(dst, shape, me, n)
        )

    packed = backend.per_rank(local, g, pack)
    return backend.per_rank(ops.all_to_all_v(packed, g.axis, counts, mesh=g.mesh), g, unpack)
