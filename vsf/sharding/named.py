"""``NamedSharding``: a spec on a mesh, its layout, and its DTensor placements.

Layout is JAX's: for a divisible shape, ``devices_indices_map`` equals
``jax.sharding.NamedSharding(Mesh(np.arange(n).reshape(shape), names), spec)``'s with device id
== rank. A dimension split over several axes is split major to minor. Uneven dimensions follow
``torch.chunk`` (ceil-div) at each axis, major axis first, which is what DTensor holds: 5 rows
over 4 ranks are 2, 2, 1, 0 rows; over a 2x2 entry ``("dp", "fsdp")`` they are 2, 1, 1, 1.

Example::

    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    ...     s = vsf.NamedSharding(mesh, P("dp", "tp"))
    ...     s.shard_shape((8, 6)), s.devices_indices_map((8, 6))[3]
    ((4, 3), (slice(4, 8, None), slice(3, 6, None)))

A spec with a :class:`~vsf.sharding.spec.RaggedShard` entry (``P(vsf.ragged("fsdp", units),
...)``) flattens its leading ``dims`` dims into rows: an index then has one slice for those rows
followed by one per later dim, a local shard has shape ``(rows, *later dims)`` (see
:meth:`NamedSharding.index_view`), and the DTensor placement of its axis is a
:class:`RaggedPlacement`. A ragged entry over an axis of size 1 holds everything, like any
size-1 axis: it does not flatten anything.

A :class:`~vsf.sharding.spec.BalancedShard` entry (``P(None, vsf.balanced("cp"))``) cuts its dim
into ``2n`` chunks, rank ``i`` of ``cp`` holding chunks ``i`` and ``2n-1-i``: indices then slice
:meth:`NamedSharding.index_view`, the tensor with that dim's chunks in the ranks' order
(:func:`balanced_order`), where each rank's shard is one contiguous block; its DTensor placement
is a :class:`BalancedPlacement`.

A :class:`~vsf.sharding.spec.PackedShard` entry (``P("ep", vsf.packed("tp", 2), None)``) views
its dim as ``parts`` equal pieces, each split over its axis: indices slice
:meth:`NamedSharding.index_view`, the tensor with that dim's slices in the ranks' order (rank 0's
slice of every piece, then rank 1's, ...), where each rank's shard is one contiguous block; its
DTensor placement is ``_StridedShard(dim, split_factor=parts)``, whose local shards are exactly
those (DTensor gathers and moves it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vsf import _compat, tree
from vsf.tree import KeyPath
from vsf.sharding.mesh import Mesh, current_mesh, mesh_of
from vsf.sharding.placement import BalancedPlacement, RaggedPlacement, balanced_order, kind_of, split_dim
from vsf.sharding.spec import UNCONSTRAINED, BalancedShard, PackedShard, PartitionSpec, RaggedShard

__all__ = [
    "BalancedPlacement",
    "NamedSharding",
    "RaggedPlacement",
    "balanced_order",
    "chunk",
    "from_placements",
    "resolve",
    "sharding_of",
]

Index = tuple[slice, ...]


def chunk(start: int, stop: int, n: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``n`` ``torch.chunk`` pieces of ``[start, stop)``: ceil-div, trailing ones short or empty."""
    size = stop - start
    step = -(-size // n) if size else 0
    lo = min(start + i * step, stop)
    return lo, min(lo + step, stop)


class NamedSharding:
    """A :class:`~vsf.P` on a :class:`~vsf.Mesh`: immutable, hashable, ``repr`` round-trips.

    Example::

        >>> s = vsf.NamedSharding(mesh, P(None, "tp"))
        >>> s.is_fully_replicated
        False
    """

    __slots__ = ("_mesh", "_placements", "_spec")
    _mesh: Mesh
    _spec: PartitionSpec
    _placements: tuple[Placement, ...] | None  # (found once: :attr:`placements`)

    def __init__(self, mesh: Mesh, spec: PartitionSpec) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"NamedSharding needs a vsf.Mesh, got {type(mesh).__name__}")
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"NamedSharding needs a vsf.P spec, got {spec!r} ({type(spec).__name__})")
        for axis in spec.axes:
            if axis not in mesh.axis_names:
                raise ValueError(f"{spec!r} names mesh axis {axis!r}, which is not in the mesh {mesh.shape}")
        if spec.ragged is not None and len(spec.ragged.units) != mesh.axis_size(spec.ragged.axis):
            r = spec.ragged
            raise ValueError(
                f"{r!r} has {len(r.units)} units but mesh axis {r.axis!r} has {mesh.axis_size(r.axis)} ranks"
            )
        kinds = [
            k for k, held in (("ragged", spec.ragged), ("balanced", spec.balanced), ("packed", spec.packed)) if held
        ]
        if len(kinds) > 1:
            raise ValueError(f"{spec!r} holds a {kinds[0]} and a {kinds[1]} entry; vsf takes one of them")
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_placements", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("NamedSharding is immutable")

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def spec(self) -> PartitionSpec:
        return self._spec

    @property
    def ragged(self) -> RaggedShard | None:
        """The spec's :class:`~vsf.RaggedShard` entry when its axis is larger than 1, else ``None``."""
        r = self._spec.ragged
        return r if r is not None and self._mesh.axis_size(r.axis) > 1 else None

    @property
    def balanced(self) -> dict[int, BalancedShard]:
        """The spec's :class:`~vsf.BalancedShard` entries by dim, those whose axis is larger than 1."""
        return {d: b for d, b in self._spec.balanced.items() if self._mesh.axis_size(b.axis) > 1}

    @property
    def packed(self) -> dict[int, PackedShard]:
        """The spec's :class:`~vsf.PackedShard` entries by dim, those whose axis is larger than 1."""
        return {d: p for d, p in self._spec.packed.items() if self._mesh.axis_size(p.axis) > 1}

    def as_contiguous(self) -> "NamedSharding":
        """The same local shards read as contiguous shards of :meth:`index_view` (every balanced
        entry a plain split over its axis): what DTensor can gather and move.

        Example::

            >>> NamedSharding(mesh, P(None, vsf.balanced("cp"))).as_contiguous().spec
            P(None, 'cp')
        """
        balanced = self._spec.balanced
        entries = [balanced[d].axis if d in balanced else e for d, e in enumerate(self._spec)]
        return NamedSharding(self._mesh, PartitionSpec(*entries, unreduced=self._spec.unreduced))

    @classmethod
    def tree(cls, mesh: Mesh, specs: Any) -> Any:
        """Map every ``P`` leaf of the pytree ``specs`` to ``NamedSharding(mesh, P)``.

        Example::

            >>> shardings = vsf.NamedSharding.tree(mesh, {"w": P("tp"), "b": P()})
        """
        return tree.map_with_path(
            lambda path, p: cls._at(mesh, path, p), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    @classmethod
    def _at(cls, mesh: Mesh, path: KeyPath, p: Any) -> "NamedSharding":
        if not isinstance(p, PartitionSpec):
            raise TypeError(f"NamedSharding.tree: the spec at {tree.keystr(path)} is {p!r}, not a vsf.P")
        try:
            return cls(mesh, p)
        except ValueError as e:
            raise ValueError(f"NamedSharding.tree: the spec at {tree.keystr(path)}: {e}") from e

    # -- layout -------------------------------------------------------------------------

    def check(self, shape: Sequence[int], where: str = "") -> None:
        """Raise ``ValueError`` unless this sharding can lay out a tensor of ``shape``.

        ``where`` (e.g. a key path) is named in the message.
        """
        at = f" for {where}" if where else ""
        shape = tuple(shape)
        if len(self._spec) > len(shape):
            raise ValueError(
                f"{self._spec!r}{at} has {len(self._spec)} entries but the tensor has rank {len(shape)} (shape {shape})"
            )
        if self._spec.ragged is not None:
            self._spec.ragged.check(shape, self._mesh.axis_size(self._spec.ragged.axis), where)
        split: list[tuple[int, BalancedShard | PackedShard]] = [*self.balanced.items(), *self.packed.items()]
        for dim, b in split:
            b.check(
                shape[dim], self._mesh.axis_size(b.axis), f"{where + ' ' if where else ''}dim {dim} (shape {shape})"
            )
        for dim, entry in enumerate(self._spec):
            if entry is UNCONSTRAINED:
                raise ValueError(
                    f"{self._spec!r}{at}: P.UNCONSTRAINED (dim {dim}) is only allowed in with_sharding_constraint"
                )
        strided = {split_dim(p) for p in self.placements if kind_of(p) == "strided"}
        for dim in sorted(strided):
            if shape[dim] % self.num_shards(dim):
                axes = self._spec.entry_axes(dim)
                order = self._mesh.device_axes
                in_order = tuple(a for a in order if a in axes)
                note = (
                    ""
                    if list(order) == [a for a in self._mesh.axis_names if a in order]
                    else " (a sub-mesh keeps its parent's axis order)"
                )
                raise ValueError(
                    f"{self._spec!r}{at}: dim {dim} of size {shape[dim]} is split {self.num_shards(dim)} ways over "
                    f"{axes} ({_sizes(self._mesh, axes)}), against the mesh's axis order {order}{note}; "
                    f"DTensor needs that split to be even. Make dim {dim} divisible by "
                    f"{self.num_shards(dim)} or list the axes in mesh order {in_order}"
                )

    def num_shards(self, dim: int) -> int:
        """How many ways ``dim`` is split."""
        return math.prod(self._mesh.axis_size(a) for a in self._spec.entry_axes(dim))

    def index(self, shape: Sequence[int], rank: int) -> Index:
        """The global slice each dimension of ``rank``'s shard covers.

        With a ragged entry the first slice covers the flattened rows of its ``dims`` leading
        dims, and the others the later dims (an index into :meth:`index_view`).
        """
        coord = self._mesh.coordinate(rank)
        r, lead = self.ragged, self._lead
        out = [] if r is None else [slice(*r.row_range(shape, coord[r.axis]))]
        for dim in range(lead, len(shape)):
            lo, hi = 0, shape[dim]
            for axis in self._spec.entry_axes(dim):
                lo, hi = chunk(lo, hi, self._mesh.axis_size(axis), coord[axis])
            out.append(slice(lo, hi))
        return tuple(out)

    def runs(self, shape: Sequence[int], rank: int) -> list[list[tuple[int, int]]]:
        """Per dim, the ``[start, stop)`` ranges of the global dim that ``rank``'s shard holds, in the
        order its local tensor holds them: a balanced dim's two chunks, a packed dim's slice of each
        piece, one range on every other dim. A ragged entry's rows are not ranges of one dim
        (:meth:`index`).

        Example::

            >>> NamedSharding(mesh, P(vsf.packed("x", 3))).runs((12,), rank=1)   # x of size 2
            [[(2, 4), (6, 8), (10, 12)]]
        """
        if self.ragged is not None:
            raise ValueError(f"{self._spec} splits rows ragged: its shards are rows of the flattened dims, not runs")
        coord = self._mesh.coordinate(rank)
        cut: dict[int, BalancedShard | PackedShard] = {**self.balanced, **self.packed}
        return [
            list(cut[d].ranges(shape[d], self._mesh.axis_size(cut[d].axis), coord[cut[d].axis]))
            if d in cut
            else [(sl.start, sl.stop)]
            for d, sl in enumerate(self.index(shape, rank))
        ]

    @property
    def _lead(self) -> int:
        """How many leading dims the ragged entry flattens (0 without one)."""
        return 0 if self.ragged is None else self.ragged.dims

    def index_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (of the global shape) as :meth:`index` slices it: the leading dims of a ragged
        entry flattened into rows, a balanced dim's chunks in the ranks' order
        (:func:`balanced_order`), a packed dim's slices in the ranks' order (rank 0's slice of
        every piece, then rank 1's, ...), else ``t`` itself.

        Example::

            >>> s.index_view(full)[s.index(full.shape, rank)]     # rank's local shard
        """
        lead = self._lead
        for dim, b in self.balanced.items():
            t = t.index_select(dim, balanced_order(t.shape[dim], self._mesh.axis_size(b.axis)).to(t.device))
        for dim, p in self.packed.items():
            t = (
                t.unflatten(dim, (p.parts, self._mesh.axis_size(p.axis), -1))
                .transpose(dim, dim + 1)
                .flatten(dim, dim + 2)
            )
        return t if lead == 0 else t.reshape(math.prod(t.shape[:lead]), *t.shape[lead:])

    def devices_indices_map(self, shape: Sequence[int]) -> dict[int, Index]:
        """``{rank: index}`` for every rank of the mesh (JAX's method, rank == device id)."""
        self.check(shape)
        return {r: self.index(shape, r) for r in self._mesh.devices}

    def shard_shape(self, shape: Sequence[int], rank: int | None = None) -> tuple[int, ...]:
        """Shape of ``rank``'s shard; without ``rank``, the largest shard (ceil-div on every dim;
        with a ragged entry, the most rows any rank holds)."""
        self.check(shape)
        if rank is not None:
            return tuple(s.stop - s.start for s in self.index(shape, rank))
        if self.ragged is not None:
            return tuple(max(sizes) for sizes in zip(*(self.shard_shape(shape, r) for r in self._mesh.devices)))
        out = list(shape)
        for dim in range(len(self._spec)):
            for axis in self._spec.entry_axes(dim):
                out[dim] = -(-out[dim] // self._mesh.axis_size(axis))
        return tuple(out)

    @property
    def is_fully_replicated(self) -> bool:
        """True when every rank holds the whole, reduced value."""
        return all(self._mesh.axis_size(a) == 1 for a in self._spec.axes)

    # -- DTensor --------------------------------------------------------------------------

    @property
    def placements(self) -> tuple[Placement, ...]:
        """DTensor placements over ``mesh.device_mesh`` (``_StridedShard`` where needed), found once
        (a plan asks for those of each of a step's thousands of leaves several times)."""
        if self._placements is None:
            object.__setattr__(self, "_placements", self._find_placements())
        return self._placements

    def _find_placements(self) -> tuple[Placement, ...]:
        if any(e is UNCONSTRAINED for e in self._spec):
            raise ValueError(f"{self._spec!r} has P.UNCONSTRAINED entries, which have no placement yet")
        dm_axes = self._mesh.device_axes
        out: list[Placement] = []
        for axis in dm_axes:
            if self._mesh.axis_size(axis) == 1:
                out.append(Replicate())
                continue
            if axis in self._spec.unreduced:
                out.append(Partial())
                continue
            if self.ragged is not None and axis == self.ragged.axis:
                out.append(RaggedPlacement(self.ragged))
                continue
            balanced = next((d for d, b in self.balanced.items() if b.axis == axis), None)
            if balanced is not None:
                out.append(BalancedPlacement(balanced))
                continue
            packed = next(((d, p.parts) for d, p in self.packed.items() if p.axis == axis), None)
            if packed is not None:
                out.append(_compat.StridedShard(packed[0], split_factor=packed[1]))
                continue
            dim = next((d for d in range(len(self._spec)) if axis in self._spec.entry_axes(d)), None)
            if dim is None:
                out.append(Replicate())
                continue
            entry = self._spec.entry_axes(dim)
            later = dm_axes[dm_axes.index(axis) + 1 :]
            factor = math.prod(self._mesh.axis_size(a) for a in entry[: entry.index(axis)] if a in later)
            out.append(_compat.StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim))
        return tuple(out)

    # -- value semantics ------------------------------------------------------------------

    def _key(self) -> tuple[Mesh, PartitionSpec]:
        return (self._mesh, self._spec.normalized())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedSharding) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"NamedSharding(mesh={self._mesh!r}, spec={self._spec!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (NamedSharding, (self._mesh, self._spec))


def _sizes(mesh: Mesh, axes: Sequence[str]) -> str:
    return ", ".join(f"{a}={mesh.axis_size(a)}" for a in axes)


def resolve(s: NamedSharding | PartitionSpec, where: str = "") -> NamedSharding:
    """A ``NamedSharding`` as given, or a bare ``P`` placed on the current mesh (:func:`vsf.use_mesh`)."""
    if isinstance(s, NamedSharding):
        return s
    if isinstance(s, PartitionSpec):
        mesh = current_mesh()
        if mesh is None:
            at = f" for {where}" if where else ""
            raise ValueError(
                f"bare {s!r}{at} needs a current mesh: wrap the call in `with vsf.use_mesh(mesh):` "
                f"or pass vsf.NamedSharding(mesh, {s!r})"
            )
        return NamedSharding(mesh, s)
    raise TypeError(f"expected a NamedSharding or P{' for ' + where if where else ''}, got {s!r} ({type(s).__name__})")


def sharding_of(x: torch.Tensor) -> NamedSharding | None:
    """The ``NamedSharding`` of a DTensor (``None`` for a plain tensor).

    Axes of size 1 carry no DTensor placement, so they do not appear in the spec.
    """
    if not isinstance(x, DTensor):
        return None
    return from_placements(mesh_of(x.device_mesh), x.placements, x.ndim)


def from_placements(mesh: Mesh, placements: Sequence[Placement], ndim: int) -> NamedSharding:
    """The ``NamedSharding`` that DTensor ``placements`` (over ``mesh.device_axes``) express for a rank-``ndim`` tensor."""
    dm_axes = tuple(mesh.device_axes)
    unreduced: list[str] = []
    split: dict[int, list[str]] = {}  # dim -> the axes that split it, in mesh order
    balanced: dict[int, BalancedShard] = {}
    ragged_entry: RaggedShard | None = None
    p: Any  # a placement, read as its kind says
    for axis, p in zip(dm_axes, placements):
        k = kind_of(p)
        if k == "ragged":
            ragged_entry = p.ragged
        elif k == "balanced":
            if p.split_factor is not None:
                raise ValueError(
                    f"{p} over {axis!r} splits groups of dim {p.dim} (a merged view's), which no vsf spec names"
                )
            if p.dim in split or p.dim in balanced:
                other = split.get(p.dim) or balanced[p.dim]
                raise ValueError(
                    f"placements {tuple(placements)} split dim {p.dim} balanced over {axis!r} and over {other}: vsf has no such layout"
                )
            balanced[p.dim] = BalancedShard(axis)
        elif k == "partial":
            if p.reduce_op != "sum":
                raise ValueError(f"a {p} placement over {axis!r} has no vsf spec (only sum partials are 'unreduced')")
            unreduced.append(axis)
        elif k in ("shard", "strided"):
            if p.dim in balanced:
                raise ValueError(
                    f"placements {tuple(placements)} split dim {p.dim} balanced and over {axis!r}: vsf has no such layout"
                )
            split.setdefault(p.dim, []).append(axis)
    entries: list[Any] = [None] * ndim
    for dim, b in balanced.items():
        entries[dim] = b
    for dim, axes in split.items():
        entries[dim] = _entry_of(mesh, dim, axes, placements, dm_axes)
    if ragged_entry is not None:
        entries[0] = ragged_entry
    return NamedSharding(mesh, PartitionSpec(*entries, unreduced=unreduced).normalized())


def _entry_of(
    mesh: Mesh, dim: int, axes: list[str], placements: Sequence[Placement], dm_axes: Sequence[str]
) -> str | tuple[str, ...] | PackedShard:
    """The spec entry of ``dim`` split over ``axes``: a packed split where one axis alone splits it
    strided (its groups the packed pieces), else the axes in their major->minor order."""
    p: Any = placements[dm_axes.index(axes[0])]
    if len(axes) == 1 and kind_of(p) == "strided":
        return PackedShard(axes[0], parts=p.split_factor)
    return _entry_order(mesh, dim, axes, placements, dm_axes)


def _entry_order(
    mesh: Mesh, dim: int, axes: list[str], placements: Sequence[Placement], dm_axes: Sequence[str]
) -> tuple[str, ...]:
    """Recover the major->minor order of ``dim``'s axes from (possibly strided) placements."""
    want = [placements[dm_axes.index(a)] for a in axes]
    for order in itertools.permutations(axes):
        got = NamedSharding(mesh, PartitionSpec(*([None] * dim), order)).placements
        if [got[dm_axes.index(a)] for a in axes] == want:
            return order
    raise ValueError(f"placements {tuple(placements)} on dim {dim} match no order of axes {axes}")
