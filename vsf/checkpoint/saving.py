"""``save`` and ``async_save``: write a pytree as a committed checkpoint directory."""

from __future__ import annotations

import functools
import pickle
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from vsf import runtime
from vsf.checkpoint import boxes, commit, group as group_mod, leaves
from vsf.checkpoint.format import TREE, FileRecord, LeafRecord, encode_marker, encode_tree
from vsf.checkpoint.progress import Progress
from vsf.checkpoint.storage import ChecksumWriter

__all__ = ["AsyncSave", "async_save", "save", "start_save", "wait_pending"]


class AsyncSave:
    """A checkpoint being written. ``wait()`` blocks until it is committed and raises its error, if any.

    Example::

        >>> handle = vsf.checkpoint.save("ckpt/step_100", state, blocking=False)
        >>> state = train_step(state)        # safe: what is saved was copied before save returned
        >>> handle.wait()
    """

    def __init__(self, path: Path, work: Callable[[], None], *, background: bool) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(work,), name=f"vsf-checkpoint-save {path}")
            self._thread.start()
        else:
            self._run(work)

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001  (handed to whoever waits)
            self._error = e

    def done(self) -> bool:
        """True once the save has finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save has finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error else "committed"
        return f"AsyncSave({str(self.path)!r}, {state})"


def save(path: str | Path, tree: Any, *, blocking: bool = True, progress: bool | None = None) -> AsyncSave:
    """Save ``tree`` as a committed checkpoint directory at ``path`` (call on every rank).

    Leaves may be DTensors (each rank writes only the shards it owns, replicas once, ragged
    and packed ones as they are: they load as ``Shard``, whole, or with other units or parts), plain
    tensors, bool, int, float, str and None, in dicts, lists, tuples, NamedTuples and dataclasses
    registered with :mod:`vsf.tree`. A leaf may be held by some ranks only (``None`` on the others,
    as a ``vsf.pipeline`` stage's leaves are): it is saved once, from the ranks holding it, with its
    global shape; every rank passes a tree of the same structure. The directory appears atomically once complete; ``path`` must
    not exist. With ``blocking=False`` the shards are copied to host memory before this returns and
    written by a background thread: wait on the returned handle (the next save or load also waits
    for it, and raises its error if it failed). The host buffers are kept for the next background
    save (refilling warm memory is much faster than filling new memory).
    ``progress`` shows bytes and rate on stderr (default: when stderr is a terminal).

    Example::

        >>> vsf.checkpoint.save("ckpt/step_100", {"params": params, "opt": opt_state, "step": 100})
    """
    return start_save(path, tree, blocking=blocking, progress=progress)


def async_save(path: str | Path, tree: Any, *, progress: bool | None = None) -> AsyncSave:
    """``save(path, tree, blocking=False)``: returns once the shards are copied, writes in the background.

    Example::

        >>> handle = vsf.checkpoint.async_save("ckpt/step_100", state)
        >>> handle.wait()
    """
    return start_save(path, tree, blocking=False, progress=progress)


def wait_pending(group: group_mod.Group) -> None:
    """Wait for the group's background save, if any (raising its error)."""
    pending, group.pending = group.pending, None
    if pending is not None:
        pending.wait()


def start_save(
    path: str | Path, tree: Any, *, blocking: bool, progress: bool | None, on_commit: Callable[[], None] | None = None
) -> AsyncSave:
    """:func:`save`, running ``on_commit`` on rank 0 right after the checkpoint is committed."""
    final = Path(path)
    group = group_mod.current()
    wait_pending(group)
    if final.exists():
        raise FileExistsError(
            f"{final} already exists; vsf.checkpoint never overwrites (delete it or choose another path)"
        )
    slots, mine, state = leaves.flatten(tree)
    treedef, records = leaves.merge(slots, group.all_gather((pickle.dumps(slots), mine)))
    if not blocking and not runtime.is_simulated():  # (simulated leaves are gathered copies already)
        state = group.staging.stage(state)
    meter = Progress(f"vsf.checkpoint saving {final}", enabled=progress if group.rank == 0 else False)
    work = functools.partial(_write, final, group, treedef, records, state, meter, on_commit)
    handle = AsyncSave(final, work, background=not blocking)
    if blocking:
        handle.wait()
    else:
        group.pending = handle
    return handle


def _write(
    final: Path,
    group: group_mod.Group,
    treedef: Any,
    records: list[LeafRecord],
    state: dict[str, torch.Tensor],
    meter: Progress,
    on_commit: Callable[[], None] | None,
) -> None:
    if group.rank == 0:  # before any rank can create this save's staging directory
        commit.remove_stale(final)
    token = group.broadcast(uuid.uuid4().hex[:12] if group.rank == 0 else None)
    staging = commit.staging_path(final, token)
    writer = ChecksumWriter(staging, meter)
    plain, boxed = boxes.split(state)
    dcp.save(plain, storage_writer=writer, planner=boxes.SavePlanner(boxed), **group.dcp_kwargs)
    per_rank = group.all_gather(writer.records)
    failure: BaseException | None = None
    if group.rank == 0:
        try:
            _commit(final, staging, treedef, records, per_rank)
            if on_commit is not None:
                on_commit()
        except Exception as e:  # noqa: BLE001  (told to every rank below)
            failure = e
    message = group.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
    meter.close()
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"committing {final} failed on rank 0: {message}")


def _commit(
    final: Path, staging: Path, treedef: Any, records: list[LeafRecord], per_rank: list[dict[str, FileRecord]]
) -> None:
    files: dict[str, FileRecord] = {}
    for rank_files in per_rank:
        files.update(rank_files)
    files[TREE] = commit.write_file(staging, TREE, encode_tree(treedef, records))
    commit.publish(staging, final, encode_marker(files))
