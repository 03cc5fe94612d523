"""``RaggedShard``: uneven, per-rank-sized contiguous shards (veScale's meaning).

A tensor's leading ``dims`` dimensions are flattened into *rows*; the rows are split
contiguously across one mesh axis in proportion to per-rank ``units`` (0 allowed). A *unit* is
``block`` rows: ``block * prod(shape[dims:])`` elements, and it never straddles ranks. The number
of units of a tensor must be a multiple of ``sum(units)``; rank ``i`` then holds
``units[i] * (total_units // sum(units))`` units, after those of ranks ``0 .. i-1``.

A rank's local tensor has shape ``(rows_i, *shape[dims:])``: the leading dims are flattened
(for ``dims=1`` that is the global rank, like an uneven ``Shard(0)``). ``Shard`` over other mesh
axes composes on the trailing dims (``dims`` onwards); a trailing shard shrinks the unit.

Example::

    >>> r = RaggedShard("fsdp", units=(1, 2, 1, 0))
    >>> r.row_counts((8, 3))                      # 8 rows, 4 shares of 2
    (2, 4, 2, 0)
    >>> r.local_shape((8, 3), 1)
    (4, 3)
    >>> RaggedShard("fsdp", units=(1, 1), dims=2, block=4).row_counts((2, 8, 5))   # 16 rows, blocks of 4
    (8, 8)

:func:`reshard` moves a value between ``RaggedShard`` and ``Replicate`` / ``Shard(d)`` /
``Partial`` / another ``RaggedShard`` over the same axis, on local tensors, with the ragged
collectives of :mod:`vsf.ops` (exactly the data on the wire on gloo).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vsf import ops
from vsf.ops import backend
from vsf.sharding.mesh import Mesh, current_mesh
from vsf.sharding.named import Index, NamedSharding, chunk
from vsf.sharding.spec import PartitionSpec

__all__ = ["Layout", "RaggedPlacement", "RaggedShard", "devices_indices_map", "local_shape", "ragged", "reshard", "to_dtensor"]


class RaggedShard:
    """Rows of the leading ``dims`` dims split over mesh axis ``axis`` in proportion to ``units``.

    Immutable and hashable; ``repr`` round-trips.

    Example::

        >>> RaggedShard("fsdp", units=(1, 2, 1, 0))
        RaggedShard('fsdp', units=(1, 2, 1, 0), dims=1, block=1)
    """

    __slots__ = ("_axis", "_units", "_dims", "_block")

    def __init__(self, axis: str, units: Sequence[int], *, dims: int = 1, block: int = 1) -> None:
        if not isinstance(axis, str) or not axis:
            raise TypeError(f"RaggedShard needs a mesh axis name, got {axis!r}")
        if isinstance(units, (str, bytes)) or not isinstance(units, Sequence) or not all(_is_int(u) for u in units):
            raise TypeError(f"RaggedShard({axis!r}) units must be a sequence of ints, one per rank of the axis, got {units!r}")
        units = tuple(int(u) for u in units)
        if not units:
            raise ValueError(f"RaggedShard({axis!r}) needs one unit count per rank of the axis, got none")
        if any(u < 0 for u in units):
            raise ValueError(f"RaggedShard({axis!r}) units must be >= 0, got {units} (rank {next(i for i, u in enumerate(units) if u < 0)})")
        if not any(units):
            raise ValueError(f"RaggedShard({axis!r}) units are all zero {units}: some rank must hold the data")
        for name, value in (("dims", dims), ("block", block)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"RaggedShard({axis!r}) {name} must be a positive int, got {value!r}")
        for slot, value in zip(self.__slots__, (axis, units, int(dims), int(block))):
            object.__setattr__(self, slot, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RaggedShard is immutable")

    @property
    def axis(self) -> str:
        """The mesh axis the rows are split over."""
        return self._axis

    @property
    def units(self) -> tuple[int, ...]:
        """Relative share of each rank of the axis, in axis order."""
        return self._units

    @property
    def dims(self) -> int:
        """How many leading dims are flattened into rows."""
        return self._dims

    @property
    def block(self) -> int:
        """Rows per unit (a unit never straddles ranks)."""
        return self._block

    # -- layout math ------------------------------------------------------------------------

    def check(self, shape: Sequence[int], mesh: Mesh | None = None, where: str = "") -> None:
        """Raise ``ValueError`` unless this ragged split can lay out ``shape`` (on ``mesh``).

        ``where`` (e.g. a key path) is named in the message.
        """
        at = f" for {where}" if where else ""
        shape = tuple(shape)
        if mesh is not None:
            n = mesh.axis_size(self._axis)
            if len(self._units) != n:
                raise ValueError(f"{self!r}{at} has {len(self._units)} units but mesh axis {self._axis!r} has {n} ranks")
        if len(shape) < self._dims:
            raise ValueError(f"{self!r}{at} flattens {self._dims} leading dims but the tensor has shape {shape}")
        rows = math.prod(shape[: self._dims])
        if rows % self._block:
            raise ValueError(
                f"{self!r}{at}: a block of {self._block} rows does not divide the {rows} rows of dims 0..{self._dims - 1} "
                f"(shape {shape})"
            )
        blocks, share = rows // self._block, sum(self._units)
        if blocks % share:
            raise ValueError(
                f"{self!r}{at}: {blocks} blocks of {self._block} rows (shape {shape}) cannot be split in proportion "
                f"{self._units}; the block count must be a multiple of {share}"
            )

    def row_counts(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Rows (of the flattened leading dims) each rank of the axis holds."""
        self.check(shape)
        per_unit = math.prod(shape[: self._dims]) // sum(self._units)
        return tuple(u * per_unit for u in self._units)

    def row_range(self, shape: Sequence[int], index: int) -> tuple[int, int]:
        """``[start, stop)`` of the flattened rows held by rank ``index`` of the axis."""
        counts = self.row_counts(shape)
        start = sum(counts[:index])
        return start, start + counts[index]

    def local_shape(self, shape: Sequence[int], index: int) -> tuple[int, ...]:
        """Shape of rank ``index``'s local tensor: ``(rows, *shape[dims:])``."""
        return (self.row_counts(shape)[index], *shape[self._dims :])

    # -- value semantics ----------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (self._axis, self._units, self._dims, self._block)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedShard) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("RaggedShard", *self._key()))

    def __repr__(self) -> str:
        return f"RaggedShard({self._axis!r}, units={self._units!r}, dims={self._dims}, block={self._block})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, self._key())


def _rebuild(axis: str, units: tuple[int, ...], dims: int, block: int) -> RaggedShard:
    return RaggedShard(axis, units, dims=dims, block=block)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def ragged(axis: str, units: Sequence[int], *, dims: int = 1, block: int = 1) -> RaggedShard:
    """The spec entry for a ragged split: ``P(vsf.sharding.ragged("fsdp", units=(1, 2, 1, 0)), None)``.

    It stands at dim 0 and covers dims ``0 .. dims-1`` (their other entries are ``None``).

    Example::

        >>> ragged("fsdp", (3, 1), block=32)
        RaggedShard('fsdp', units=(3, 1), dims=1, block=32)
    """
    return RaggedShard(axis, units, dims=dims, block=block)


# -- composition with Shard on other axes ------------------------------------------------------------


def devices_indices_map(
    r: RaggedShard, mesh: Mesh, shape: Sequence[int], rest: PartitionSpec = PartitionSpec(), where: str = ""
) -> dict[int, Index]:
    """``{rank: (rows slice, *trailing slices)}``: which flattened rows of the leading ``r.dims``
    dims and which slice of every trailing dim each rank holds.

    ``rest`` gives the entries of the trailing dims (``shape[r.dims:]``), the way ``P`` does for a
    whole tensor; it may not use ``r.axis``.

    Example::

        >>> devices_indices_map(ragged("fsdp", (1, 3)), mesh, (8, 6), P("tp"))[1]   # fsdp=2, tp=2
        (slice(0, 2, None), slice(3, 6, None))
    """
    at = f" for {where}" if where else ""
    if r.axis in rest.axes:
        raise ValueError(f"mesh axis {r.axis!r}{at} splits the rows of {r!r} and is used again in the trailing spec {rest!r}")
    r.check(shape, mesh, where)
    trailing = NamedSharding(mesh, rest)
    return {
        rank: (slice(*r.row_range(shape, mesh.coordinate(rank)[r.axis])), *trailing.index(tuple(shape[r.dims :]), rank))
        for rank in mesh.devices
    }


# -- redistribution over one axis --------------------------------------------------------------------

Layout = Union[RaggedShard, Replicate, Shard, Partial]


def local_shape(layout: Layout, shape: Sequence[int], index: int, n: int) -> tuple[int, ...]:
    """Shape of the local tensor rank ``index`` of an ``n``-rank axis holds under ``layout``."""
    shape = tuple(shape)
    if isinstance(layout, RaggedShard):
        return layout.local_shape(shape, index)
    if isinstance(layout, Shard):
        lo, hi = chunk(0, shape[layout.dim], n, index)
        return (*shape[: layout.dim], hi - lo, *shape[layout.dim + 1 :])
    return shape


def reshard(local: torch.Tensor, shape: Sequence[int], src: Layout, dst: Layout, *, mesh: Mesh | None = None) -> torch.Tensor:
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
    if src == dst:
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
            return backend.per_rank(local, g, lambda t, me: _rows(t, dst.dims)[slice(*dst.row_range(shape, me))].clone())
        if isinstance(src, RaggedShard) and isinstance(dst, Replicate):
            return ops.all_gather_v(local, g.axis, src.row_counts(shape), mesh=g.mesh).reshape(shape)
        if isinstance(dst, RaggedShard) and isinstance(src, Partial):
            return ops.reduce_scatter_v(_rows(local, dst.dims), g.axis, dst.row_counts(shape), mesh=g.mesh)
        if isinstance(src, RaggedShard) and isinstance(dst, Partial):
            return backend.per_rank(local, g, lambda t, me: _zero_filled(t, shape, src, me))
        return _exchange_rows(local, shape, src, dst, g)

    def transpose(self) -> ops.Linear:
        return _Reshard(self.g, self.shape, _adjoint(self.dst), _adjoint(self.src))


def _adjoint(layout: Layout) -> Layout:
    """The layout of a cotangent: a replicated value's is a partial sum, and the other way round."""
    if isinstance(layout, Replicate):
        return Partial()
    return Replicate() if isinstance(layout, Partial) else layout


def _ragged_axis(src: Layout, dst: Layout) -> str:
    axes = {p.axis for p in (src, dst) if isinstance(p, RaggedShard)}
    if not axes:
        raise ValueError(f"reshard moves to or from a RaggedShard, got {src!r} -> {dst!r}; use DTensor.redistribute for the others")
    if len(axes) > 1:
        raise ValueError(f"reshard runs over one mesh axis, but {src!r} and {dst!r} name {sorted(axes)}")
    return axes.pop()


def _check_layout(layout: Layout, shape: tuple[int, ...], mesh: Mesh) -> None:
    if isinstance(layout, RaggedShard):
        layout.check(shape, mesh)
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


def _exchange_rows(local: torch.Tensor, shape: tuple[int, ...], src: Layout, dst: Layout, g: backend.AxisGroup) -> torch.Tensor:
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

    def trail(j: int) -> tuple[int, ...]:   # a row's shape on the rank holding columns ``j``
        return (*shape[r.dims : d], bounds[j][1] - bounds[j][0], *shape[d + 1 :])

    def block(rows_of: int, cols_of: int) -> int:
        return rows[rows_of] * math.prod(trail(cols_of))

    def received(t: torch.Tensor, me: int, shape_from: Any) -> list[torch.Tensor]:
        return [piece.reshape(shape_from(i)) for i, piece in enumerate(t.split([counts[i][me] for i in range(n)]))]

    if to_shard:   # i holds rows[i] x all columns; j wants all rows x columns j
        counts = tuple(tuple(block(i, j) for j in range(n)) for i in range(n))

        def pack(t: torch.Tensor, me: int) -> torch.Tensor:
            return torch.cat([t.narrow(col, lo, hi - lo).reshape(-1) for lo, hi in bounds])

        def unpack(t: torch.Tensor, me: int) -> torch.Tensor:
            return torch.cat(received(t, me, lambda i: (rows[i], *trail(me)))).reshape(local_shape(Shard(d), shape, me, n))
    else:          # i holds all rows x columns i; j wants rows[j] x all columns
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


def _exchange_runs(local: torch.Tensor, shape: tuple[int, ...], src: Layout, dst: Layout, g: backend.AxisGroup) -> torch.Tensor:
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
        for i in range(n):   # blocks arrive in source order, each block's runs in global order
            for length, _, dst_at in overlaps[i][me]:
                placed.append((dst_at, t[at : at + length]))
                at += length
        return rows_in_order(t, [piece for _, piece in sorted(placed, key=lambda p: p[0])]).reshape(local_shape(dst, shape, me, n))

    packed = backend.per_rank(local, g, pack)
    return backend.per_rank(ops.all_to_all_v(packed, g.axis, counts, mesh=g.mesh), g, unpack)


# -- carrying a ragged value as a DTensor --------------------------------------------------------------


class RaggedPlacement(Placement):
    """The DTensor placement of a :class:`RaggedShard` on its mesh dim.

    DTensor keeps it (``placements``, ``to_local()`` with per-rank sizes, the global ``shape``)
    but has no strategy for it: its ops and ``full_tensor`` / ``redistribute`` raise instead of
    computing with ``torch.chunk`` sizes. vsf moves ragged values itself (:func:`reshard`).
    """

    def __init__(self, ragged: RaggedShard) -> None:
        super().__init__()   # the C++ base must be initialised, or DTensor's checks crash
        self._ragged = ragged

    @property
    def ragged(self) -> RaggedShard:
        return self._ragged

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedPlacement) and other._ragged == self._ragged

    def __hash__(self) -> int:
        return hash(("RaggedPlacement", self._ragged))

    def __repr__(self) -> str:
        return f"RaggedPlacement({self._ragged!r})"


def to_dtensor(local: torch.Tensor, mesh: Mesh, shape: Sequence[int], r: RaggedShard) -> DTensor:
    """Wrap a rank's ragged piece (``r.local_shape(shape, index)``) as a DTensor of global ``shape``,
    replicated over the mesh's other axes.

    Example::

        >>> dt = to_dtensor(reshard(full, full.shape, Replicate(), r), mesh, full.shape, r)
        >>> dt.placements
        (RaggedPlacement(RaggedShard('fsdp', units=(1, 2, 1, 0), dims=1, block=1)),)
    """
    shape = tuple(int(s) for s in shape)
    r.check(shape, mesh)
    placements = [RaggedPlacement(r) if a == r.axis else Replicate() for a in mesh.device_axes]
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
