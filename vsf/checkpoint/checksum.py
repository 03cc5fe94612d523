"""The checksum of checkpoint file blocks: a weighted sum of 64-bit words, computed with torch.

Files are checked in blocks of at most :data:`BLOCK` bytes (a block never spans two DCP items).
The checksum of a block is ``sum((2 * (i % PERIOD) + 1) * w[i]) mod 2**64`` over its bytes read
as little-endian 64-bit integers ``w`` (the last one zero-padded): Fletcher's idea, with odd
weights that repeat every ``PERIOD`` words (16 KiB).

* Every change confined to one word (a flipped bit, an altered byte, a torn 8-byte store)
  changes the sum: odd weights are invertible modulo ``2**64``.
* Random damage (garbage, zeroed pages, stale data) goes unnoticed with probability about
  ``2**-64`` per block; a truncated file is caught earlier, by its size.
* Changes that cancel out go unnoticed, e.g. two words swapped exactly a multiple of 16 KiB
  apart. (CRC-32 catches more such structured errors but misses random damage with
  probability ``2**-32``.)

It is one integer matrix-vector product per block (its ``PERIOD``-word rows times the
weights), which torch runs on the calling thread. On the busy 2-core machine we measured, it ran
about twice as fast as ``zlib.crc32``, and ``zlib.adler32`` was no faster than ``zlib.crc32``
there; ``benchmarks/bench_checkpoint.py`` measures all three side by side.

Example::

    >>> len(checksums(bytearray(3 * BLOCK + 5)))       # three whole blocks and a short one
    4
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BLOCK", "PERIOD", "checksums"]

BLOCK = 1 << 20
PERIOD = 2048  # words
_ROW = PERIOD * 8  # bytes
_WEIGHTS = torch.arange(1, 2 * PERIOD, 2, dtype=torch.int64)


def checksums(data: Any) -> list[int]:
    """The checksums of ``data`` cut into consecutive blocks of :data:`BLOCK` bytes (the last may be short).

    ``data`` is any writable bytes-like object (a ``bytearray``, a ``memoryview`` of one, a buffer
    being read into): its words are read in place, without a copy.
    """
    data = memoryview(data).cast("B")
    return [_checksum(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]


def _checksum(block: memoryview) -> int:
    rows, tail = divmod(len(block), _ROW)
    total = 0
    if rows:
        words = torch.frombuffer(block, dtype=torch.int64, count=rows * PERIOD).view(rows, PERIOD)
        total += int(torch.mv(words, _WEIGHTS).sum())
    if tail:
        padded = bytearray(_ROW)
        padded[:tail] = block[rows * _ROW :]
        total += int(torch.dot(torch.frombuffer(padded, dtype=torch.int64), _WEIGHTS))
    return _signed64(total)


def _signed64(n: int) -> int:
    """``n`` modulo ``2**64`` as a signed 64-bit integer (what torch's wrapping arithmetic gives)."""
    n &= (1 << 64) - 1
    return n - (1 << 64) if n >= 1 << 63 else n
