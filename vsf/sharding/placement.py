"""The placement protocol: what every stage asks of a DTensor placement, answered in one place.

A value on a mesh has one placement per mesh dim. Besides DTensor's own ``Replicate``, ``Shard``
and ``Partial``, vsf speaks three layout kinds DTensor handles in part or not at all (the
placement table of ``docs/architecture.md``):

* **strided**: DTensor's ``_StridedShard`` (``_compat.StridedShard``), a dim split into
  ``split_factor`` groups, each split over the axis (a spec listing axes against mesh order, a
  view merging a split dim into a larger one);
* **ragged**: :class:`RaggedPlacement`, leading dims flattened into rows split in proportion to
  per-rank units (DTensor holds it, vsf moves and computes on it);
* **balanced**: :class:`BalancedPlacement`, a dim cut into ``2n`` chunks, rank ``i`` holding
  chunks ``i`` and ``2n-1-i`` (each rank's local tensor is a ``Shard``'s of the balanced view).

Strategies, propagation, lowering, redistribution, buckets, checking and the spec conversion ask
the questions below instead of testing types; this module is the one place that tests a
placement's type (``tests/sharding/test_placement_protocol.py`` keeps that rule), so a new layout
kind is added here: its class, its :data:`Kind`, and its answers.

* :func:`kind_of`: which of the kinds above (the one type dispatch);
* :func:`is_shard`, :func:`split_dim`, :func:`split_factor`: does it split a dim, which, in how
  many interleaved groups;
* :func:`dtensor_native`: do DTensor's strategies and redistribution handle it;
* :func:`one_d`, :func:`per_axis`, :func:`on_dim`, :func:`contiguous`, :func:`balanced_of`, :func:`layout_of`: the
  same split seen by the per-axis solver, moved to another dim, as the DTensor placement holding
  the same local shards, balanced, as the one-axis layout :func:`vsf.sharding.ragged.reshard` moves;
* :func:`has_strided`, :func:`has_ragged`, :func:`has_balanced`: does a set of layouts hold one.

Example::

    >>> kind_of(_compat.StridedShard(0, split_factor=2)), split_factor(BalancedPlacement(1, split_factor=4))
    ('strided', 4)
    >>> contiguous(BalancedPlacement(1)), split_dim(RaggedPlacement(RaggedShard("fsdp", (1, 3))))
    (Shard(dim=1), 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from vsf import _compat
from vsf.sharding.spec import BalancedShard, RaggedShard

__all__ = [
    "BalancedPlacement",
    "Kind",
    "RaggedPlacement",
    "as_contiguous",
    "balanced_of",
    "balanced_order",
    "contiguous",
    "dtensor_native",
    "has_balanced",
    "has_ragged",
    "has_strided",
    "is_shard",
    "kind_of",
    "layout_of",
    "on_dim",
    "one_d",
    "per_axis",
    "split_dim",
    "split_factor",
]


class RaggedPlacement(Placement):
    """The DTensor placement of a :class:`~vsf.RaggedShard` on its mesh dim.

    DTensor keeps it (``placements``, ``to_local()`` with per-rank sizes, the global ``shape``)
    but has no strategy for it: its ops and ``full_tensor`` / ``redistribute`` raise instead of
    computing with ``torch.chunk`` sizes. vsf moves ragged values itself
    (:func:`vsf.device_put`, :func:`vsf.sharding.ragged.reshard`).

    Example::

        >>> [p.ragged for p in x.placements if kind_of(p) == "ragged"]
        [RaggedShard('fsdp', units=(1, 2, 1, 0), dims=1, block=1)]
    """

    def __init__(self, ragged: RaggedShard) -> None:
        super().__init__()  # the C++ base must be initialised, or DTensor's checks crash
        self._ragged = ragged

    @property
    def ragged(self) -> RaggedShard:
        """The ragged split: ``axis``, ``units``, ``dims``, ``block``."""
        return self._ragged

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedPlacement) and other._ragged == self._ragged

    def __hash__(self) -> int:
        return hash(("RaggedPlacement", self._ragged))

    def __repr__(self) -> str:
        return f"RaggedPlacement({self._ragged!r})"


class BalancedPlacement(Placement):
    """The DTensor placement of a :class:`~vsf.BalancedShard` on its mesh dim: tensor dim ``dim``
    cut into ``2n`` chunks, this rank holding chunks ``i`` and ``2n-1-i`` of its ``n`` ranks;
    with a ``split_factor`` ``g`` (inside ``vsf.jit``: a view merged the split dim into a larger
    one, ``[b, t] -> [b*t]``), the dim is ``g`` groups, each split so.

    Each rank's local tensor is exactly ``Shard(dim)``'s (``_StridedShard(dim, g)``'s) local
    tensor of the dim permuted into :func:`balanced_order`; DTensor has no strategy for it (its
    ops raise), so ``vsf.jit`` plans it (every contiguous-shard rule of an op holds on the
    chunks) and vsf moves it.

    Example::

        >>> BalancedPlacement(1)
        BalancedPlacement(dim=1)
    """

    def __init__(self, dim: int, *, split_factor: int | None = None) -> None:
        super().__init__()  # the C++ base must be initialised, or DTensor's checks crash
        self._dim, self._split_factor = int(dim), None if split_factor is None else int(split_factor)

    @property
    def dim(self) -> int:
        """The tensor dim it splits."""
        return self._dim

    @property
    def split_factor(self) -> int | None:
        """How many groups of the dim are each split balanced, where a view merged dims (``None``:
        the whole dim, a spec's layout; DTensor tells a strided shard of one group from a shard)."""
        return self._split_factor

    @property
    def groups(self) -> int:
        """How many groups of the dim are each split balanced (1 for the whole dim)."""
        return self._split_factor or 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BalancedPlacement) and (other._dim, other._split_factor) == (
            self._dim,
            self._split_factor,
        )

    def __hash__(self) -> int:
        return hash(("BalancedPlacement", self._dim, self._split_factor))

    def __repr__(self) -> str:
        sf = f", split_factor={self._split_factor}" if self._split_factor is not None else ""
        return f"BalancedPlacement(dim={self._dim}{sf})"


def balanced_order(size: int, n: int, groups: int = 1) -> torch.Tensor:
    """The positions of a dim of ``size`` in the balanced order over ``n`` ranks: chunk ``i``,
    then chunk ``2n-1-i``, for ``i = 0 .. n-1`` (each of ``groups`` equal groups so:
    ``t.index_select(dim, order)`` is the view each rank's contiguous block, or strided blocks,
    are cut from; ``argsort(order)`` undoes it).

    Example::

        >>> balanced_order(8, 2)
        tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    c = size // (2 * n * groups)
    return torch.arange(size).view(groups, 2 * n, c)[:, list(BalancedShard.chunk_order(n))].reshape(-1)


Kind = Literal["replicate", "partial", "shard", "strided", "ragged", "balanced", "other"]
"""A placement's layout kind; ``"other"`` for anything else (``None`` where a strategy has no
output, a placement vsf does not know), which no question below takes for a shard."""

_KINDS: dict[type, Kind] = {
    Replicate: "replicate",
    Partial: "partial",
    Shard: "shard",
    _compat.StridedShard: "strided",
    RaggedPlacement: "ragged",
    BalancedPlacement: "balanced",
}
_SPLITS = frozenset({"shard", "strided", "ragged", "balanced"})
_NATIVE = frozenset({"replicate", "partial", "shard", "strided"})


def kind_of(p: Any) -> Kind:
    """Which layout kind ``p`` is (a subclass counts as its base: ``Partial``'s masked variants are partial).

    Example::

        >>> kind_of(Shard(0)), kind_of(_compat.StridedShard(0, split_factor=2)), kind_of(None)
        ('shard', 'strided', 'other')
    """
    found = _KINDS.get(type(p))
    if found is not None:
        return found
    return next((k for cls, k in _KINDS.items() if isinstance(p, cls)), "other")


def is_shard(p: Any) -> bool:
    """Does ``p`` split a tensor dim (a plain, strided, ragged or balanced shard)?

    Example::

        >>> is_shard(BalancedPlacement(1)), is_shard(Partial())
        (True, False)
    """
    return kind_of(p) in _SPLITS


def split_dim(p: Any) -> int:
    """The tensor dim a shard-like placement splits (a ragged split of leading dims: dim 0).

    Example::

        >>> split_dim(_compat.StridedShard(2, split_factor=2))
        2
    """
    return 0 if kind_of(p) == "ragged" else p.dim


def split_factor(p: Any) -> int | None:
    """In how many interleaved groups ``p`` splits its dim, each group split over the axis (a
    strided shard's factor; a balanced split of a merged view's groups); ``None`` for a placement
    whose shards are contiguous blocks of the dim (or that splits nothing).

    Example::

        >>> split_factor(_compat.StridedShard(0, split_factor=2)), split_factor(BalancedPlacement(0)), split_factor(Shard(0))
        (2, None, None)
    """
    return p.split_factor if kind_of(p) in ("strided", "balanced") else None


def dtensor_native(p: Any) -> bool:
    """Do DTensor's strategies and redistribution handle ``p`` (replicated, partial, a plain or
    strided shard)? A ragged or balanced split vsf moves and plans itself.

    Example::

        >>> dtensor_native(_compat.StridedShard(0, split_factor=2)), dtensor_native(BalancedPlacement(0))
        (True, False)
    """
    return kind_of(p) in _NATIVE


def one_d(p: Any) -> Placement:
    """``p`` as the per-axis solver sees it: a strided shard is a plain shard of its dim.

    Example::

        >>> one_d(_compat.StridedShard(1, split_factor=2))
        Shard(dim=1)
    """
    return Shard(p.dim) if kind_of(p) == "strided" else p


def per_axis(placements: Sequence[Any], k: int) -> Placement:
    """Mesh dim ``k``'s placement among ``placements`` as the per-axis solver sees it: a strided
    shard of a tensor dim no other mesh dim splits (a packed split, ``vsf.packed``: its groups are
    the dim's own pieces, which a ``chunk`` of the dim takes apart) as it is, any other as
    :func:`one_d` (a strided shard's factor then counts another mesh dim's split of its dim).

    Example::

        >>> per_axis((Replicate(), _compat.StridedShard(1, split_factor=2)), 1)
        _StridedShard(dim=1, sf=2)
        >>> per_axis((_compat.StridedShard(1, split_factor=2), Shard(1)), 0)
        Shard(dim=1)
    """
    p = placements[k]
    others = (q for j, q in enumerate(placements) if j != k)
    if kind_of(p) == "strided" and not any(is_shard(q) and split_dim(q) == p.dim for q in others):
        return p
    return one_d(p)


def on_dim(p: Any, dim: int) -> Placement:
    """The same split as the shard ``p`` of tensor dim ``dim`` instead (a strided shard keeps its
    factor, a balanced split its groups); a ragged split splits leading dims only.

    Example::

        >>> on_dim(_compat.StridedShard(2, split_factor=4), 0)
        _StridedShard(dim=0, sf=4)
    """
    k = kind_of(p)
    if k == "shard":
        return Shard(dim)
    if k == "strided":
        return _compat.StridedShard(dim, split_factor=p.split_factor)
    if k == "balanced":
        return BalancedPlacement(dim, split_factor=p.split_factor)
    raise ValueError(
        f"on_dim moves a plain, strided or balanced shard to another dim (here {dim}); {p!r} is a {k} placement"
    )


def contiguous(p: Any) -> Placement:
    """The DTensor placement whose local shards are ``p``'s: a balanced split is ``Shard`` of its
    dim (a strided one's, with a split factor: its groups' chunks) in the balanced view
    (:func:`balanced_order`); every other placement is its own.

    Example::

        >>> contiguous(BalancedPlacement(1, split_factor=2))
        _StridedShard(dim=1, sf=2)
    """
    if kind_of(p) != "balanced":
        return p
    return Shard(p.dim) if p.split_factor is None else _compat.StridedShard(p.dim, split_factor=p.split_factor)


def as_contiguous(placements: Sequence[Placement] | None) -> tuple[Placement, ...] | None:
    """:func:`contiguous` of each placement: the same local shards, of the balanced view.

    Example::

        >>> as_contiguous((Replicate(), BalancedPlacement(0)))
        (Replicate(), Shard(dim=0))
    """
    return None if placements is None else tuple(contiguous(p) for p in placements)


def balanced_of(p: Any) -> BalancedPlacement:
    """The balanced split of the dim a plain or strided shard ``p`` splits, its groups being the
    strided shard's (the inverse of :func:`contiguous`; a balanced one as it is).

    Example::

        >>> balanced_of(_compat.StridedShard(0, split_factor=2))
        BalancedPlacement(dim=0, split_factor=2)
    """
    if kind_of(p) == "balanced":
        return p
    return BalancedPlacement(p.dim, split_factor=split_factor(p))


def layout_of(p: Any) -> RaggedShard | Placement:
    """``p`` as the one-axis layout :func:`vsf.sharding.ragged.reshard` moves: a ragged split's
    :class:`~vsf.RaggedShard`, every other placement itself.

    Example::

        >>> layout_of(RaggedPlacement(RaggedShard("fsdp", (1, 3))))
        RaggedShard('fsdp', units=(1, 3), dims=1, block=1)
    """
    return p.ragged if kind_of(p) == "ragged" else p


def _holds(k: Kind, layouts: Sequence[Sequence[Any] | None]) -> bool:
    return any(kind_of(p) == k for pl in layouts if pl is not None for p in pl)


def has_strided(layouts: Sequence[Sequence[Any] | None]) -> bool:
    """Does any of these layouts (placement tuples; ``None`` skipped) hold a strided shard?

    Example::

        >>> has_strided([(Shard(0),), (Replicate(), _compat.StridedShard(0, split_factor=2))])
        True
    """
    return _holds("strided", layouts)


def has_ragged(layouts: Sequence[Sequence[Any] | None]) -> bool:
    """Does any of these layouts (placement tuples; ``None`` skipped) hold a ragged split?

    Example::

        >>> has_ragged([(Shard(0),)])
        False
    """
    return _holds("ragged", layouts)


def has_balanced(layouts: Sequence[Sequence[Any] | None]) -> bool:
    """Does any of these layouts (placement tuples; ``None`` skipped) hold a balanced split?

    Example::

        >>> has_balanced([None, (BalancedPlacement(0),)])
        True
    """
    return _holds("balanced", layouts)
