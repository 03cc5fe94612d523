"""Which Philox counter each element of a sample reads, and computing exactly a shard of it.

An element of a sample of ``shape`` (last dim ``D``) at global index ``(*outer, j)`` reads lane
``j % L`` of the Philox block at counter ``o * ceil(D / L) + j // L``, where ``o`` is the
row-major index of ``outer`` and a block's four 32-bit words make ``L = 4 // width`` lanes of
``width`` words each (one word per 32-bit sample, two per 64-bit one). Its value is a pure
function of (key, global index, shape): every layout computes the same bits, whatever the mesh,
spec or device, and a rank computes only the blocks its own shard touches (a block never
straddles two rows, so a shard's blocks are a box too).

Two ways compute the same thing:

* :func:`fill` (eager): the counters of a box of the global index space, in chunks that stay in
  cache, each lane written by one op per chunk.
* :func:`at` (inside ``vsf.jit`` and ``vsf.eval_shape``): per element, from ``arange`` s that
  broadcast over the global shape, so the traced graph is elementwise integer ops on iota that
  the planner shards like any elementwise op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from vsf import config
from vsf.random.philox import MASK, Word, philox4x32

__all__ = ["CHUNK", "Transform", "at", "fill", "grid"]

CHUNK = 1 << 16  # counters per chunk of an eager fill (its words and temporaries stay in cache)

Transform = Callable[[Sequence[torch.Tensor]], torch.Tensor]  # an element's words -> its value


def _words(k0: Word, k1: Word, counter: torch.Tensor) -> tuple[Word, Word, Word, Word]:
    return philox4x32((k0, k1), (counter & MASK, counter >> 32, 0, 0))


def _stacked(k0: Word, k1: Word, counter: torch.Tensor) -> torch.Tensor:
    return torch.stack(_words(k0, k1, counter))


@functools.cache
def _compiled() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Philox on a chunk of exactly ``CHUNK`` counters as one compiled kernel (``vsf.config.compile_random``)."""
    return torch.compile(_stacked, dynamic=False)


def _chunk_words(key: tuple[int, int], counters: torch.Tensor) -> torch.Tensor:
    """The four words of each counter of one chunk (at most ``CHUNK``), as a ``(4, n)`` tensor."""
    if not config.compile_random:
        return _stacked(key[0], key[1], counters)
    n = counters.numel()
    padded = counters if n == CHUNK else torch.cat([counters, counters.new_zeros(CHUNK - n)])
    k = torch.tensor(key, dtype=torch.int64, device=counters.device)  # tensors, so a new key does not recompile
    return _compiled()(k[0], k[1], padded)[:, :n]


def fill(key: tuple[int, int], shape: Sequence[int], box: Sequence[tuple[int, int]], width: int, transform: Transform, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The values of the elements of ``box`` (a ``(start, stop)`` per dim of ``shape``, rank >= 1)."""
    lanes = 4 // width
    d = shape[-1]
    lo, hi = box[-1]
    first, stop = lo // lanes, -(-hi // lanes)
    outer = _row_index(shape[:-1], box[:-1], device)
    counters = (outer * -(-d // lanes) + torch.arange(first, stop, device=device)).reshape(-1)
    out = torch.empty((counters.numel(), lanes), dtype=dtype, device=device)
    for a in range(0, counters.numel(), CHUNK):
        words = _chunk_words(key, counters[a : a + CHUNK])  # (4, n): lane l's words are rows l*width ...
        out[a : a + CHUNK] = transform([words[w::width] for w in range(width)]).T  # all lanes at once
    rows = out.view(*(b - a for a, b in box[:-1]), (stop - first) * lanes)
    return rows[..., lo - first * lanes : hi - first * lanes]


def _row_index(outer: Sequence[int], box: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Row-major index of each ``outer`` position in ``box``, shaped ``(*box sizes, 1)``."""
    index = torch.zeros((1,) * (len(outer) + 1), dtype=torch.int64, device=device)
    for dim, (a, b) in enumerate(box):
        stride = math.prod(outer[dim + 1 :])
        shape = [1] * (len(outer) + 1)
        shape[dim] = b - a
        index = index + torch.arange(a, b, device=device).view(shape) * stride
    return index


def at(key: torch.Tensor | tuple[int, int], row: torch.Tensor | int, col: torch.Tensor, d: int, width: int, transform: Transform) -> torch.Tensor:
    """The values of the elements at row-major row ``row`` and last-dim index ``col`` (broadcast
    together) of a sample whose last dim is ``d``."""
    lanes = 4 // width
    k0, k1 = (key[0], key[1])
    shift = lanes.bit_length() - 1  # lanes is 4 or 2: // and % as bit ops, which every layer shards
    words = _words(k0, k1, row * -(-d // lanes) + (col >> shift))  # row first: it may carry the layout
    lane = col & (lanes - 1)
    mine = []
    for w in range(width):
        word = words[w]
        for other in range(1, lanes):
            word = torch.where(lane == other, words[other * width + w], word)
        mine.append(word)
    return transform(mine)


def grid(shape: Sequence[int], device: torch.device | None = None) -> tuple[torch.Tensor | int, torch.Tensor]:
    """``(row, col)`` of every element of ``shape`` (rank >= 1), broadcasting to ``shape``."""
    return (_row_index(shape[:-1], [(0, n) for n in shape[:-1]], device) if len(shape) > 1 else 0), torch.arange(shape[-1], device=device)
