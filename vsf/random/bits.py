"""Which Philox counter each element of a sample reads, and computing exactly a shard of it.

An element of a sample of ``shape`` (last dim ``D``) at global index ``(*outer, j)`` reads lane
``j % L`` of the Philox block at counter ``o * ceil(D / L) + j // L``, where ``o`` is the
row-major index of ``outer`` and a block's four 32-bit words make ``L = 4 // width`` lanes of
``width`` words each (one word per 32-bit sample, two per 64-bit one). Its value is a pure
function of (key, global index, shape): every layout computes the same bits, whatever the mesh,
spec or device, and a rank computes only the blocks its own shard touches (a block never
straddles two rows, so a shard's blocks are a box too).

Two ways compute the same thing:

* :func:`fill` (eager): the counters of a box of the global index space, in chunks of at most
  ``CHUNK`` counters (whole rows together, or a long row in pieces), Philox running in place on
  buffers kept for the whole fill and writing each chunk's words in element order, so that a
  chunk allocates next to nothing (or, with ``vsf.config.compile_random``, one compiled kernel).
  On CPU the chunks are shared out over ``torch.get_num_threads()`` worker threads
  (:mod:`vsf.random.workers`), each with its own buffers and running its ops single-threaded:
  a chunk is ~100 small ops, and as OpenMP parallel regions on the caller's thread they wait at
  a barrier for every intra-op thread, which on a loaded machine made a draw 30-160x slower than
  ``torch.randn`` (a thread pool over chunks measured 1.2-1.5x there). Which thread computes a
  chunk never changes its bits. A fill on one thread, or of fewer than ``SERIAL`` elements
  (whose ops torch runs on the calling thread anyway), or on another device, stays on the caller.
* :func:`at` (inside ``vsf.jit`` and ``vsf.eval_shape``): per element, from ``arange`` s that
  broadcast over the global shape, so the traced graph is elementwise integer ops on iota that
  the planner shards like any elementwise op.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from vsf import config
from vsf.random import workers
from vsf.random.philox import MASK, Scratch, Word, philox4x32

__all__ = ["CHUNK", "Transform", "at", "fill", "grid"]

CHUNK = 1 << 16  # counters per chunk of an eager fill (its words and temporaries stay in cache)
SERIAL = (
    1 << 15
)  # torch runs an elementwise op on fewer elements than this on the calling thread alone (at::internal::GRAIN_SIZE)

Transform = Callable[
    [Sequence[torch.Tensor]], torch.Tensor
]  # an element's words -> its value (it may overwrite the words: each call gets its own)


def _words(
    k0: Word, k1: Word, counter: torch.Tensor, narrow: bool = False, out: Scratch | None = None
) -> tuple[Word, Word, Word, Word]:
    """Philox's four words at each ``counter``; ``narrow``: every counter is below ``2**32``, so
    the counter's high word is the Python int 0 (the same bits, fewer ops)."""
    words = (counter, 0, 0, 0) if narrow else (counter & MASK, counter >> 32, 0, 0)
    return philox4x32((k0, k1), words, out=out)


def _interleave(k0: Word, k1: Word, counter: torch.Tensor, out: torch.Tensor) -> None:
    """Write the words of each counter into ``out``, a ``(width, n, lanes)`` tensor whose
    ``[w].reshape(-1)`` is word ``w`` of every element in element order (lane ``l`` of a counter
    is its words ``l * width ...``)."""
    width = out.shape[0]
    words = _words(k0, k1, counter)
    out.copy_(torch.stack([torch.stack(words[w::width], dim=-1) for w in range(width)]))


_COMPILING = threading.Lock()


@functools.cache
def _compiled() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """:func:`_interleave` on exactly ``CHUNK`` counters as one compiled kernel that writes into
    its ``out`` (``vsf.config.compile_random``)."""
    return torch.compile(_interleave, dynamic=False)


def _chunk_words(
    key: tuple[int, int], width: int, narrow: bool, most: int, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function from a chunk of (at most ``most <= CHUNK``) counters to their words, as
    :func:`_interleave` lays them out, in one buffer kept for every chunk: one compiled kernel,
    or eager Philox on :class:`Scratch` buffers kept too, so that a chunk allocates nothing."""
    if config.compile_random:
        kernel, k = (
            _compiled(),
            torch.tensor(key, dtype=torch.int64, device=device),
        )  # tensors, so a new key does not recompile
        words = torch.empty((width, CHUNK, 4 // width), dtype=torch.int64, device=device)
        padded = torch.zeros(CHUNK, dtype=torch.int64, device=device)
        warm: list[bool] = []

        def compiled(counters: torch.Tensor) -> torch.Tensor:
            padded[: counters.numel()] = counters
            if warm:
                kernel(k[0], k[1], padded, words)
            else:  # a first call may compile: one thread at a time
                with _COMPILING:
                    kernel(k[0], k[1], padded, words)
                warm.append(True)
            return words[:, : counters.numel()]

        return compiled
    words = torch.empty((width, most, 4 // width), dtype=torch.int64, device=device)
    buffers = [torch.empty(most, dtype=torch.int64, device=device) for _ in range(6)]

    def eager(counters: torch.Tensor) -> torch.Tensor:
        n = counters.numel()
        out = words[:, :n]
        _words(
            key[0],
            key[1],
            counters,
            narrow,
            Scratch([out[i % width, :, i // width] for i in range(4)], [b[:n] for b in buffers]),
        )
        return out

    return eager


def fill(
    key: tuple[int, int],
    shape: Sequence[int],
    box: Sequence[tuple[int, int]],
    width: int,
    transform: Transform,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The values of the elements of ``box`` (a ``(start, stop)`` per dim of ``shape``, rank >= 1)."""
    lanes = 4 // width
    per_row = -(-shape[-1] // lanes)
    lo, hi = box[-1]
    first, stop = lo // lanes, -(-hi // lanes)
    starts = _row_index(shape[:-1], box[:-1], device).reshape(-1, 1) * per_row + first  # each row's first counter
    out = torch.empty((starts.shape[0], (stop - first) * lanes), dtype=dtype, device=device)
    narrow = math.prod(shape[:-1]) * per_row <= 2**32
    most = min(CHUNK, starts.shape[0] * (stop - first))

    def work(take: Iterator[tuple[slice, slice]]) -> None:
        words_of = _chunk_words(key, width, narrow, most, device)
        counters, steps = (
            torch.empty(most, dtype=torch.int64, device=device),
            torch.empty(min(most, stop - first), dtype=torch.int64, device=device),
        )
        for rows, cols in take:
            chunk = counters[: (rows.stop - rows.start) * (cols.stop - cols.start)]
            step = torch.arange(cols.start, cols.stop, out=steps[: cols.stop - cols.start])
            words = words_of(torch.add(starts[rows], step, out=chunk.view(-1, step.numel())).view(-1))
            piece = out[rows, cols.start * lanes : cols.stop * lanes]
            piece.copy_(transform([words[w].reshape(-1) for w in range(width)]).view(piece.shape))

    chunks = list(_chunks(starts.shape[0], stop - first))
    if device.type == "cpu" and out.numel() >= SERIAL and torch.get_num_threads() > 1:
        workers.run(work, chunks, min(torch.get_num_threads(), len(chunks)))
    else:
        work(iter(chunks))
    rows = out.view(*(b - a for a, b in box[:-1]), (stop - first) * lanes)
    return rows[..., lo - first * lanes : hi - first * lanes]


def _chunks(rows: int, cols: int) -> Iterator[tuple[slice, slice]]:
    """``(rows, cols)`` slices of a grid of counters, each at most ``CHUNK``: whole rows together
    where a row is shorter than a chunk, else one row at a time, in pieces."""
    if cols >= CHUNK:
        for r in range(rows):
            for c in range(0, cols, CHUNK):
                yield slice(r, r + 1), slice(c, min(c + CHUNK, cols))
    elif cols:
        step = CHUNK // cols
        for r in range(0, rows, step):
            yield slice(r, min(r + step, rows)), slice(0, cols)


def _row_index(outer: Sequence[int], box: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Row-major index of each ``outer`` position in ``box``, shaped ``(*box sizes, 1)``."""
    index = torch.zeros((1,) * (len(outer) + 1), dtype=torch.int64, device=device)
    for dim, (a, b) in enumerate(box):
        stride = math.prod(outer[dim + 1 :])
        shape = [1] * (len(outer) + 1)
        shape[dim] = b - a
        index = index + torch.arange(a, b, device=device).view(shape) * stride
    return index


def at(
    key: torch.Tensor | tuple[int, int],
    row: torch.Tensor | int,
    col: torch.Tensor,
    d: int,
    width: int,
    transform: Transform,
) -> torch.Tensor:
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
    return (_row_index(shape[:-1], [(0, n) for n in shape[:-1]], device) if len(shape) > 1 else 0), torch.arange(
        shape[-1], device=device
    )
