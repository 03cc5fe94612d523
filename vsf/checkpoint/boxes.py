"""Leaves DCP cannot lay out, in DCP: each rank's part as boxes of the global tensor, written and
read as they are.

DCP lays out DTensors it can compute the shards of (``Shard``, ``Replicate``, and ``_StridedShard``
where another mesh dim splits the same dim first, as FSDP2 with TP makes); it cannot lay out:

* a :class:`~vsf.RaggedShard`, whose local tensor holds rows ``[lo, hi)`` of the leaf's leading
  ``dims`` dims flattened (cut on later dims by the spec's other entries). In the global tensor
  those rows are a few boxes (at most ``2 * dims - 1``: a partial leading row, whole rows, a
  partial trailing row), each a view of the local tensor's rows;
* a :class:`~vsf.PackedShard`, whose local tensor holds slice ``i`` of each of the dim's ``parts``
  pieces (a fused qkv or gate_up weight over tp), and a :class:`~vsf.BalancedShard`, whose local
  tensor holds chunks ``i`` and ``2n - 1 - i`` of the dim: one box per piece or chunk, each a view
  of the local tensor narrowed on that dim. DCP reads a packed dim's strided shard as one
  contiguous block (two ranks' chunks overlap, and a load fills the wrong columns).

vsf gives DCP one chunk per box through its public planner interface, so such a leaf is saved as
it is (each rank writes its own part, replicas once, nothing moves between ranks) into an ordinary
DCP checkpoint: it loads as ``Shard``, replicated, with other units, whole, or by DCP alone; and
any checkpoint loads into a ragged, balanced or packed target, whose boxes DCP fills from the chunks they
overlap.

Example::

    >>> s = vsf.NamedSharding(mesh, P(vsf.ragged("x", (1, 3), dims=2)))       # x of size 2
    >>> [(b.offsets, b.sizes) for b in leaf_boxes(s, (3, 4), rank=1)]          # rows 3..12 of 3x4
    [((0, 3), (1, 1)), ((1, 0), (2, 4))]
    >>> s = vsf.NamedSharding(mesh, P(vsf.packed("x", 3)))                     # q, k, v of 4 each
    >>> [(b.offsets, b.sizes) for b in leaf_boxes(s, (12,), rank=1)]
    [((2,), (2,)), ((6,), (2,)), ((10,), (2,))]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from vsf import runtime
from vsf.sharding.named import NamedSharding, sharding_of

__all__ = ["Box", "BoxedLeaf", "LoadPlanner", "SavePlanner", "leaf_boxes", "split"]


@dataclasses.dataclass(frozen=True)
class Box:
    """A box of the global tensor (``offsets``, ``sizes``) that the part ``local`` (an index of the
    local tensor) holds, read in the box's shape."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[slice, ...]


def leaf_boxes(sharding: NamedSharding, shape: Sequence[int], rank: int) -> list[Box]:
    """The boxes of the global tensor that ``rank``'s local tensor holds under a ragged, balanced or
    packed ``sharding`` (:func:`ragged_boxes`, :func:`cut_boxes`: a spec holds a ragged entry or
    balanced and packed ones, not both).

    Example::

        >>> leaf_boxes(vsf.NamedSharding(mesh, P(vsf.packed("x", 2))), (8,), rank=0)   # x of size 2
        [Box(offsets=(0,), sizes=(2,), local=(slice(0, 2, None),)), Box(offsets=(4,), ...)]
    """
    return ragged_boxes(sharding, shape, rank) if sharding.ragged is not None else cut_boxes(sharding, shape, rank)


def ragged_boxes(sharding: NamedSharding, shape: Sequence[int], rank: int) -> list[Box]:
    """The boxes of the global tensor that ``rank``'s local tensor holds under a ragged ``sharding``.

    Empty boxes are left out (a rank without rows has none), except that a tensor with no
    elements at all is one box, so that DCP still records it.
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return [Box((0,) * len(shape), shape, (slice(0, 0),))]
    dims = sharding.ragged.dims
    rows, *later = sharding.index(shape, rank)
    tail_offsets = tuple(s.start for s in later)
    tail_sizes = tuple(s.stop - s.start for s in later)
    if 0 in tail_sizes:
        return []
    return [
        Box(
            (*offsets, *tail_offsets),
            (*sizes, *tail_sizes),
            (slice(start - rows.start, start - rows.start + math.prod(sizes)),),
        )
        for start, offsets, sizes in _row_boxes(rows.start, rows.stop, shape[:dims])
    ]


def cut_boxes(sharding: NamedSharding, shape: Sequence[int], rank: int) -> list[Box]:
    """The boxes of the global tensor that ``rank``'s local tensor holds where ``sharding`` cuts a
    dim into several runs (:meth:`~vsf.NamedSharding.runs`: a balanced dim's two chunks, a packed
    dim's slice of each piece, held one after another in the local dim), every other dim its shard; one box per
    combination of runs. Empty boxes are left out, except that a tensor with no elements at all is
    one box, so that DCP still records it."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return [Box((0,) * len(shape), shape, tuple(slice(None) for _ in shape))]
    per_dim = []
    for runs in sharding.runs(shape, rank):  # (held one after another in the local dim)
        starts = itertools.accumulate((hi - lo for lo, hi in runs), initial=0)
        per_dim.append([(lo, hi - lo, slice(at, at + hi - lo)) for (lo, hi), at in zip(runs, starts) if hi > lo])
    return [
        Box(tuple(o for o, _, _ in parts), tuple(k for _, k, _ in parts), tuple(c for _, _, c in parts))
        for parts in itertools.product(*per_dim)
    ]


def _row_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``(first flat index, offsets, sizes)`` of the boxes that flat indices ``[lo, hi)`` of a
    row-major array of ``shape`` make up, in order."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [(lo, (lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, lo_in = divmod(lo, inner)
    last, hi_in = divmod(hi, inner)

    def within(i: int, a: int, b: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return [(i * inner + start, (i, *o), (1, *s)) for start, o, s in _row_boxes(a, b, shape[1:])]

    if first == last:
        return within(first, lo_in, hi_in)
    out = []
    if lo_in:
        out += within(first, lo_in, inner)
        first += 1
    if last > first:
        out.append((first * inner, (first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if hi_in:
        out += within(last, 0, hi_in)
    return out


class BoxedLeaf(NamedTuple):
    """A ragged, balanced or packed DTensor leaf, for DCP: its local tensor, global shape, and the boxes the local tensor holds."""

    local: torch.Tensor
    shape: tuple[int, ...]
    boxes: list[Box]

    def view(self, box: Box) -> torch.Tensor:
        """The part of the (contiguous) local tensor that holds ``box``, shaped like it: a view, so
        writing into it fills the local tensor."""
        return self.local[box.local].view(box.sizes)


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, BoxedLeaf]]:
    """``state`` without its ragged, balanced and packed DTensors, and those as :class:`BoxedLeaf` s (this rank's boxes)."""
    plain, boxed = {}, {}
    for key, x in state.items():
        s = sharding_of(x) if isinstance(x, DTensor) else None
        if s is None or (s.ragged is None and not s.balanced and not s.packed):
            plain[key] = x
        elif runtime.rank() in s.mesh.devices:
            local = x.to_local().contiguous()  # (buffers to load into are contiguous already: filled in place)
            boxed[key] = BoxedLeaf(local, tuple(x.shape), leaf_boxes(s, x.shape, runtime.rank()))
    return plain, boxed


class SavePlanner(DefaultSavePlanner):
    """DCP's save planner, plus one write item per box of each ragged, balanced or packed leaf.

    Example::

        >>> plain, ragged = split(state)
        >>> dcp.save(plain, storage_writer=writer, planner=SavePlanner(ragged))
    """

    def __init__(self, boxed: dict[str, BoxedLeaf]) -> None:
        super().__init__(flatten_state_dict=False)
        self._boxed = boxed

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=[*plan.items, *self._write_items()])
        return self.plan

    def _write_items(self) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(key, box.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)),
                    properties=TensorProperties.create_from_tensor(leaf.local),
                    size=torch.Size(leaf.shape),
                ),
            )
            for key, leaf in self._boxed.items()
            for box in leaf.boxes
        ]

    def resolve_data(self, write_item: WriteItem) -> Any:
        leaf = self._boxed.get(write_item.index.fqn)
        if leaf is None:
            return super().resolve_data(write_item)
        offsets = tuple(write_item.index.offset)
        return leaf.view(next(b for b in leaf.boxes if b.offsets == offsets))


class LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, plus reads into the boxes of each ragged, balanced or packed target (views of its local tensor).

    Example::

        >>> plain, ragged = split(buffers)
        >>> dcp.load(plain, storage_reader=reader, planner=LoadPlanner(ragged))   # fills every local tensor
    """

    def __init__(self, boxed: dict[str, BoxedLeaf]) -> None:
        super().__init__(flatten_state_dict=False)
        self._boxed = boxed

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        reads = [
            item
            for key, leaf in self._boxed.items()
            for item in create_read_items_for_chunk_list(
                key,
                self.metadata.state_dict_metadata[key],
                [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in leaf.boxes],
            )
        ]
        return dataclasses.replace(plan, items=[*plan.items, *reads])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        leaf = self._boxed.get(read_item.dest_index.fqn)
        if leaf is None:
            return super().resolve_tensor(read_item)
        out = leaf.view(leaf.boxes[read_item.dest_index.index])
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, start, length)
        return out
