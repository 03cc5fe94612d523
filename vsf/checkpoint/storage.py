"""DCP storage that checksums what it writes and verifies what it reads.

:class:`ChecksumWriter` is DCP's ``FileSystemWriter`` (same files, same fsyncs) whose streams
pass the bytes through a buffer of one block (:data:`~vsf.checkpoint.checksum.BLOCK` bytes)
and checksum each block before writing it; DCP's ``tell()`` at every item boundary ends a
block, so no block spans two items. :class:`VerifyingReader` is DCP's ``FileSystemReader``
whose streams check the size of each file when it is opened and, for every read, read the
bytes straight into the caller's buffer one block at a time and check each block while it is
still in cache, before returning (a block wanted only in part is read whole, aside, once). So a
truncated or altered file raises :class:`~vsf.errors.CorruptCheckpointError` naming
the file and the leaves stored there, and no unchecked byte ever reaches DCP.

Checking costs one pass of :func:`~vsf.checkpoint.checksum.checksums` over bytes just read,
and no extra copy; in a long read it runs on a helper thread, block ``i`` checked while block
``i + 1`` is read, and the read returns once every block has passed. (Tried and dropped: a
memory map checksummed before reading, which page-faulted through every file a second time;
checking on a helper thread that re-reads the blocks, slower on a busy 2-core machine.)

Both only replace the ``fs`` (a public ``FileSystem``) of the DCP class, and count bytes for
:class:`~vsf.checkpoint.progress.Progress`.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import io
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from vsf.checkpoint.checksum import BLOCK, checksums
from vsf.checkpoint.format import FileRecord
from vsf.errors import CorruptCheckpointError
from vsf.checkpoint.progress import Progress

__all__ = ["EDGE", "ChecksumWriter", "VerifyingReader"]

EDGE = 4096  # bytes at the end of a large write that get a block of their own

# vsf passes ``no_dist=True`` on purpose for single-process and simulated checkpoints, where DCP
# warns on every first save and load that it assumes so. (pytest resets warning filters after
# collection, so pyproject.toml repeats this one for the tests.)
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module=r"torch\.distributed\.checkpoint",
)


class _ChecksumStream:
    """A file being written one block at a time, recording ``(offset, length, checksum)`` of each block.

    A block ends when it is full and at every ``tell()``. A write of at least a block (a
    tensor's bytes) gets blocks of its own, the last :data:`EDGE` bytes apart: readers of the
    zip archives DCP writes (``torch.load``) read a few headers, the tensor's bytes whole, and
    the archive's last 4 KiB, so every block is either read whole or small. ``flush()`` (and
    ``fileno()``, which DCP calls to fsync) hand the buffered bytes to the file first.
    """

    def __init__(self, raw: Any, meter: Progress) -> None:
        self._raw = raw
        self._meter = meter
        self._buffer = memoryview(bytearray(BLOCK))
        self._start = 0  # file offset of the block being filled
        self._fill = 0  # bytes of it in the buffer
        self._written = 0  # of which already handed to the file
        self._blocks: list[tuple[int, int, int]] = []

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        if len(data) < BLOCK:
            self._put(data)
        else:
            self._cut()
            cuts = [*range(0, len(data) - EDGE, BLOCK), len(data) - EDGE, len(data)]
            for lo, hi in zip(cuts, cuts[1:]):
                self._put(data[lo:hi])
                self._cut()
        self._meter.add(len(data))
        return len(data)

    def _put(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            k = min(len(data) - done, BLOCK - self._fill)
            self._buffer[self._fill : self._fill + k] = data[done : done + k]
            self._fill += k
            done += k
            if self._fill == BLOCK:
                self._cut()

    def tell(self) -> int:
        self._cut()
        return self._start

    def _hand_over(self) -> None:
        if self._written < self._fill:
            self._raw.write(self._buffer[self._written : self._fill])
            self._written = self._fill

    def _cut(self) -> None:
        if self._fill:
            self._hand_over()
            self._blocks.append((self._start, self._fill, checksums(self._buffer[: self._fill])[0]))
            self._start += self._fill
            self._fill = self._written = 0

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._hand_over()
        self._raw.flush()

    def fileno(self) -> int:
        self.flush()
        return self._raw.fileno()

    def close(self) -> None:
        self.flush()
        self._raw.close()

    def record(self) -> FileRecord:
        self._cut()
        return FileRecord(self._start, tuple(self._blocks))


class _ChecksumFileSystem(FileSystem):
    def __init__(self, meter: Progress) -> None:
        super().__init__()
        self._meter = meter
        self.records: dict[str, FileRecord] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _ChecksumStream(raw, self._meter)
            yield stream
        self.records[Path(path).name] = stream.record()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.records[Path(new_path).name] = self.records.pop(Path(path).name)


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced) that records a :class:`FileRecord` per file."""

    def __init__(self, path: str | os.PathLike, meter: Progress) -> None:
        super().__init__(path)
        self.fs = _ChecksumFileSystem(meter)

    @property
    def records(self) -> dict[str, FileRecord]:
        """Name -> record of every file this rank wrote."""
        return dict(self.fs.records)


class _VerifiedStream(io.RawIOBase):
    """Read access to a checkpoint file that checks every block a read touches before returning."""

    def __init__(
        self, raw: Any, path: Path, record: FileRecord, meter: Progress, leaves_in: Callable[[str, int, int], list[str]]
    ) -> None:
        super().__init__()
        self._raw = raw
        self._path = path
        self._record = record
        self._starts = [block[0] for block in record.blocks]
        self._meter = meter
        self._leaves_in = leaves_in
        self._pos = 0
        self._verified: set[int] = set()
        self._aside = memoryview(bytearray(max((b[1] for b in record.blocks), default=0)))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._record.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")[: max(0, self._record.size - self._pos)]
        # A read of several whole blocks checks each on a helper thread while the next is read
        # (both release the GIL); every check has passed before the read returns.
        with _Checks(parallel=len(out) >= _PARALLEL_READ) as checks:
            done = 0
            while done < len(out):  # block by block, each checked while its bytes are still in cache
                i = bisect.bisect_right(self._starts, self._pos) - 1
                offset, length, _ = self._record.blocks[i]
                piece = out[done : done + min(len(out) - done, offset + length - self._pos)]
                if i in self._verified:
                    _read_exactly(self._raw, self._pos, piece, self._path)
                elif len(piece) == length:
                    _read_exactly(self._raw, offset, piece, self._path)
                    checks.run(self._check, i, piece)
                else:  # only part of the block is wanted: read it whole, aside, to check it
                    whole = self._aside[:length]
                    _read_exactly(self._raw, offset, whole, self._path)
                    self._check(i, whole)
                    piece[:] = whole[self._pos - offset : self._pos - offset + len(piece)]
                self._pos += len(piece)
                done += len(piece)
        return done

    def _check(self, i: int, data: memoryview) -> None:
        """Check block ``i`` against the checksum of ``data``, its bytes."""
        offset, length, expected = self._record.blocks[i]
        if checksums(data) != [expected]:
            raise CorruptCheckpointError(
                f"{self._path}: bytes {offset}..{offset + length} fail their checksum, so the file is damaged"
                f"{_holding(self._leaves_in(self._path.name, offset, offset + length))}"
            )
        self._verified.add(i)
        self._meter.add(length)


# Reads at least this long check their blocks on a helper thread (shorter ones are not worth a thread).
_PARALLEL_READ = 4 * BLOCK


class _Checks:
    """Runs checks inline, or on one helper thread (``parallel``) whose checks all finish, and
    whose first failure is raised, when the ``with`` block ends."""

    def __init__(self, parallel: bool) -> None:
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vsf-checkpoint-verify") if parallel else None
        )
        self._pending: list[concurrent.futures.Future] = []

    def run(self, fn: Callable[..., None], *args: Any) -> None:
        if self._pool is None:
            fn(*args)
        else:
            self._pending.append(self._pool.submit(fn, *args))

    def __enter__(self) -> _Checks:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            if exc[0] is None:  # else the read's own error goes up
                for f in self._pending:
                    f.result()


def _read_exactly(f: Any, pos: int, out: memoryview, path: Path) -> None:
    f.seek(pos)
    n = 0
    while n < len(out):
        k = f.readinto(out[n:])
        if not k:
            raise CorruptCheckpointError(
                f"{path} ended at byte {pos + n} while it was being read: it was truncated meanwhile"
            )
        n += k


class _VerifyingFileSystem(FileSystem):
    def __init__(
        self, files: dict[str, FileRecord], meter: Progress, leaves_in: Callable[[str, int, int], list[str]]
    ) -> None:
        super().__init__()
        self._files = files
        self._meter = meter
        self._leaves_in = leaves_in

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = Path(path)
        record = self._files.get(path.name)
        if record is None:
            raise CorruptCheckpointError(f"{path} is read by DCP but not listed in the commit marker")
        if not path.is_file():
            raise CorruptCheckpointError(
                f"{path} is missing from the checkpoint{_holding(self._leaves_in(path.name, 0, record.size))}"
            )
        with super().create_stream(path, mode) as raw:
            size = os.fstat(raw.fileno()).st_size
            if size != record.size:
                raise CorruptCheckpointError(
                    f"{path} has {size} bytes, but {record.size} were written: it is truncated or altered"
                    f"{_holding(self._leaves_in(path.name, min(size, record.size), record.size))}"
                )
            yield _VerifiedStream(raw, path, record, self._meter, self._leaves_in)


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks every file against the commit marker's records.

    ``key_to_path`` maps DCP keys to the leaf key paths named in errors.
    """

    def __init__(
        self, path: str | os.PathLike, files: dict[str, FileRecord], meter: Progress, key_to_path: dict[str, str]
    ) -> None:
        super().__init__(path)
        self._key_to_path = key_to_path
        self.fs = _VerifyingFileSystem(files, meter, self._leaves_in)

    def _leaves_in(self, name: str, lo: int, hi: int) -> list[str]:
        """Key paths of the leaves with bytes in ``[lo, hi)`` of file ``name`` (from DCP's metadata)."""
        keys = {
            index.fqn
            for index, info in (self.storage_data or {}).items()
            if info.relative_path == name and info.offset < hi and info.offset + info.length > lo
        }
        return sorted(self._key_to_path.get(k, k) for k in keys)


def _holding(paths: list[str]) -> str:
    return f"; it holds data of leaves {', '.join(paths)}" if paths else ""
