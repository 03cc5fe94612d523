"""The spec entries that are more than axis names: a ragged split of leading dims
(:class:`RaggedShard`, ``vsf.ragged``), the balanced chunks of a causal sequence
(:class:`BalancedShard`, ``vsf.balanced``) and the pieces of a fused dim each split over an axis
(:class:`PackedShard`, ``vsf.packed``). Each is an immutable, hashable value whose ``repr``
round-trips; :mod:`vsf.sharding.spec` takes them as entries of a ``P``.

Example::

    >>> packed("tp", 2), balanced("cp")
    (PackedShard('tp', parts=2), BalancedShard('cp'))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["BalancedShard", "PackedShard", "RaggedShard", "balanced", "packed", "ragged"]


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


class PackedShard:
    """A dim viewed as ``parts`` equal consecutive pieces, each split contiguously over the ``n``
    ranks of mesh axis ``axis``: rank ``i`` holds slice ``i`` of every piece, in piece order.

    A fused weight stores several matrices one after the other along a dim (Mixtral's
    ``gate_up_proj``: gate's rows, then up's); a plain split of that dim gives one rank gate's
    rows and the other up's, so a ``chunk(parts)`` of the result needs every rank's rows. Packed,
    each rank holds its rows of gate *and* of up (transformers' "packed_colwise" tp plan), and
    the ``chunk`` gives each piece split over ``axis`` without communication. The dim must be a
    multiple of ``parts * n`` (equal pieces, each split evenly). On DTensor it is
    ``_StridedShard(dim, split_factor=parts)``. Immutable and hashable; ``repr`` round-trips.

    Example::

        >>> p = PackedShard("tp", parts=2)
        >>> p.ranges(8, 2, 1)                    # rank 1 of 2: rows 2..4 of piece 0, 6..8 of piece 1
        ((2, 4), (6, 8))
    """

    __slots__ = ("_axis", "_parts")
    _axis: str
    _parts: int

    def __init__(self, axis: str, parts: int) -> None:
        if not isinstance(axis, str) or not axis:
            raise TypeError(f"PackedShard needs a mesh axis name, got {axis!r}")
        if not _is_int(parts) or parts < 2:
            raise ValueError(
                f"PackedShard({axis!r}) parts must be an int >= 2 (the pieces packed along the dim), got {parts!r}; "
                f"one piece is the plain split {axis!r}"
            )
        object.__setattr__(self, "_axis", axis)
        object.__setattr__(self, "_parts", int(parts))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PackedShard is immutable")

    @property
    def axis(self) -> str:
        """The mesh axis each piece is split over."""
        return self._axis

    @property
    def parts(self) -> int:
        """How many equal consecutive pieces the dim holds."""
        return self._parts

    def check(self, size: int, n: int, where: str = "") -> None:
        """Raise ``ValueError`` unless a dim of ``size`` is ``parts`` equal pieces, each split
        evenly over ``n`` ranks. ``where`` (e.g. a key path and dim) is named in the message."""
        if size % (self._parts * n):
            at = f" for {where}" if where else ""
            raise ValueError(
                f"{self!r}{at}: a dim of size {size} is not {self._parts} equal pieces each split evenly over "
                f"{self._axis}={n} ranks; make it a multiple of {self._parts} * {n} = {self._parts * n}"
            )

    def ranges(self, size: int, n: int, index: int) -> tuple[tuple[int, int], ...]:
        """The ``[start, stop)`` range of the dim rank ``index`` of ``n`` holds in each piece."""
        self.check(size, n)
        piece, c = size // self._parts, size // (self._parts * n)
        return tuple((k * piece + index * c, k * piece + (index + 1) * c) for k in range(self._parts))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedShard) and (other._axis, other._parts) == (self._axis, self._parts)

    def __hash__(self) -> int:
        return hash(("PackedShard", self._axis, self._parts))

    def __repr__(self) -> str:
        return f"PackedShard({self._axis!r}, parts={self._parts})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedShard, (self._axis, self._parts))


def packed(axis: str, parts: int) -> PackedShard:
    """The spec entry of a packed split (``vsf.packed``): ``P("ep", vsf.packed("tp", parts=2), None)``
    splits each of the dim's ``parts`` equal pieces over ``tp``, rank ``i`` holding slice ``i`` of
    every piece (:class:`PackedShard`).

    Example::

        >>> packed("tp", 2)
        PackedShard('tp', parts=2)
    """
    return PackedShard(axis, parts)
