"""Global arrays from what each process holds: JAX's ``make_array_from_callback`` and
``make_array_from_process_local_data``.

``vsf.device_put`` needs the whole value on every process. A data loader under ``torchrun``
reads a part per process, and a checkpoint reader should read only each process's slices:

* :func:`make_array_from_callback` asks ``data_callback(index)`` for exactly the global indices
  the ranks of this process hold (one rank's under ``torchrun``; every simulated rank's under
  :func:`vsf.simulate`, each distinct index once), checks what comes back against the index,
  and assembles the DTensor with no communication. A balanced dim is asked for as its two
  chunks, a packed one as its slice of each piece, a ragged split as the boxes of the global array its flattened rows cover.
* :func:`make_array_from_process_local_data` takes this process's slice of the global value:
  under ``torchrun`` its rank's shard (:func:`process_slice`), or the whole of any dim it passes
  whole; under :func:`vsf.simulate`, whose one process holds every rank, the whole value (JAX's
  single-process rule: then it is ``device_put``). The global shape is inferred from an equal
  share per process, or given. Every process's local shape is checked against the sharding, and
  replicas' data against each other, in one small all-gather per mesh
  (``vsf.config.check_across_processes``): a process passing 3 rows where its shard has 4 is an
  error on every process naming the leaf, the rank, the dim and both sizes
  (``DTensor.from_local`` takes it silently and gives a wrong tensor).

Example::

    >>> mesh = vsf.make_mesh((2,), ("dp",))                       # under torchrun --nproc-per-node 2
    >>> s = vsf.NamedSharding(mesh, P("dp"))
    >>> mine = tokens[vsf.sharding.process_slice(s, tokens.shape)]  # this process's 4 rows of 8
    >>> batch = vsf.make_array_from_process_local_data(s, mine)     # global (8, 16)
    >>> batch = vsf.make_array_from_callback((8, 16), s, lambda index: tokens[index])
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, config, runtime, tree
from vsf.ops import backend
from vsf.sharding import fingerprint
from vsf.sharding.named import NamedSharding, resolve
from vsf.sharding.put import assemble, is_sharding_leaf, local_device, place

__all__ = ["make_array_from_callback", "make_array_from_process_local_data", "process_slice"]

Index = tuple[slice, ...]
_LOCAL = "make_array_from_process_local_data"


def make_array_from_callback(
    shape: Sequence[int], sharding: Any, data_callback: Callable[[Index], Any], *, dtype: torch.dtype | None = None
) -> DTensor:
    """A DTensor of global ``shape`` laid out as ``sharding`` (a ``NamedSharding``, or a ``P`` under
    :func:`vsf.use_mesh`), each shard fetched by ``data_callback(index)`` (JAX's function).

    ``index`` is a tuple of slices into the global value, one per dim; the callback returns that
    block as a tensor (or a NumPy array, or anything ``torch.as_tensor`` takes). It runs only for
    the indices this process's ranks hold, each distinct index once, and what it returns must
    have the index's shape and one dtype (``dtype=`` casts it; a process holding no shard must
    give ``dtype``). A shard is copied unless the callback returned a tensor owning exactly its
    memory (a fresh read). No communication.

    Example::

        >>> with vsf.simulate(4):
        ...     mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        ...     full = torch.arange(32.0).reshape(8, 4)
        ...     x = vsf.make_array_from_callback((8, 4), vsf.NamedSharding(mesh, P("dp", "tp")), lambda i: full[i])
        ...     vsf.typeof(x)
        'f32[8@dp,4@tp]'
    """
    s = resolve(sharding, "make_array_from_callback")
    shape = _shape(shape)
    s.check(shape)
    _refuse_unreduced(s, "make_array_from_callback")
    fetched: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
    dtypes: dict[torch.dtype, Index] = {}

    def call(index: Index, rank: int) -> torch.Tensor:
        key = tuple((sl.start, sl.stop) for sl in index)
        if key not in fetched:
            fetched[key] = _checked(data_callback(index), index, rank, shape, dtype)
            dtypes.setdefault(fetched[key].dtype, index)
            if len(dtypes) > 1:
                (a, ia), (b, ib) = dtypes.items()
                raise TypeError(
                    f"make_array_from_callback: data_callback returned {a} for index {_show(ia)} and {b} for index {_show(ib)}; pass dtype= to cast"
                )
        return _compat.local_shards(fetched[key], rank)[
            rank
        ]  # a per-rank value (made inside a simulation): this rank's

    device, pieces, handed = local_device(s.mesh.device_type), {}, set()
    simulated, ranks = _compat.active_local_mode() is not None, backend.local_ranks()
    with _compat.local_mode_disabled():
        for r in ranks:
            if not simulated and r not in s.mesh.devices:
                if dtype is None:
                    raise ValueError(
                        f"make_array_from_callback: rank {r} holds no shard on {s.mesh!r}, so the dtype cannot come from the callback; pass dtype="
                    )
                pieces[r] = torch.empty((0,) * len(shape), dtype=dtype, device=device)
                continue
            piece = _owned(_shard(s, shape, r, lambda index, r=r: call(index, r)), device)
            pieces[r] = piece.clone() if id(piece) in handed else piece  # simulated ranks never share memory
            handed.add(id(piece))
    return assemble(pieces, s, shape)


def make_array_from_process_local_data(sharding: Any, local_data: Any, global_shape: Any = None) -> Any:
    """Global DTensors from each process's slice of them (JAX's function; pytrees too).

    ``sharding`` is a prefix tree of ``local_data`` with ``NamedSharding`` (or ``P`` under
    :func:`vsf.use_mesh`) leaves, ``global_shape`` one with shape tuples (or ``None``) as leaves.
    Under ``torchrun`` (one rank per process), each dim of a process's local data holds either
    its rank's shard of that dim (:func:`process_slice`) or the whole dim. Without a global shape
    every process is taken to hold an equal share: a dim split ``k`` ways is ``k`` times the local
    one (pass ``global_shape`` when shares differ, as the last of an uneven split does). Processes
    holding the same shard (replicas, e.g. the ``tp`` ranks of a batch split over ``dp``) must
    pass the same data.

    With ``vsf.config.check_across_processes`` (the default) every process's local shape, dtype
    and data fingerprint is exchanged in one small all-gather per mesh, and a wrong shape, a
    disagreement on the global shape or differing replicas raise ``ValueError`` on every process,
    naming the leaf, the rank, the dim and the sizes. Under :func:`vsf.simulate` this one process
    holds every rank, so its local data is the whole value (``global_shape`` is ``None`` or its
    shape) and this is :func:`vsf.device_put`. Ragged and balanced layouts take
    :func:`make_array_from_callback` instead.

    Example::

        >>> s = vsf.NamedSharding(mesh, P("dp"))                   # mesh (dp=2), 2 processes
        >>> mine = loader.next_rows(4)                              # this process's 4 rows
        >>> batch = vsf.make_array_from_process_local_data(s, mine) # (8, 16), rank 0's rows first
        >>> batch = vsf.make_array_from_process_local_data(s, mine, (7, 16))   # 4 + 3 rows
    """
    pairs, treedef = tree.flatten_with_path(local_data)
    shardings = tree.broadcast_prefix(sharding, local_data, is_leaf=is_sharding_leaf, what="sharding")
    shapes = tree.broadcast_prefix(global_shape, local_data, is_leaf=_is_shape, what="global_shape")
    leaves = [(tree.keystr(p), _as_tensor(x, tree.keystr(p)), s, g) for (p, x), s, g in zip(pairs, shardings, shapes)]
    if runtime.is_simulated() or runtime.world_size() == 1:  # one process holds every rank
        for path, x, _, g in leaves:
            if g is not None and tuple(g) != tuple(x.shape):
                raise ValueError(
                    f"{_LOCAL} of {path}: this one process holds every rank, so its local data is the whole value; "
                    f"global_shape must be None or its shape {tuple(x.shape)}, got {tuple(g)}"
                )
        return place(
            tree.unflatten(treedef, [x for _, x, _, _ in leaves]),
            tree.unflatten(treedef, [s for _, _, s, _ in leaves]),
            _LOCAL,
        )
    cuts = [_cut_here(path, x, resolve(s, path), g) for path, x, s, g in leaves]
    if config.check_across_processes:
        _check_everywhere(cuts)
    for c in cuts:
        if c.problem is not None:
            raise ValueError(_problem_text(c.path, runtime.rank(), c.local, c.shape, c.problem))
    return tree.unflatten(
        treedef,
        [
            assemble(
                {runtime.rank(): _owned(c.piece, local_device(c.sharding.mesh.device_type), copy=True)},
                c.sharding,
                c.shape,
            )
            for c in cuts
        ],
    )


def process_slice(sharding: Any, shape: Sequence[int]) -> Index:
    """The slice of a global value of ``shape`` this process holds under ``sharding``: its rank's
    shard under ``torchrun``; the whole value under :func:`vsf.simulate` (one process, every rank)
    or in a single process. What to pass to :func:`make_array_from_process_local_data`.

    Example::

        >>> vsf.sharding.process_slice(vsf.NamedSharding(mesh, P("dp")), (8, 16))   # rank 1 of dp=2
        (slice(4, 8, None), slice(0, 16, None))
    """
    s = resolve(sharding, "process_slice")
    shape = _shape(shape)
    s.check(shape)
    if runtime.is_simulated() or runtime.world_size() == 1:
        return tuple(slice(0, n) for n in shape)
    _refuse_uncut(s, "process_slice")
    if runtime.rank() not in s.mesh.devices:
        raise ValueError(f"process_slice: rank {runtime.rank()} is not in {s.mesh!r}, so it holds no slice")
    return s.index(shape, runtime.rank())


# -- make_array_from_callback's pieces --------------------------------------------------------------


def _shard(s: NamedSharding, shape: tuple[int, ...], rank: int, call: Callable[[Index], torch.Tensor]) -> torch.Tensor:
    """``rank``'s local tensor, fetched by ``call`` one box of the global value at a time."""
    index = s.index(shape, rank)
    if s.ragged is not None:  # rows of the flattened leading dims: the boxes they cover
        lead = s.ragged.dims
        parts = [call(box + index[1:]) for box in _row_boxes(index[0].start, index[0].stop, shape[:lead])]
        rows = [p.reshape(-1, *p.shape[lead:]) for p in parts]
        return rows[0] if len(rows) == 1 else torch.cat(rows)
    return _product(s.runs(shape, rank), call, ())


def _product(runs: list[list[tuple[int, int]]], call: Callable[[Index], torch.Tensor], prefix: Index) -> torch.Tensor:
    """The blocks of every combination of the dims' runs, joined dim by dim."""
    d = len(prefix)
    if d == len(runs):
        return call(prefix)
    parts = [_product(runs, call, prefix + (slice(a, b),)) for a, b in runs[d]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def _row_boxes(lo: int, hi: int, lead: tuple[int, ...]) -> list[Index]:
    """Boxes of the leading dims ``lead`` whose row-major rows are ``[lo, hi)``, in order.

    Example::

        >>> _row_boxes(3, 9, (3, 4))     # rows 3..8 of a 3x4 grid: (0, 3), (1, 0..3), (2, 0)
        [(slice(0, 1, None), slice(3, 4, None)), (slice(1, 2, None), slice(0, 4, None)), (slice(2, 3, None), slice(0, 1, None))]
    """
    rest = tuple(slice(0, n) for n in lead[1:])
    if lo >= hi:
        return [(slice(0, 0),) + rest]  # an empty box keeps the later dims
    if len(lead) == 1:
        return [(slice(lo, hi),)]
    inner = math.prod(lead[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [
            (slice(first, first + 1),) + box for box in _row_boxes(lo - first * inner, hi - first * inner, lead[1:])
        ]
    boxes = []
    if lo % inner:
        boxes += [(slice(first, first + 1),) + box for box in _row_boxes(lo % inner, inner, lead[1:])]
        first += 1
    whole = hi // inner
    if whole > first:
        boxes.append((slice(first, whole),) + rest)
    if hi % inner:
        boxes += [(slice(whole, whole + 1),) + box for box in _row_boxes(0, hi % inner, lead[1:])]
    return boxes


def _checked(value: Any, index: Index, rank: int, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """What the callback returned for ``index``, as a tensor of the index's shape (a foreign array copied)."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value).clone()
    if isinstance(t, DTensor):
        raise TypeError(
            f"make_array_from_callback: data_callback returned a DTensor for index {_show(index)}; return the block as a plain tensor"
        )
    want = tuple(sl.stop - sl.start for sl in index)
    if tuple(t.shape) != want:
        dims = [d for d, (a, b) in enumerate(zip(t.shape, want)) if a != b] if t.ndim == len(want) else []
        why = (
            f"dim {dims[0]} has {t.shape[dims[0]]} elements where the index has {want[dims[0]]}"
            if dims
            else f"{t.ndim} dims where the index has {len(want)}"
        )
        raise ValueError(
            f"make_array_from_callback: data_callback returned shape {tuple(t.shape)} for index {_show(index)} "
            f"(of rank {rank}'s shard of the global shape {shape}), which has shape {want}: {why}"
        )
    return t if dtype is None else t.to(dtype)


def _owned(t: torch.Tensor, device: torch.device, copy: bool = False) -> torch.Tensor:
    """``t`` on ``device`` in memory of its own: as it is when it already owns exactly its memory
    (and ``copy`` is not asked), else a contiguous copy."""
    mine = (
        t.device == device
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.nbytes
    )
    return t if mine and not copy else t.to(device=device, copy=True, memory_format=torch.contiguous_format)


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    if not _is_shape(shape) or shape is None:
        raise TypeError(f"a global shape is a sequence of non-negative ints, got {shape!r}")
    return tuple(int(n) for n in shape)


def _is_shape(x: Any) -> bool:
    return (
        x is None
        or isinstance(x, (tuple, list, torch.Size))
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in x)
    )


def _as_tensor(x: Any, path: str) -> torch.Tensor:
    if isinstance(x, DTensor):
        raise TypeError(
            f"{_LOCAL} of {path}: the local data is a DTensor already (a global value); pass this process's plain tensor"
        )
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _refuse_unreduced(s: NamedSharding, what: str) -> None:
    summed = [a for a in s.spec.unreduced if s.mesh.axis_size(a) > 1]
    if summed:
        raise ValueError(
            f"{what}: {s.spec!r} is unreduced over {tuple(summed)}; a value made from data is reduced (drop unreduced=)"
        )


def _refuse_uncut(s: NamedSharding, what: str) -> None:
    """A process's slice is one box only where no dim is split ragged, balanced or packed."""
    _refuse_unreduced(s, what)
    if s.ragged is not None or s.balanced or s.packed:
        raise ValueError(
            f"{what}: {s.spec!r} splits rows ragged or a dim balanced or packed, so a process's part is not one slice; "
            "use vsf.make_array_from_callback"
        )


def _show(index: Index) -> str:
    return "[" + ", ".join(f"{sl.start}:{sl.stop}" for sl in index) + "]"


# -- make_array_from_process_local_data on several processes -----------------------------------------


_FINE, _NDIM = -2, -1  # a row's problem dim when there is none, and when the number of dims is wrong


class _Cut:
    """One leaf on this process: its local data, global shape, the piece its rank keeps, and the
    problem with its local shape (``(dim, expected, found)``; dim ``_NDIM``: the number of dims), if any."""

    def __init__(self, path: str, local: torch.Tensor, sharding: NamedSharding, shape: tuple[int, ...]) -> None:
        self.path, self.local, self.sharding, self.shape = path, local, sharding, shape
        self.problem: tuple[int, int, int] | None = None
        self.piece = local.new_empty((0,))
        if local.ndim != len(shape):
            self.problem = (_NDIM, len(shape), local.ndim)
            return
        index, keep = sharding.index(shape, runtime.rank()), []
        for d, (n, sl) in enumerate(zip(local.shape, index)):
            if n == shape[d]:
                keep.append(sl)
            elif n == sl.stop - sl.start:
                keep.append(slice(None))
            else:
                self.problem = (d, sl.stop - sl.start, n)
                return
        self.piece = local[tuple(keep)]


def _cut_here(path: str, local: torch.Tensor, s: NamedSharding, shape: Any) -> _Cut:
    _refuse_uncut(s, f"{_LOCAL} of {path}")
    if runtime.rank() not in s.mesh.devices:
        raise ValueError(
            f"{_LOCAL} of {path}: rank {runtime.rank()} is not in {s.mesh!r}; only the mesh's processes pass data for it"
        )
    shape = tuple(n * s.num_shards(d) for d, n in enumerate(local.shape)) if shape is None else _shape(shape)
    s.check(shape, path)
    return _Cut(path, local, s, shape)


def _shape_cols(shape: tuple[int, ...]) -> list[int]:
    dims = list(shape[: fingerprint.MAX_DIMS]) + [0] * (fingerprint.MAX_DIMS - min(len(shape), fingerprint.MAX_DIMS))
    return [zlib.crc32(repr(tuple(shape)).encode()), len(shape), *dims]


def _shape_of(cols: torch.Tensor) -> tuple[int, ...] | str:
    ndim = int(cols[1])
    dims = tuple(int(d) for d in cols[2 : 2 + min(ndim, fingerprint.MAX_DIMS)])
    return dims if ndim <= fingerprint.MAX_DIMS else f"({', '.join(map(str, dims))}, ...)"


_S = 3 + fingerprint.MAX_DIMS + 2  # where the global shape's columns start; the piece's fingerprint follows them


def _row(c: _Cut) -> torch.Tensor:
    """``[problem dim, expected, found, *local shape, *global shape, *fingerprint of the piece]``."""
    problem = list(c.problem) if c.problem is not None else [_FINE, 0, 0]
    return torch.tensor(
        [
            *problem,
            *_shape_cols(tuple(c.local.shape)),
            *_shape_cols(c.shape),
            *fingerprint.fingerprint(c.piece).tolist(),
        ],
        dtype=torch.int64,
    )


def _check_everywhere(cuts: list[_Cut]) -> None:
    """Exchange every leaf's row over its mesh (one all-gather per mesh) and raise, on every
    process alike, the first problem any process has."""
    by_mesh: dict[Any, list[int]] = {}
    for i, c in enumerate(cuts):
        by_mesh.setdefault(c.sharding.mesh, []).append(i)
    for mesh, members in by_mesh.items():
        rows = fingerprint.gather(mesh, {runtime.rank(): torch.stack([_row(cuts[i]) for i in members])})
        for k, i in enumerate(members):
            message = _verdict(cuts[i].path, cuts[i].sharding, {r: rows[r][k] for r in mesh.devices})
            if message is not None:
                raise ValueError(message)


def _verdict(path: str, s: NamedSharding, rows: dict[int, torch.Tensor]) -> str | None:
    """What is wrong with one leaf given every rank's row (the same text on every process), or None."""
    local = {r: _shape_of(row[3:_S]) for r, row in rows.items()}
    shape = {r: _shape_of(row[_S : _S + 2 + fingerprint.MAX_DIMS]) for r, row in rows.items()}
    bad = [r for r, row in rows.items() if int(row[0]) != _FINE]
    if bad:
        r = bad[0]
        return _problem_text(path, r, local[r], shape[r], tuple(int(v) for v in rows[r][:3]))
    crcs = Counter(int(row[_S]) for row in rows.values())
    common = max(crcs.values())
    ref = next(r for r, row in rows.items() if crcs[int(row[_S])] == common)
    odd = [r for r, row in rows.items() if int(row[_S]) != int(rows[ref][_S])]
    if odd:
        r = odd[0]
        return (
            f"{_LOCAL} of {path}: the processes' local data imply different global shapes: rank {r} passes {local[r]}, "
            f"implying {shape[r]}, and rank {ref} passes {local[ref]}, implying {shape[ref]}. Without global_shape every "
            f"process must hold an equal share of each split dim ({s.spec!r}); pass global_shape= when the shares differ"
        )
    fp = _S + 2 + fingerprint.MAX_DIMS
    kinds = {r: fingerprint.dtype_of(row[fp:]) for r, row in rows.items()}
    if len(set(kinds.values())) > 1:
        r = next(r for r in rows if kinds[r] != kinds[ref])
        return f"{_LOCAL} of {path}: rank {r} passes {kinds[r]} and rank {ref} {kinds[ref]}; every process must pass one dtype"
    held: dict[Any, list[int]] = {}
    for r in rows:
        held.setdefault(tuple((sl.start, sl.stop) for sl in s.index(shape[ref], r)), []).append(r)
    for index, ranks in held.items():
        differ = [r for r in ranks if not torch.equal(rows[r][fp:], rows[ranks[0]][fp:])]
        if differ:
            return (
                f"{_LOCAL} of {path}: ranks {ranks[0]} and {differ[0]} hold the same shard [{', '.join(f'{a}:{b}' for a, b in index)}] "
                f"of the global {shape[ref]} under {s.spec!r} (replicas), but passed different data for it"
            )
    return None


def _problem_text(path: str, rank: int, local: Any, shape: Any, problem: tuple[int, int, int]) -> str:
    dim, expected, found = problem
    whole = f", {shape[dim]}" if isinstance(shape, tuple) and dim >= 0 else ""
    if dim == _NDIM:
        return f"{_LOCAL} of {path}: rank {rank} passes local data of shape {local} ({found} dims), but the global shape {shape} has {expected}"
    return (
        f"{_LOCAL} of {path}: rank {rank} passes local data of shape {local}: dim {dim} has {found} elements, but the "
        f"rank's shard of the global shape {shape} has {expected} there (or the whole dim{whole})"
    )
