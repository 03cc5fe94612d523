"""``load``: read a committed checkpoint into fresh tensors, resharded to the target."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from vsf import _compat, runtime
from vsf.checkpoint import group as group_mod, leaves, ragged
from vsf.checkpoint.format import read_checkpoint
from vsf.errors import CorruptCheckpointError
from vsf.checkpoint.progress import Progress
from vsf.checkpoint.saving import wait_pending
from vsf.checkpoint.storage import VerifyingReader

__all__ = ["load"]


def load(path: str | Path, target: Any = None, *, progress: bool | None = None) -> Any:
    """Load the committed checkpoint at ``path`` and return a new tree (call on every rank).

    ``target`` is a tree of the same structure whose tensor leaves say how each leaf should come
    back: a :class:`vsf.ShapeDtypeStruct` (``sharding=None``: a whole plain tensor in this process;
    a ``NamedSharding`` on any mesh of this run: a DTensor laid out so), or a live tensor / DTensor
    to take the layout of (it is not written to). Shapes and dtypes must match what was saved;
    the mesh, specs and number of ranks may differ. Without ``target``, leaves come back as saved,
    which needs a mesh of the same size. Every byte read is checked against the checksums written
    at save time; nothing is returned unless all of it loaded.

    Example::

        >>> abstract = vsf.eval_shape(lambda: {"params": params, "opt": tx.init(params), "step": 0})
        >>> state = vsf.checkpoint.load("ckpt/step_100", target=abstract)
    """
    group = group_mod.current()
    wait_pending(group)
    ckpt = read_checkpoint(path)
    treedef, wants = leaves.resolve_target(ckpt, target)
    meter = Progress(f"vsf.checkpoint loading {ckpt.path}", enabled=progress if group.rank == 0 else False)
    reader = VerifyingReader(ckpt.path, ckpt.files, meter, {r.key: r.path for r in ckpt.leaves})
    whole = _compat.local_mode_disabled() if runtime.is_simulated() else contextlib.nullcontext()
    with whole:
        state = leaves.buffers(ckpt.leaves, wants)
        plain, ragged_leaves = ragged.split(state)
        try:
            dcp.load(plain, storage_reader=reader, planner=ragged.LoadPlanner(ragged_leaves), **group.dcp_kwargs)
        except CheckpointException as e:
            damaged = _damaged(e)
            if damaged is None:
                raise
            raise damaged from e
    meter.close()
    return leaves.rebuild(treedef, ckpt.leaves, wants, state)


def _damaged(e: CheckpointException) -> CorruptCheckpointError | None:
    """The first damaged-file error among DCP's per-rank failures, if any."""
    for rank, (exc, _) in sorted(e.failures.items()):
        if isinstance(exc, CorruptCheckpointError):
            return CorruptCheckpointError(f"{exc} (found by rank {rank})")
    return None
