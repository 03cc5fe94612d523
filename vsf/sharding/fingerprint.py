"""Do the processes hold the same values? A cheap fingerprint of each tensor, compared over a mesh.

``vsf.device_put`` of a plain tensor takes it as the whole value on every process. A process that
passes its own part instead (each process's half of a batch) passes every shape check, and the
result is silently another tensor. So, on several processes, ``device_put`` compares a
fingerprint of every plain leaf across the ranks of its mesh (:func:`check_same`), and
:func:`vsf.make_array_from_process_local_data` compares the pieces that replicas hold.

A fingerprint (:func:`fingerprint`) is one row of int64: a CRC of the shape and dtype, the rank,
dtype and first :data:`MAX_DIMS` dims, the element count, three sums of the elements' bit
patterns (all of them, every second, every seventh: integer sums, so equal bits give equal sums
in any reduction order, and one changed element changes the first) and eight elements sampled at
fixed positions. It reads each element once and moves ``WIDTH`` numbers, whatever the tensor's
size. :func:`gather` exchanges the rows of a whole tree in one all-gather: over the default
group when the mesh spans it, else over the mesh's axes (one collective per axis larger than 1,
a pipeline stage's mesh). Under :func:`vsf.simulate` every rank's value is in this process, and
nothing is exchanged. ``vsf.config.check_across_processes = False`` turns the checks off.

Example::

    >>> rows = {r: torch.stack([fingerprint(x)]) for r, x in per_rank.items()}
    >>> gather(mesh, rows)[1]            # rank 1's rows, on every rank
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from vsf import _compat, ops, runtime
from vsf.ops import backend
from vsf.sharding.mesh import Mesh

__all__ = [
    "MAX_DIMS",
    "WIDTH",
    "check_same",
    "describe",
    "dtype_of",
    "fingerprint",
    "gather",
    "ranks_here",
    "values_by_rank",
]

MAX_DIMS = 8  # dims a row spells out (a longer shape still counts in its CRC)
_HEAD = 4 + MAX_DIMS  # crc, ndim, dtype, dims..., numel
_SAMPLES = 8
WIDTH = _HEAD + 3 + _SAMPLES
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint row of a plain tensor: int64 of length :data:`WIDTH`, on the CPU.

    Example::

        >>> bool((fingerprint(torch.arange(4.0)) == fingerprint(torch.arange(4.0))).all())
        True
    """
    t = t.detach()
    shape = tuple(t.shape)
    dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
    head = torch.tensor(
        [zlib.crc32(repr((shape, str(t.dtype))).encode()), len(shape), _DTYPES.index(t.dtype), *dims, t.numel()],
        dtype=torch.int64,
    )
    flat = t.contiguous().reshape(-1)
    bits = (
        flat.view(_BITS.get(flat.element_size(), torch.uint8)) if flat.numel() else flat.new_zeros(1, dtype=torch.int64)
    )
    n = bits.numel()
    picks = torch.tensor([i * (n - 1) // (_SAMPLES - 1) for i in range(_SAMPLES)], device=bits.device)
    sums = [bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64), bits[::7].sum(dtype=torch.int64)]
    return torch.cat([head, torch.stack([*sums, *bits[picks].to(torch.int64)]).cpu()])


def describe(row: torch.Tensor) -> str:
    """The shape and dtype a fingerprint row spells out, e.g. ``"(4, 16) torch.float32"``."""
    ndim = int(row[1])
    dims = [str(int(d)) for d in row[3 : 3 + min(ndim, MAX_DIMS)]] + (["..."] if ndim > MAX_DIMS else [])
    return f"({', '.join(dims)}{',' if ndim == 1 else ''}) {dtype_of(row)}"


def dtype_of(row: torch.Tensor) -> torch.dtype:
    """The dtype of the tensor a fingerprint row was taken of."""
    return _DTYPES[int(row[2])]


def ranks_here(mesh: Mesh) -> list[int]:
    """The ranks of ``mesh`` whose values this process holds: every one under simulation, else this
    process's rank if it is in the mesh."""
    if _compat.active_local_mode() is not None:
        return backend.local_ranks()
    return [runtime.rank()] if runtime.rank() in mesh.devices else []


def values_by_rank(t: torch.Tensor, ranks: Sequence[int]) -> dict[int, torch.Tensor]:
    """The value each of ``ranks`` holds in ``t`` (a per-rank tensor under simulation, else the same
    tensor for all), as plain tensors."""
    shards = _compat.local_shards(t, runtime.rank())
    return {r: shards[r] if r in shards else shards[runtime.rank()] for r in ranks}


def gather(mesh: Mesh, rows: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank of ``mesh``'s rows (int64 tensors of one shape), from the rows of the ranks held
    here: under simulation all of them already; on several processes, in one all-gather over the
    default group when the mesh spans it, else one per mesh axis larger than 1.

    Example::

        >>> gather(mesh, {vsf.runtime.rank(): torch.ones(2, WIDTH, dtype=torch.int64)})[0].shape
        torch.Size([2, 23])
    """
    if runtime.is_simulated() or runtime.world_size() == 1:
        return rows
    (mine,) = rows.values()
    if sorted(mesh.devices) == list(range(runtime.world_size())):
        out = mine.new_empty((runtime.world_size() * mine.shape[0], *mine.shape[1:]))
        dist.all_gather_single(out, mine.contiguous())
        every = out.view(runtime.world_size(), *mine.shape)
        return {r: every[r] for r in mesh.devices}
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    out = ops.all_gather(mine.to(device).unsqueeze(0), mesh.axis_names, mesh=mesh).cpu()
    return dict(zip(mesh.devices, out))


def check_same(leaves: Sequence[tuple[str, torch.Tensor, Mesh]], what: str = "device_put") -> None:
    """Raise ``ValueError`` unless every rank of each leaf's mesh holds the same value of it
    (``leaves``: key path, plain tensor, mesh). One :func:`gather` per mesh; nothing on one
    process, and under simulation only per-rank tensors are compared; fake tensors (under
    :func:`vsf.eval_shape`, or while tracing) have no values to compare and are skipped.

    Example::

        >>> check_same([("['x']", batch, mesh)])     # under torchrun, every process passes the whole batch
    """
    if _compat.fake_mode_active():
        return
    by_mesh: dict[Mesh, list[tuple[str, torch.Tensor]]] = {}
    simulated = runtime.is_simulated()
    for path, t, mesh in leaves:
        if (
            mesh.size > 1
            and not _compat.is_fake(t)
            and (
                _compat.is_local_tensor(t) if simulated else runtime.world_size() > 1 and runtime.rank() in mesh.devices
            )
        ):
            by_mesh.setdefault(mesh, []).append((path, t))
    for mesh, items in by_mesh.items():
        ranks = ranks_here(mesh)
        with _compat.local_mode_disabled():
            per_rank = [values_by_rank(t, ranks) for _, t in items]
            mine = {r: torch.stack([fingerprint(v[r]) for v in per_rank]) for r in ranks}
        rows = gather(mesh, mine)
        first = mesh.devices[0]
        for i, (path, _) in enumerate(items):
            differ = [r for r in mesh.devices if not torch.equal(rows[r][i], rows[first][i])]
            if differ:
                raise ValueError(_different(what, path, rows, i, first, differ))


def _different(what: str, path: str, rows: dict[int, torch.Tensor], i: int, first: int, differ: list[int]) -> str:
    r = differ[0]
    mine, theirs = rows[r][i], rows[first][i]
    how = (
        f"rank {r} passes {describe(mine)} and rank {first} {describe(theirs)}"
        if not torch.equal(mine[:_HEAD], theirs[:_HEAD])
        else f"rank {r}'s value differs from rank {first}'s (both {describe(mine)})"
    )
    more = f" (and {len(differ) - 1} more rank{'s' if len(differ) > 2 else ''})" if len(differ) > 1 else ""
    return (
        f"{what} of {path}: the processes passed different values: {how}{more}. A plain tensor is taken as the "
        f"whole value on every process; to build a global value from each process's own part (its slice of a batch), "
        f"use vsf.make_array_from_process_local_data (or vsf.make_array_from_callback). "
        f"vsf.config.check_across_processes = False skips this check"
    )
