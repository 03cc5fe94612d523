"""A packed split taken apart and put together on each rank's own rows.

A dim packed over an axis (``vsf.packed("tp", k)``: ``_StridedShard(d, split_factor=k)``) is
``k`` equal pieces, rank ``i`` holding slice ``i`` of each, in piece order. So ``x.chunk(k, d)``
(``aten.split``) gives each piece split contiguously over the axis from each rank's own rows
(rank ``i``'s local tensor cut into ``k`` equal parts), and the ``cat`` of ``k`` equal pieces so
split along ``d`` (the chunk's backward) gives the packed split back (each rank's parts put
together). DTensor's rules for ``split`` and ``cat`` gather a split dim first, so the planner
offers these rules itself (:func:`rules`, asked only in a step with a packed input) and vsf runs
them (:func:`runs` says where; :func:`run` takes the local tensor apart).

Example::

    >>> rules(split_node, ((StridedShard(1, split_factor=2),),))   # one mesh dim: inputs, outputs
    [((_StridedShard(dim=1, sf=2),), (Shard(dim=1), Shard(dim=1)))]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Placement, Shard

from vsf import _compat
from vsf.jit.graph import meta_of, outputs_meta, tensor_args
from vsf.jit.plan import Placements
from vsf.sharding.placement import is_shard, kind_of, split_dim

__all__ = ["passed_through", "rules", "run", "runs", "takes_apart"]

aten = torch.ops.aten
_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})
_APART = _SPLITS | {aten.slice.Tensor}


def _arg(node: torch.fx.Node, position: int, name: str, default: Any) -> Any:
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _pieces(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(d, k)`` where ``node`` cuts its input's dim ``d`` into ``k`` equal pieces (a split), takes
    one whole piece of ``k`` (a slice: its cat's backward), or puts ``k`` equal pieces together
    along ``d`` (a cat), else ``None``."""
    if node.target in _APART:
        size = meta_of(tensor_args(node)[0]).shape
        d = _arg(node, 1 if node.target is aten.slice.Tensor else 2, "dim", 0) % len(size)
        outs = outputs_meta(node)
        piece = outs[0].shape[d]
        if node.target is aten.slice.Tensor:
            start = _arg(node, 2, "start", None) or 0
            whole = piece and size[d] % piece == 0 and start % piece == 0 and _arg(node, 4, "step", 1) == 1
            return (d, size[d] // piece) if whole and piece < size[d] else None
        return (d, len(outs)) if len(outs) > 1 and len({o.shape[d] for o in outs}) == 1 else None
    if node.target is aten.cat.default:
        ins = [meta_of(v) for v in tensor_args(node)]
        if len(ins) < 2 or not ins[0].ndim or len({t.shape for t in ins}) != 1:
            return None
        return _arg(node, 1, "dim", 0) % ins[0].ndim, len(ins)
    return None


def rules(node: torch.fx.Node, arrivals: Sequence[Sequence[Placement]]) -> list[tuple[Placements, Placements]]:
    """``node``'s rules on one mesh dim, ``(inputs, outputs)``, that take a packed split apart (a
    split into ``k`` equal pieces, or a slice of one whole piece, of an input that may arrive packed
    in ``k`` pieces, per ``arrivals``: each piece a plain shard) or put one together (a cat of ``k``
    equal pieces split alike: packed in ``k``); none for any other op."""
    found = _pieces(node)
    if found is None:
        return []
    d, k = found
    if node.target is aten.cat.default:
        return [((Shard(d),) * k, (_compat.StridedShard(d, split_factor=k),))]
    return [((g,), (Shard(d),) * len(outputs_meta(node))) for g in arrivals[0] if _packed_in(g, d, k)]


def passed_through(
    strategies: Sequence[tuple[Placements, Placements]], arrivals: Sequence[Sequence[Placement]]
) -> list[tuple[Placements, Placements]]:
    """A ``shard_map`` region's boundary op or collective (its ``strategies`` on an automatic axis)
    takes a packed split of a dim it leaves whole as it arrives, and gives it so: where a rule
    splits its first operand and result alike on a dim (each rank runs it on its piece), the same
    rule with each packed split of that dim its first operand may arrive with, since the region
    moves nothing along that dim."""
    out = []
    for ins, outs in strategies:
        first = ins[0] if ins else None
        if first is None or kind_of(first) != "shard" or tuple(outs) != (first,):
            continue
        for g in arrivals[0]:
            if kind_of(g) == "strided" and g.dim == first.dim:
                out.append(((g, *ins[1:]), (g,)))
    return out


def _packed_in(p: Placement, d: int, k: int) -> bool:
    return kind_of(p) == "strided" and p.dim == d and p.split_factor == k


def runs(node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Does vsf run ``node`` laid out as ``ins`` and ``outs`` (the per-axis choices combined) on
    the local shards? It does where one mesh dim takes a packed split of dim ``d`` apart (or puts
    one together, :func:`rules`) and every other mesh dim lays out the packed side and the pieces
    alike, without splitting ``d`` (replicated, a partial sum, a shard of another dim): cutting
    and joining along ``d`` commutes with those."""
    found = _pieces(node)
    if found is None or any(o is None for o in outs):
        return False
    d, k = found
    splits = node.target in _APART
    whole, pieces = (ins[0], outs) if splits else (outs[0], ins)
    taken = [j for j, p in enumerate(whole) if _packed_in(p, d, k)]
    if len(taken) != 1:
        return False
    for j, p in enumerate(whole):
        held = {q[j] for q in pieces if q is not None}
        if j in taken:
            if held != {Shard(d)}:
                return False
        elif held != {p} or (is_shard(p) and split_dim(p) == d):
            return False
    return True


def takes_apart(node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Is ``node`` a split or slice :func:`runs` runs (:func:`run` cuts the local tensor; a cat runs
    as it is)?"""
    return node.target in _APART and runs(node, ins, outs)


def run(node: torch.fx.Node, args: tuple[Any, ...]) -> Any:
    """The split or slice ``node`` (:func:`takes_apart`) on this rank's local tensor ``args[0]``:
    its ``k`` equal parts along the dim, one per piece (a slice: the part of its piece).

    Example::

        >>> run(split_node, (local,))      # local [4, 32]: gate's and up's 16 columns of this rank
        [tensor of [4, 16], tensor of [4, 16]]
    """
    d, k = _pieces(node)  # type: ignore[misc]
    x = args[0]
    part = x.shape[d] // k
    if node.target is aten.slice.Tensor:
        piece = (_arg(node, 2, "start", None) or 0) // outputs_meta(node)[0].shape[d]
        return aten.slice.Tensor(x, d, piece * part, (piece + 1) * part)
    return list(aten.split.Tensor(x, part, d))
