"""DCP storage that checksums what it writes and verifies what it reads.

:class:`ChecksumWriter` is DCP's ``FileSystemWriter`` (same files, same fsyncs) whose streams
compute CRC-32s while writing: one per segment between two ``tell()`` calls, which DCP makes at
every item boundary, so each tensor chunk gets its own checksum. :class:`VerifyingReader` is
DCP's ``FileSystemReader`` whose streams check the size of each file when it is opened and the
CRC-32 of each segment before handing out any of its bytes, so a truncated or altered file
raises :class:`~vsf.checkpoint.format.CorruptCheckpointError` naming the file and the leaves
stored there, and never yields wrong values. Files are read through ``mmap``, so checking them
costs one pass of CRC-32 over the bytes and no extra copy. (Checksumming on a helper thread was
tried and was slower on a busy 2-core machine than doing it inline.)

Both only replace the ``fs`` (a public ``FileSystem``) of the DCP class, and count bytes for
:class:`~vsf.checkpoint.progress.Progress`.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import mmap
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from vsf.checkpoint.format import CorruptCheckpointError, FileRecord
from vsf.checkpoint.progress import Progress

__all__ = ["ChecksumWriter", "VerifyingReader"]

# vsf passes ``no_dist=True`` on purpose for single-process and simulated checkpoints.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _ChecksumStream:
    """A file being written, recording ``(offset, length, crc32)`` of the bytes between ``tell()`` calls."""

    def __init__(self, raw: Any, meter: Progress) -> None:
        self._raw = raw
        self._meter = meter
        self._pos = 0
        self._start = 0
        self._crc = 0
        self._segments: list[tuple[int, int, int]] = []

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        n = self._raw.write(data)
        self._crc = zlib.crc32(data[:n], self._crc)
        self._pos += n
        self._meter.add(n)
        return n

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        if self._pos > self._start:
            self._segments.append((self._start, self._pos - self._start, self._crc))
        self._start, self._crc = self._pos, 0

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    def record(self) -> FileRecord:
        self._cut()
        return FileRecord(self._pos, tuple(self._segments))


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
    """Read access to a mapped checkpoint file that checks each segment before serving its bytes."""

    def __init__(self, view: memoryview, path: Path, record: FileRecord, meter: Progress, leaves_in: Callable[[str, int, int], list[str]]) -> None:
        super().__init__()
        self._view = view
        self._path = path
        self._record = record
        self._starts = [s[0] for s in record.segments]
        self._meter = meter
        self._leaves_in = leaves_in
        self._pos = 0
        self._verified: set[int] = set()

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
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out) and self._pos < self._record.size:
            offset, length, _ = self._segment(self._pos)
            k = min(len(out) - n, offset + length - self._pos)
            out[n : n + k] = self._view[self._pos : self._pos + k]
            n += k
            self._pos += k
        return n

    def _segment(self, pos: int) -> tuple[int, int, int]:
        i = bisect.bisect_right(self._starts, pos) - 1
        offset, length, crc = self._record.segments[max(i, 0)]
        if not offset <= pos < offset + length:
            raise CorruptCheckpointError(f"{self._path}: byte {pos} is covered by no checksummed segment")
        if i not in self._verified:
            if zlib.crc32(self._view[offset : offset + length]) != crc:
                raise CorruptCheckpointError(
                    f"{self._path}: bytes {offset}..{offset + length} fail their CRC-32 check, so the file is damaged"
                    f"{_holding(self._leaves_in(self._path.name, offset, offset + length))}"
                )
            self._verified.add(i)
            self._meter.add(length)
        return offset, length, crc


class _VerifyingFileSystem(FileSystem):
    def __init__(self, files: dict[str, FileRecord], meter: Progress, leaves_in: Callable[[str, int, int], list[str]]) -> None:
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
            raise CorruptCheckpointError(f"{path} is missing from the checkpoint{_holding(self._leaves_in(path.name, 0, record.size))}")
        with super().create_stream(path, mode) as raw, contextlib.ExitStack() as release:
            size = os.fstat(raw.fileno()).st_size
            if size != record.size:
                raise CorruptCheckpointError(
                    f"{path} has {size} bytes, but {record.size} were written: it is truncated or altered"
                    f"{_holding(self._leaves_in(path.name, min(size, record.size), record.size))}"
                )
            view = memoryview(mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) if size else b"")
            release.callback(view.release)
            yield _VerifiedStream(view, path, record, self._meter, self._leaves_in)


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks every file against the commit marker's records.

    ``key_to_path`` maps DCP keys to the leaf key paths named in errors.
    """

    def __init__(self, path: str | os.PathLike, files: dict[str, FileRecord], meter: Progress, key_to_path: dict[str, str]) -> None:
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
