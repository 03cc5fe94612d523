"""Atomic publication of a checkpoint directory on a POSIX file system.

Every rank writes into a staging directory next to the final one (``.<name>.tmp-<token>``).
Rank 0 then writes ``tree.json`` and the commit marker, fsyncs them and the staging directory,
renames it to the final name and fsyncs the parent. A crash at any point leaves either no final
directory (the staging one is ignored, and removed by the next save of the same name) or a
complete, committed one. Deletion is the same in reverse: rename away, then remove.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from vsf.checkpoint.format import MARKER, FileRecord

__all__ = ["is_committed", "move_into_place", "publish", "remove", "remove_stale", "staging_path", "write_file"]


def staging_path(final: Path, token: str) -> Path:
    """Where a save of ``final`` writes before it is committed (hidden, never listed)."""
    return final.parent / f".{final.name}.tmp-{token}"


def remove_stale(final: Path) -> None:
    """Remove staging directories left for ``final`` by interrupted saves."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def is_committed(path: Path) -> bool:
    """True when ``path`` is a directory holding a commit marker."""
    return (path / MARKER).is_file()


def write_file(directory: Path, name: str, data: bytes) -> FileRecord:
    """Write ``data`` to ``directory/name``, fsync it, and return its record (one segment)."""
    _write_synced(directory / name, data)
    return FileRecord.of(data)


def publish(staging: Path, final: Path, marker: bytes) -> None:
    """Write the commit marker into ``staging`` and atomically rename it to ``final`` (rank 0 only)."""
    _write_synced(staging / MARKER, marker)
    move_into_place(staging, final)


def move_into_place(staging: Path, final: Path) -> None:
    """fsync the complete ``staging`` directory and atomically rename it to ``final`` (rank 0 only)."""
    _fsync_dir(staging)
    if final.exists():
        raise FileExistsError(f"{final} appeared while it was being saved; the new checkpoint stays in {staging}")
    os.rename(staging, final)
    _fsync_dir(final.parent)


def remove(path: Path) -> None:
    """Delete a checkpoint directory so that no half-deleted checkpoint is ever listed."""
    doomed = path.parent / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"
    os.rename(path, doomed)
    _fsync_dir(path.parent)
    shutil.rmtree(doomed)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
