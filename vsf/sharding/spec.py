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
  of a causal sequence);
* ``packed("tp", parts=2)`` - a :class:`PackedShard`: the dim viewed as ``parts`` equal
  consecutive pieces (a fused weight's gate and up rows), each split over ``tp``, rank ``i``
  holding its slice of every piece (transformers' "packed_colwise").

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
    >>> P("ep", packed("tp", parts=2), None)
    P('ep', PackedShard('tp', parts=2), None)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Union, overload

from vsf.sharding.entries import BalancedShard, PackedShard, RaggedShard, balanced, packed, ragged

__all__ = [
    "BalancedShard",
    "P",
    "PackedShard",
    "PartitionSpec",
    "RaggedShard",
    "UNCONSTRAINED",
    "balanced",
    "packed",
    "ragged",
]


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


Entry = Union[None, str, tuple[str, ...], _Unconstrained, RaggedShard, BalancedShard, PackedShard]


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None or entry is UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (RaggedShard, BalancedShard, PackedShard)):
        return (entry.axis,)
    return entry


def _normalize_entry(entry: Any, dim: int) -> Entry:
    if entry is None or entry is UNCONSTRAINED or isinstance(entry, (str, BalancedShard, PackedShard)):
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
        f"P entry for dim {dim} must be None, an axis name, a tuple of axis names, vsf.balanced(axis), "
        f"vsf.packed(axis, parts) or P.UNCONSTRAINED, got {entry!r} ({type(entry).__name__})"
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
    def packed(self) -> dict[int, PackedShard]:
        """The :class:`PackedShard` entries by dim.

        Example::

            >>> P("ep", packed("tp", 2)).packed
            {1: PackedShard('tp', parts=2)}
        """
        return {d: e for d, e in enumerate(self._entries) if isinstance(e, PackedShard)}

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec mentions (sharding or unreduced)."""
        return tuple(a for e in self._entries for a in _entry_axes(e)) + self._unreduced

    def entry_axes(self, dim: int) -> tuple[str, ...]:
        """Mesh axes that split ``dim``, major to minor (empty when unsharded or out of range)."""
        return _entry_axes(self._entries[dim]) if dim < len(self._entries) else ()

    def without(self, axes: Iterable[str]) -> "PartitionSpec":
        """The spec with the mesh ``axes`` taken out: each dim keeps the other axes that split it,
        in order, and a ragged, balanced or packed entry over a removed axis becomes ``None`` (the
        value gathered over ``axes``).

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
