"""``PartitionSpec`` (``P``): how each dimension of a tensor maps onto named mesh axes.

One entry per tensor dimension, JAX's meaning:

* ``None`` - the dimension is not sharded;
* ``"tp"`` - split across the ``tp`` mesh axis;
* ``("dp", "fsdp")`` - split across both, ``dp`` major, ``fsdp`` minor;
* ``P.UNCONSTRAINED`` - let the propagator choose (only in ``with_sharding_constraint``);
* ``ragged("fsdp", units=(1, 2, 1, 0))`` (dim 0 only) - a :class:`RaggedShard`: the leading
  ``dims`` dims flattened into rows, split over ``fsdp`` in proportion to per-rank ``units``
  (veScale's ``RaggedShard``); the other entries of those dims are ``None``, later dims may be
  sharded over other axes;
* ``balanced("cp")`` - a :class:`BalancedShard`: the dim cut into ``2n`` equal chunks over the
  ``n`` ranks of ``cp``, rank ``i`` holding chunks ``i`` and ``2n-1-i`` (the load-balanced layout
  of a causal sequence).

Trailing dimensions not named are unsharded. ``unreduced`` names the axes over which the value
is a partial sum that has not been reduced yet (JAX's "unreduced"; DTensor's ``Partial``).

Example::

    >>> P("dp", None, ("fsdp", "tp"))
    P('dp', None, ('fsdp', 'tp'))
    >>> P("dp", unreduced=("tp",)).axes
    ('dp', 'tp')
    >>> P(ragged("fsdp", units=(1, 2, 1, 0)), "tp").axes
    ('fsdp', 'tp')
    >>> P("dp", balanced("cp"))
    P('dp', BalancedShard('cp'))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union, overload

__all__ = ["BalancedShard", "P", "PartitionSpec", "RaggedShard", "UNCONSTRAINED", "balanced", "ragged"]


class _Unconstrained:
    """Sentinel for a dimension whose sharding the propagator may choose."""

    _instance: "_Unconstrained | None" = None

    def __new__(cls) -> "_Unconstrained":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "P.UNCONSTRAINED"

    def __reduce__(self) -> str:
        return "UNCONSTRAINED"


UNCONSTRAINED = _Unconstrained()


class RaggedShard:
    """Rows of the leading ``dims`` dims split over mesh axis ``axis`` in proportion to ``units``.

    veScale's ``RaggedShard``: the leading ``dims`` dims are flattened into *rows*; a *unit* is
    ``block`` rows and never straddles ranks. The number of units of a tensor must be a multiple
    of ``sum(units)``; rank ``i`` of the axis holds ``units[i] * (total_units // sum(units))`` of
    them, after those of ranks ``0 .. i-1`` (0 allowed). Its local tensor has shape
    ``(rows_i, *shape[dims:])``: the leading dims flattened (for ``dims=1`` the global rank,
    like an uneven ``Shard(0)``). Immutable and hashable; ``repr`` round-trips.

    Example::

        >>> r = RaggedShard("fsdp", units=(1, 2, 1, 0))
        >>> r.row_counts((8, 3))                      # 8 rows, 4 shares of 2
        (2, 4, 2, 0)
        >>> r.local_shape((8, 3), 1)
        (4, 3)
        >>> RaggedShard("fsdp", units=(1, 1), dims=2, block=4).row_counts((2, 8, 5))   # 16 rows, blocks of 4
        (8, 8)
    """

    __slots__ = ("_axis", "_units", "_dims", "_block")
    _axis: str
    _units: tuple[int, ...]
    _dims: int
    _block: int

    def __init__(self, axis: str, units: Sequence[int], *, dims: int = 1, block: int = 1) -> None:
        if not isinstance(axis, str) or not axis:
            raise TypeError(f"RaggedShard needs a mesh axis name, got {axis!r}")
        if isinstance(units, (str, bytes)) or not isinstance(units, Sequence) or not all(_is_int(u) for u in units):
            raise TypeError(
                f"RaggedShard({axis!r}) units must be a sequence of ints, one per rank of the axis, got {units!r}"
            )
        units = tuple(int(u) for u in units)
        if not units:
            raise ValueError(f"RaggedShard({axis!r}) needs one unit count per rank of the axis, got none")
        if any(u < 0 for u in units):
            raise ValueError(
                f"RaggedShard({axis!r}) units must be >= 0, got {units} (rank {next(i for i, u in enumerate(units) if u < 0)})"
            )
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

    def check(self, shape: Sequence[int], axis_size: int | None = None, where: str = "") -> None:
        """Raise ``ValueError`` unless this ragged split can lay out ``shape`` (over an axis of
        ``axis_size`` ranks, when given). ``where`` (e.g. a key path) is named in the message."""
        at = f" for {where}" if where else ""
        shape = tuple(shape)
        if axis_size is not None and len(self._units) != axis_size:
            raise ValueError(
                f"{self!r}{at} has {len(self._units)} units but mesh axis {self._axis!r} has {axis_size} ranks"
            )
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
        return (_rebuild_ragged, self._key())


def _rebuild_ragged(axis: str, units: tuple[int, ...], dims: int, block: int) -> RaggedShard:
    return RaggedShard(axis, units, dims=dims, block=block)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def ragged(axis: str, units: Sequence[int], *, dims: int = 1, block: int = 1) -> RaggedShard:
    """The spec entry for a ragged split (``vsf.ragged``): ``P(vsf.ragged("fsdp", units=(1, 2, 1, 0)), None)``.

    It stands at dim 0 and covers dims ``0 .. dims-1`` (their other entries are ``None``).

    Example::

        >>> ragged("fsdp", (3, 1), block=32)
        RaggedShard('fsdp', units=(3, 1), dims=1, block=32)
    """
    return RaggedShard(axis, units, dims=dims, block=block)


class BalancedShard:
    """A dim cut into ``2n`` equal chunks over the ``n`` ranks of mesh axis ``axis``: rank ``i``
    holds chunks ``i`` and ``2n-1-i``, in that order (the head-tail, "zigzag" layout of ring
    attention implementations).

    With causal attention a contiguous split leaves rank 0 one block of keys to attend to and the
    last rank ``n``; with this layout every rank has ``2n + 1`` half-blocks of work. Put the
    sequence dim of every input that carries it (tokens, targets, positions) on it; ``vsf.jit``
    plans on the balanced chunks (every op that works on contiguous shards works on them; causal
    attention follows the chunk order), and ``vsf.device_get`` returns the original order.
    Immutable and hashable; ``repr`` round-trips.

    Example::

        >>> b = BalancedShard("cp")
        >>> b.chunk_order(2)                     # the balanced view holds chunks in this order
        (0, 3, 1, 2)
        >>> b.ranges(16, 2, 1)                   # rank 1 of 2 holds positions 4..8 and 8..12
        ((4, 8), (8, 12))
    """

    __slots__ = ("_axis",)
    _axis: str

    def __init__(self, axis: str) -> None:
        if not isinstance(axis, str) or not axis:
            raise TypeError(f"BalancedShard needs a mesh axis name, got {axis!r}")
        object.__setattr__(self, "_axis", axis)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("BalancedShard is immutable")

    @property
    def axis(self) -> str:
        """The mesh axis the chunks are split over."""
        return self._axis

    @staticmethod
    def chunk_order(n: int) -> tuple[int, ...]:
        """The chunks of the dim in the order ranks ``0 .. n-1`` hold them, two each."""
        return tuple(c for i in range(n) for c in (i, 2 * n - 1 - i))

    def check(self, size: int, n: int, where: str = "") -> None:
        """Raise ``ValueError`` unless a dim of ``size`` splits into ``2n`` equal chunks."""
        if size % (2 * n):
            at = f" for {where}" if where else ""
            raise ValueError(
                f"{self!r}{at}: a dim of size {size} does not split into 2 * {self._axis}={n} = {2 * n} equal chunks "
                f"(rank i holds chunks i and {2 * n - 1}-i); make it a multiple of {2 * n}"
            )

    def ranges(self, size: int, n: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two ``[start, stop)`` ranges of the dim rank ``index`` of ``n`` holds."""
        self.check(size, n)
        c = size // (2 * n)
        return tuple((k * c, (k + 1) * c) for k in (index, 2 * n - 1 - index))  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BalancedShard) and other._axis == self._axis

    def __hash__(self) -> int:
        return hash(("BalancedShard", self._axis))

    def __repr__(self) -> str:
        return f"BalancedShard({self._axis!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (BalancedShard, (self._axis,))


def balanced(axis: str) -> BalancedShard:
    """The spec entry of the balanced layout (``vsf.balanced``): ``P("dp", vsf.balanced("cp"))``
    puts a batch's sequences on ``dp`` and each sequence over ``cp`` in ``2 * cp`` chunks, rank
    ``i`` holding chunks ``i`` and ``2 * cp - 1 - i`` (:class:`BalancedShard`).

    Example::

        >>> balanced("cp")
        BalancedShard('cp')
    """
    return BalancedShard(axis)


Entry = Union[None, str, tuple[str, ...], _Unconstrained, RaggedShard, BalancedShard]


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None or entry is UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (RaggedShard, BalancedShard)):
        return (entry.axis,)
    return entry


def _normalize_entry(entry: Any, dim: int) -> Entry:
    if entry is None or entry is UNCONSTRAINED or isinstance(entry, (str, BalancedShard)):
        return entry
    if isinstance(entry, RaggedShard):
        if dim != 0:
            raise ValueError(
                f"a RaggedShard entry splits the leading dims and must be the first entry of a P, got {entry!r} at dim {dim}"
            )
        return entry
    if isinstance(entry, (tuple, list)):
        if not all(isinstance(a, str) for a in entry):
            raise TypeError(f"P entry for dim {dim} must name mesh axes as strings, got {entry!r}")
        if len(entry) == 0:
            return None
        return entry[0] if len(entry) == 1 else tuple(entry)
    raise TypeError(
        f"P entry for dim {dim} must be None, an axis name, a tuple of axis names, vsf.balanced(axis) or "
        f"P.UNCONSTRAINED, got {entry!r} ({type(entry).__name__})"
    )


class PartitionSpec:
    """Immutable, hashable spec: one entry per tensor dimension (see module docs)."""

    UNCONSTRAINED = UNCONSTRAINED
    __slots__ = ("_entries", "_unreduced")
    _entries: tuple[Entry, ...]
    _unreduced: tuple[str, ...]

    def __init__(self, *entries: Any, unreduced: str | Iterable[str] = ()) -> None:
        normalized = tuple(_normalize_entry(e, i) for i, e in enumerate(entries))
        unreduced = (unreduced,) if isinstance(unreduced, str) else tuple(unreduced)
        if not all(isinstance(a, str) for a in unreduced):
            raise TypeError(f"unreduced must name mesh axes as strings, got {unreduced!r}")
        reduced_axes = tuple(sorted(set(unreduced)))
        if normalized and isinstance(normalized[0], RaggedShard):
            covered = [i for i, e in enumerate(normalized[1 : normalized[0].dims], 1) if e is not None]
            if covered:
                raise ValueError(
                    f"in P{_fmt(normalized, reduced_axes)} the RaggedShard flattens dims 0..{normalized[0].dims - 1} into rows, "
                    f"so their other entries must be None; dim {covered[0]} is {normalized[covered[0]]!r}"
                )
        seen: dict[str, str] = {}
        for i, e in enumerate(normalized):
            for a in _entry_axes(e):
                if a in seen:
                    raise ValueError(
                        f"mesh axis {a!r} is used twice in P{_fmt(normalized, reduced_axes)}: by {seen[a]} and by dim {i}"
                    )
                seen[a] = f"dim {i}"
        for a in reduced_axes:
            if a in seen:
                raise ValueError(
                    f"mesh axis {a!r} in P{_fmt(normalized, reduced_axes)} both shards {seen[a]} and is unreduced"
                )
        object.__setattr__(self, "_entries", normalized)
        object.__setattr__(self, "_unreduced", reduced_axes)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PartitionSpec is immutable")

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, i: int) -> Entry: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Entry, ...]: ...

    def __getitem__(self, i: int | slice) -> Entry | tuple[Entry, ...]:
        return self._entries[i]

    @property
    def unreduced(self) -> tuple[str, ...]:
        """Axes over which the value is an unreduced partial sum (sorted)."""
        return self._unreduced

    @property
    def ragged(self) -> RaggedShard | None:
        """The :class:`RaggedShard` entry (dim 0), or ``None``."""
        first = self._entries[0] if self._entries else None
        return first if isinstance(first, RaggedShard) else None

    @property
    def balanced(self) -> dict[int, BalancedShard]:
        """The :class:`BalancedShard` entries by dim.

        Example::

            >>> P("dp", balanced("cp")).balanced
            {1: BalancedShard('cp')}
        """
        return {d: e for d, e in enumerate(self._entries) if isinstance(e, BalancedShard)}

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec mentions (sharding or unreduced)."""
        return tuple(a for e in self._entries for a in _entry_axes(e)) + self._unreduced

    def entry_axes(self, dim: int) -> tuple[str, ...]:
        """Mesh axes that split ``dim``, major to minor (empty when unsharded or out of range)."""
        return _entry_axes(self._entries[dim]) if dim < len(self._entries) else ()

    def without(self, axes: Iterable[str]) -> "PartitionSpec":
        """The spec with the mesh ``axes`` taken out: each dim keeps the other axes that split it,
        in order, and a ragged or balanced entry over a removed axis becomes ``None`` (the value
        gathered over ``axes``).

        Example::

            >>> P(("fsdp", "tp"), "dp").without(("fsdp", "dp"))
            P('tp', None)
        """
        drop = set(axes)

        def kept(entry: Entry) -> Entry:
            if entry is UNCONSTRAINED or not drop.intersection(_entry_axes(entry)):
                return entry
            rest = tuple(a for a in _entry_axes(entry) if a not in drop) if isinstance(entry, tuple) else ()
            return rest or None

        return PartitionSpec(
            *(kept(e) for e in self._entries), unreduced=tuple(a for a in self._unreduced if a not in drop)
        )

    def normalized(self) -> "PartitionSpec":
        """The same spec without trailing ``None`` entries."""
        entries = list(self._entries)
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries, unreduced=self._unreduced)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartitionSpec) and (self._entries, self._unreduced) == (
            other._entries,
            other._unreduced,
        )

    def __hash__(self) -> int:
        return hash((self._entries, self._unreduced))

    def __repr__(self) -> str:
        return "P" + _fmt(self._entries, self._unreduced)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._entries, self._unreduced))


def _rebuild(entries: tuple[Entry, ...], unreduced: tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*entries, unreduced=unreduced)


def _fmt(entries: tuple[Entry, ...], unreduced: tuple[str, ...]) -> str:
    parts = [repr(e) for e in entries]
    if unreduced:
        parts.append(f"unreduced={unreduced!r}")
    return "(" + ", ".join(parts) + ")"


P = PartitionSpec
