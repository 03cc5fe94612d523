"""Ragged leaves in DCP: each rank's rows, as boxes of the global tensor, written and read as they are.

DCP lays out DTensors it can compute the shards of (``Shard``, ``Replicate``, ``_StridedShard``);
a :class:`~vsf.RaggedShard` it cannot. A ragged shard's local tensor holds rows ``[lo, hi)`` of
the leaf's leading ``dims`` dims flattened (cut on later dims by the spec's other entries).
In the global tensor those rows are a few boxes (at most ``2 * dims - 1``: a partial leading
row, whole rows, a partial trailing row), and each box is a view of the local tensor. vsf gives
DCP one chunk per box through its public planner interface, so a ragged leaf is saved as it is
(each rank writes its own rows, replicas once, nothing moves between ranks) into an ordinary
DCP checkpoint: it loads as ``Shard``, replicated, with other units, whole, or by DCP alone; and
any checkpoint loads into a ragged target, whose boxes DCP fills from the chunks they overlap.

Example::

    >>> s = vsf.NamedSharding(mesh, P(vsf.ragged("x", (1, 3), dims=2)))       # x of size 2
    >>> [(b.offsets, b.sizes) for b in boxes(s, (3, 4), rank=1)]               # rows 3..12 of 3x4
    [((0, 3), (1, 1)), ((1, 0), (2, 4))]
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["Box", "LoadPlanner", "RaggedLeaf", "SavePlanner", "boxes", "split"]


@dataclasses.dataclass(frozen=True)
class Box:
    """A box of the global tensor (``offsets``, ``sizes``) that local rows ``[rows[0], rows[1])`` hold."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rows: tuple[int, int]


def boxes(sharding: NamedSharding, shape: Sequence[int], rank: int) -> list[Box]:
    """The boxes of the global tensor that ``rank``'s local tensor holds under a ragged ``sharding``.

    Empty boxes are left out (a rank without rows has none), except that a tensor with no
    elements at all is one box, so that DCP still records it.
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return [Box((0,) * len(shape), shape, (0, 0))]
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
            (start - rows.start, start - rows.start + math.prod(sizes)),
        )
        for start, offsets, sizes in _row_boxes(rows.start, rows.stop, shape[:dims])
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


class RaggedLeaf(NamedTuple):
    """A ragged DTensor leaf, for DCP: its local tensor, global shape, and the boxes the local tensor holds."""

    local: torch.Tensor
    shape: tuple[int, ...]
    boxes: list[Box]

    def view(self, box: Box) -> torch.Tensor:
        """The part of the (contiguous) local tensor that holds ``box``, shaped like it: a view, so
        writing into it fills the local tensor."""
        lo, hi = box.rows
        return self.local[lo:hi].view(box.sizes)


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, RaggedLeaf]]:
    """``state`` without its ragged DTensors, and those as :class:`RaggedLeaf` s (this rank's boxes)."""
    plain, ragged = {}, {}
    for key, x in state.items():
        s = sharding_of(x) if isinstance(x, DTensor) else None
        if s is None or s.ragged is None:
            plain[key] = x
        elif runtime.rank() in s.mesh.devices:
            local = x.to_local().contiguous()  # (buffers to load into are contiguous already: filled in place)
            ragged[key] = RaggedLeaf(local, tuple(x.shape), boxes(s, x.shape, runtime.rank()))
    return plain, ragged


class SavePlanner(DefaultSavePlanner):
    """DCP's save planner, plus one write item per box of each ragged leaf.

    Example::

        >>> plain, ragged = split(state)
        >>> dcp.save(plain, storage_writer=writer, planner=SavePlanner(ragged))
    """

    def __init__(self, ragged: dict[str, RaggedLeaf]) -> None:
        super().__init__(flatten_state_dict=False)
        self._ragged = ragged

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
            for key, leaf in self._ragged.items()
            for box in leaf.boxes
        ]

    def resolve_data(self, write_item: WriteItem) -> Any:
        leaf = self._ragged.get(write_item.index.fqn)
        if leaf is None:
            return super().resolve_data(write_item)
        offsets = tuple(write_item.index.offset)
        return leaf.view(next(b for b in leaf.boxes if b.offsets == offsets))


class LoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, plus reads into the boxes of each ragged target (views of its local tensor).

    Example::

        >>> plain, ragged = split(buffers)
        >>> dcp.load(plain, storage_reader=reader, planner=LoadPlanner(ragged))   # fills every local tensor
    """

    def __init__(self, ragged: dict[str, RaggedLeaf]) -> None:
        super().__init__(flatten_state_dict=False)
        self._ragged = ragged

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        reads = [
            item
            for key, leaf in self._ragged.items()
            for item in create_read_items_for_chunk_list(
                key,
                self.metadata.state_dict_metadata[key],
                [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in leaf.boxes],
            )
        ]
        return dataclasses.replace(plan, items=[*plan.items, *reads])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        leaf = self._ragged.get(read_item.dest_index.fqn)
        if leaf is None:
            return super().resolve_tensor(read_item)
        out = leaf.view(leaf.boxes[read_item.dest_index.index])
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, start, length)
        return out
