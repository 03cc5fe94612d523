"""``load``: read a committed checkpoint into fresh tensors, resharded to the target."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from vsf import _compat, runtime
from vsf.checkpoint import boxes, commit, group as group_mod, hf, leaves
from vsf.checkpoint.format import Checkpoint, LeafRecord, read_checkpoint
from vsf.errors import CorruptCheckpointError
from vsf.checkpoint.progress import Progress
from vsf.checkpoint.saving import wait_pending
from vsf.checkpoint.storage import VerifyingReader

__all__ = ["load"]


def load(path: str | Path, target: Any = None, *, progress: bool | None = None) -> Any:
    """Load the committed checkpoint at ``path`` and return a new tree (call on every rank).

    A Hugging Face safetensors directory (``save_pretrained``'s ``model.safetensors``, or a
    sharded ``model.safetensors.index.json``) is read too, straight into the target's layouts,
    each process reading only its slices: see :func:`vsf.checkpoint.hf.load_hf`.

    ``target`` is a tree of the same structure whose tensor leaves say how each leaf should come
    back: a :class:`vsf.ShapeDtypeStruct` (``sharding=None``: a whole plain tensor in this process;
    a ``NamedSharding`` on any mesh of this run: a DTensor laid out so), or a live tensor / DTensor
    to take the layout of (it is not written to). Shapes and dtypes must match what was saved;
    the mesh, specs and number of ranks may differ. Without ``target``, leaves come back as saved,
    which needs a mesh of the same size. ``None`` in a rank's target at a saved leaf means "held
    by other ranks" (a ``vsf.pipeline`` stage's leaf on another stage's ranks): this rank reads
    nothing there and gets ``None``; every saved leaf must be asked for by some rank. A target that
    does not fit on any rank raises on every rank, naming that rank and the key path. Every byte
    read is checked against the checksums written at save time; nothing is returned unless all of
    it loaded.

    Example::

        >>> abstract = vsf.eval_shape(lambda: {"params": params, "opt": tx.init(params), "step": 0})
        >>> state = vsf.checkpoint.load("ckpt/step_100", target=abstract)
        >>> staged = vsf.eval_shape(lambda: {"params": pipe.place(params, specs)[0], "step": 0})   # onto pipeline stages
        >>> state = vsf.checkpoint.load("ckpt/step_100", target=staged)
    """
    if hf.is_hf_directory(path) and not commit.is_committed(Path(path)):
        return hf.load_hf(path, target)
    group = group_mod.current()
    wait_pending(group)
    ckpt = read_checkpoint(path)
    treedef, here, wants = _resolve_everywhere(group, ckpt, target)
    meter = Progress(f"vsf.checkpoint loading {ckpt.path}", enabled=progress if group.rank == 0 else False)
    reader = VerifyingReader(ckpt.path, ckpt.files, meter, {r.key: r.path for r in ckpt.leaves})
    whole = _compat.local_mode_disabled() if runtime.is_simulated() else contextlib.nullcontext()
    with whole:
        state = leaves.buffers(here, wants)
        plain, boxed = boxes.split(state)
        try:
            dcp.load(plain, storage_reader=reader, planner=boxes.LoadPlanner(boxed), **group.dcp_kwargs)
        except CheckpointException as e:
            damaged = _damaged(e)
            if damaged is None:
                raise
            raise damaged from e
    meter.close()
    return leaves.rebuild(treedef, here, wants, state)


def _resolve_everywhere(
    group: group_mod.Group, ckpt: Checkpoint, target: Any
) -> tuple[Any, list[LeafRecord], list[leaves.Want | None]]:
    """:func:`leaves.resolve_target` on every rank: a wrong target on any rank raises on all of them
    (naming the rank), and a saved leaf that no rank asks for is an error."""
    try:
        resolved, problem = leaves.resolve_target(ckpt, target), None
    except ValueError as e:
        resolved, problem = None, e
    reports = group.all_gather(
        (None if problem is None else str(problem), [] if resolved is None else [r.key for r in resolved[1]])
    )
    if problem is not None:
        raise problem
    for rank, (message, _) in enumerate(reports):
        if message is not None:
            raise ValueError(f"rank {rank}'s target does not fit the checkpoint: {message}")
    if target is not None:
        leaves.missing_everywhere(ckpt, [keys for _, keys in reports])
    return resolved


def _damaged(e: CheckpointException) -> CorruptCheckpointError | None:
    """The first damaged-file error among DCP's per-rank failures, if any."""
    for rank, (exc, _) in sorted(e.failures.items()):
        if isinstance(exc, CorruptCheckpointError):
            return CorruptCheckpointError(f"{exc} (found by rank {rank})")
    return None
