"""The block checksum of checkpoint files, against its definition computed in plain Python."""

from __future__ import annotations

import random
import struct

import pytest

from vsf.checkpoint.checksum import BLOCK, PERIOD, checksums


def _by_definition(block: bytes) -> int:
    """sum((2 * (i % PERIOD) + 1) * w[i]) mod 2**64 over little-endian 64-bit words, zero-padded."""
    padded = block + bytes(-len(block) % 8)
    words = struct.unpack(f"<{len(padded) // 8}Q", padded)
    return sum((2 * (i % PERIOD) + 1) * w for i, w in enumerate(words)) % 2**64


@pytest.mark.parametrize("n", [1, 7, 8, 9, 8 * PERIOD - 1, 8 * PERIOD + 3, BLOCK, BLOCK + 13, 2 * BLOCK + 8])
def test_checksums_follow_the_definition_block_by_block(n):
    data = random.Random(n).randbytes(n)
    got = [c % 2**64 for c in checksums(bytearray(data))]
    assert got == [_by_definition(data[i : i + BLOCK]) for i in range(0, n, BLOCK)]


def test_single_byte_changes_anywhere_are_detected():
    rng = random.Random(0)
    data = bytearray(rng.randbytes(3 * 8 * PERIOD + 5))  # spans several weight periods and a padded tail
    clean = checksums(data)
    for pos in [*range(64), *rng.sample(range(len(data)), 1000), *range(len(data) - 64, len(data))]:
        old = data[pos]
        data[pos] ^= rng.randrange(1, 256)
        assert checksums(data) != clean, pos
        data[pos] = old


def test_swapped_words_are_detected_unless_a_whole_number_of_periods_apart():
    words = list(range(1, 4 * PERIOD + 1))  # distinct words
    pack = lambda ws: bytearray(struct.pack(f"<{len(ws)}Q", *ws))  # noqa: E731
    clean = checksums(pack(words))
    for a, b in [(0, 1), (5, PERIOD - 1), (3, PERIOD + 7), (10, 3 * PERIOD + 11)]:
        swapped = list(words)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        assert checksums(pack(swapped)) != clean, (a, b)
    swapped = list(words)
    swapped[3], swapped[PERIOD + 3] = swapped[PERIOD + 3], swapped[3]  # the documented blind spot
    assert checksums(pack(swapped)) == clean
