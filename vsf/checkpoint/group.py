"""The ranks that take part in a checkpoint, and the channel they coordinate on.

Under ``torchrun`` every rank takes part, over a gloo group of its own created the first time a
checkpoint is saved or loaded (a collective, so all ranks call save/load together, as they must
anyway). Its own group lets a background save run its collectives while training uses the
default group. In a plain process without a process group, and under :func:`vsf.simulate`
(where DCP cannot run its collectives), this process alone writes and reads.

A group runs one checkpoint operation at a time: a save or load first waits for the save still
being written in the background (``pending``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from vsf import runtime
from vsf.checkpoint.staging import Staging

__all__ = ["Group", "current"]


class Group:
    """Rank, size and object collectives of the checkpoint's process group (``pg=None``: this process alone)."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg) if pg is not None else 0
        self.size = dist.get_world_size(pg) if pg is not None else 1
        self.pending: Any = None  # the AsyncSave still being written, if any
        self.staging = Staging()  # host buffers for background saves

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    @property
    def dcp_kwargs(self) -> dict[str, Any]:
        """How to tell DCP who takes part."""
        return {"process_group": self.pg} if self.pg is not None else {"no_dist": True}


_LOCAL = Group(None)
_BY_WORLD: dict[int, tuple[Any, Group]] = {}


def current() -> Group:
    """The checkpoint group of this run (created on first use; call on every rank)."""
    if runtime.is_simulated() or not dist.is_initialized():
        return _LOCAL
    world = dist.group.WORLD
    entry = _BY_WORLD.get(id(world))
    if entry is None or entry[0] is not world:
        entry = (world, Group(dist.new_group(backend="gloo")))
        _BY_WORLD[id(world)] = entry
    return entry[1]
