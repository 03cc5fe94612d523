"""An oracle for vsf's layout that shares no code with it.

A rank's shard is cut from the full tensor with ``torch.chunk``, one mesh axis at a time, major
axis first, which is what DTensor holds for uneven dims (5 rows over 4 ranks: 2, 2, 1, 0).
The rank's mesh coordinate comes from ``numpy.unravel_index`` over the mesh shape (row-major,
as JAX's ``np.arange(n).reshape(shape)``). An axis in ``unreduced`` holds the value on its
coordinate 0 and zeros elsewhere, so the sum over that axis is the value.

Also imported by the tier-3 worker script, so it depends on torch and numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def coordinate(sizes: Sequence[int], names: Sequence[str], rank: int) -> dict[str, int]:
    """Mesh coordinate of ``rank`` (row-major over ``sizes``)."""
    return {n: int(c) for n, c in zip(names, np.unravel_index(rank, tuple(sizes)))}


def entry_axes(entry: object) -> tuple[str, ...]:
    """The axes of one spec entry: ``None`` -> (), ``"a"`` -> ("a",), a tuple as is."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def expected_shard(
    full: torch.Tensor,
    sizes: Sequence[int],
    names: Sequence[str],
    entries: Sequence[object],
    rank: int,
    unreduced: Sequence[str] = (),
) -> torch.Tensor:
    """The piece of ``full`` that ``rank`` holds under a spec with ``entries`` on the mesh."""
    size_of = dict(zip(names, sizes))
    coord = coordinate(sizes, names, rank)
    piece = full
    for dim, entry in enumerate(entries):
        for axis in entry_axes(entry):
            chunks = torch.chunk(piece, size_of[axis], dim) if piece.shape[dim] else ()
            c = coord[axis]
            piece = chunks[c] if c < len(chunks) else piece.narrow(dim, 0, 0)
    if any(coord[a] for a in unreduced):
        piece = torch.zeros_like(piece)
    return piece
