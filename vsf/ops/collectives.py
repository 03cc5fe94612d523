"""Named-axis collectives on local tensors, with autodiff.

Each function takes a rank's *local* tensor (as inside JAX's ``shard_map``) and the name of a
mesh axis, or a tuple of names, and communicates within that axis's groups. Every collective is
one ``torch.autograd.Function`` whose backward runs the transposed collective:

=====================  =========================================
forward                backward
=====================  =========================================
``psum``               ``psum``
``all_gather``         ``psum_scatter``
``psum_scatter``       ``all_gather``
``all_to_all(s, c)``   ``all_to_all(c, s)``
``ppermute(perm)``     ``ppermute(inverse perm)``
``all_gather_v``       ``reduce_scatter_v``
``reduce_scatter_v``   ``all_gather_v``
``all_to_all_v(M)``    ``all_to_all_v(M transposed)``
=====================  =========================================

**Gradient convention** (JAX's classic one, and PyTorch's functional collectives'): the objective
is the *sum over ranks* of what each rank computes, so a cotangent arriving on a rank is that
rank's contribution. Hence ``psum`` transposes to ``psum``, and ``all_gather`` to
``psum_scatter``. If every rank computes the same replicated loss, the gradients are that
loss's gradient times the axis size: divide by it, or compute the loss on one rank.

**Axis tuples**: ``psum``, ``all_gather`` and ``psum_scatter`` accept a tuple of axes, major to
minor as in a ``P`` entry, and run one collective per axis (gather minor first, scatter major
first), which gives JAX's layout for any order of axes. The other collectives take one axis.
Axes of size 1 have no communicator: collectives over them are identities.

Example::

    >>> with vsf.simulate(4), vsf.use_mesh(vsf.make_mesh((4,), ("fsdp",))):
    ...     x = local_piece                       # this rank's rows, 1, 2, 1 or 0 of them
    ...     full = vsf.ops.all_gather_v(x, "fsdp", sizes=(1, 2, 1, 0))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vsf.ops import backend
from vsf.ops.backend import AxisGroup, Counts
from vsf.sharding.mesh import Mesh, current_mesh

__all__ = [
    "Linear",
    "Sent",
    "all_gather",
    "all_gather_v",
    "all_to_all",
    "all_to_all_v",
    "apply_linear",
    "axis_index",
    "axis_size",
    "manual_axes",
    "pmax",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "recording",
    "reduce_scatter_v",
]

AxisName = str | Sequence[str]


# -- the one autograd Function: run a linear op, transpose it for the backward ----------------------


class Linear:
    """A linear map of a rank's local tensor (a collective, or a redistribution built from them)
    and its transpose, the map its backward runs under the sum-over-ranks convention.

    Subclass it and run it with :func:`apply_linear` to make it differentiable.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def transpose(self) -> "Linear":
        raise NotImplementedError

    def abstract(self, x: torch.Tensor) -> "tuple[torch.Tensor, Sent]":
        """What ``self(x)`` returns, without communicating (an empty tensor of the result's shape),
        and what it would send: how a manual region is planned (:func:`recording`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be planned inside a jitted shard_map yet (ragged collectives run eagerly only)")


@dataclass(frozen=True)
class Sent:
    """One collective a manual region runs, as its plan lists it: kind, mesh axis, the local shape
    it moves (the gathered shape for an all-gather), and the bytes each rank sends."""

    kind: str
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int


_RECORDERS: list[list[Sent]] = []
_MANUAL: list[tuple[str, frozenset[str]]] = []  # (region name, its manual axes), innermost last


@contextlib.contextmanager
def recording() -> Iterator[list[Sent]]:
    """Collectives run inside record what they would send and return empty results of the right
    shape instead of communicating (a manual region is planned this way, on fake local tensors).

    Example::

        >>> with recording() as sent:
        ...     psum(torch.empty(4), "tp")
        >>> sent[0].kind, sent[0].axis
        ('all_reduce', 'tp')
    """
    _RECORDERS.append([])
    try:
        yield _RECORDERS[-1]
    finally:
        _RECORDERS.pop()


@contextlib.contextmanager
def manual_axes(region: str, axes: Sequence[str]) -> Iterator[None]:
    """Inside, collectives may run only over ``axes`` (those a ``shard_map`` region makes manual)."""
    _MANUAL.append((region, frozenset(axes)))
    try:
        yield
    finally:
        _MANUAL.pop()


def _ring_bytes(kind: str, n: int, x: torch.Tensor) -> int:
    """Bytes each rank sends for ``kind`` over ``n`` ranks on the local tensor ``x`` (ring model)."""
    full = x.numel() * x.element_size()
    return int(round(full * {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "ppermute": 1}.get(kind, (n - 1) / n)))


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Linear) -> torch.Tensor:
        ctx.op = op
        if _RECORDERS:
            out, sent = op.abstract(x)
            _RECORDERS[-1].append(sent)
            return out
        return op(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Collective.apply(grad, ctx.op.transpose()), None


def apply_linear(x: torch.Tensor, op: Linear) -> torch.Tensor:
    """``op(x)``, differentiable (to any order): the backward applies ``op.transpose()``.

    Example::

        >>> y = apply_linear(x, my_redistribution)   # my_redistribution: a vsf.ops.Linear
    """
    return _Collective.apply(x, op)


@dataclass(frozen=True)
class _Psum(Linear):
    g: AxisGroup

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.all_reduce(x, self.g)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        return _sent("all_reduce", self.g, x, tuple(x.shape))

    def transpose(self) -> Linear:
        return self


@dataclass(frozen=True)
class _AllGather(Linear):
    g: AxisGroup
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.all_gather(x, self.g, self.dim)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        shape = list(x.shape)
        shape[self.dim] *= self.g.size
        return _sent("all_gather", self.g, x, tuple(shape))

    def transpose(self) -> Linear:
        return _PsumScatter(self.g, self.dim)


@dataclass(frozen=True)
class _PsumScatter(Linear):
    g: AxisGroup
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.reduce_scatter(x, self.g, self.dim)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        if x.shape[self.dim] % self.g.size:
            raise ValueError(f"psum_scatter over {self.g.axis!r} (size {self.g.size}) needs dim {self.dim} divisible by {self.g.size}, got shape {tuple(x.shape)}")
        shape = list(x.shape)
        shape[self.dim] //= self.g.size
        return _sent("reduce_scatter", self.g, x, tuple(shape))

    def transpose(self) -> Linear:
        return _AllGather(self.g, self.dim)


@dataclass(frozen=True)
class _AllToAll(Linear):
    g: AxisGroup
    split_dim: int
    concat_dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.g.size
        if x.shape[self.split_dim] % n:
            raise ValueError(
                f"all_to_all over {self.g.axis!r} (size {n}) splits dim {self.split_dim} of shape {tuple(x.shape)}, "
                f"which is not divisible by {n}"
            )
        recv = backend.all_to_all(x.movedim(self.split_dim, 0), self.g)
        blocks = recv.reshape(n, recv.shape[0] // n, *recv.shape[1:]).movedim(1, 1 + self.split_dim)
        return blocks.movedim(0, self.concat_dim).flatten(self.concat_dim, self.concat_dim + 1)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        n = self.g.size
        if x.shape[self.split_dim] % n:
            raise ValueError(f"all_to_all over {self.g.axis!r} (size {n}) splits dim {self.split_dim} of shape {tuple(x.shape)}, which is not divisible by {n}")
        shape = list(x.shape)
        shape[self.split_dim] //= n
        shape[self.concat_dim] *= n
        return _sent("all_to_all", self.g, x, tuple(shape))

    def transpose(self) -> Linear:
        return _AllToAll(self.g, self.concat_dim, self.split_dim)


@dataclass(frozen=True)
class _Permute(Linear):
    g: AxisGroup
    pairs: tuple[tuple[int, int], ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, numel, shape = self.g.size, x.numel(), x.shape
        dest = dict(self.pairs)
        sources = {d: s for s, d in self.pairs}
        counts = tuple(tuple(numel if dest.get(i) == j else 0 for j in range(n)) for i in range(n))
        send = backend.per_rank(x.reshape(-1), self.g, lambda t, me: t if me in dest else t[:0])
        recv = backend.exchange(send, self.g, counts)
        return backend.per_rank(recv, self.g, lambda t, me: t if me in sources else t.new_zeros(numel)).reshape(shape)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        return _sent("ppermute", self.g, x, tuple(x.shape))

    def transpose(self) -> Linear:
        return _Permute(self.g, tuple((d, s) for s, d in self.pairs))


@dataclass(frozen=True)
class _AllGatherV(Linear):
    g: AxisGroup
    sizes: tuple[int, ...]
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, sizes = self.g.size, self.sizes
        rows = _rows(x.movedim(self.dim, 0), self.g, lambda me: sizes[me], "all_gather_v")
        if self.g.pads_ragged:
            top = max(sizes)
            padded = backend.per_rank(rows, self.g, lambda t, me: _pad_rows(t, top))
            full = backend.all_gather(padded, self.g, 0)
            out = torch.cat([full[i * top : i * top + s] for i, s in enumerate(sizes)])
        else:
            send = backend.per_rank(rows, self.g, lambda t, me: torch.cat([t] * n))
            out = backend.exchange(send, self.g, tuple((s,) * n for s in sizes))
        return out.movedim(0, self.dim)

    def transpose(self) -> Linear:
        return _ReduceScatterV(self.g, self.sizes, self.dim)


@dataclass(frozen=True)
class _ReduceScatterV(Linear):
    g: AxisGroup
    sizes: tuple[int, ...]
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, sizes = self.g.size, self.sizes
        rows = _rows(x.movedim(self.dim, 0), self.g, lambda me: sum(sizes), "reduce_scatter_v")
        if self.g.pads_ragged:
            top, starts = max(sizes), _starts(sizes)
            padded = torch.cat([_pad_rows(rows[a : a + s], top) for a, s in zip(starts, sizes)])
            summed = backend.reduce_scatter(padded, self.g, 0)
            out = backend.per_rank(summed, self.g, lambda t, me: t[: sizes[me]])
        else:
            recv = backend.exchange(rows, self.g, (tuple(sizes),) * n)
            out = backend.per_rank(recv, self.g, lambda t, me: t.reshape(n, sizes[me], *t.shape[1:]).sum(0))
        return out.movedim(0, self.dim)

    def transpose(self) -> Linear:
        return _AllGatherV(self.g, self.sizes, self.dim)


@dataclass(frozen=True)
class _AllToAllV(Linear):
    g: AxisGroup
    counts: Counts
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.exchange(x.movedim(self.dim, 0), self.g, self.counts).movedim(0, self.dim)

    def transpose(self) -> Linear:
        return _AllToAllV(self.g, tuple(zip(*self.counts)), self.dim)


def _sent(kind: str, g: AxisGroup, x: torch.Tensor, out_shape: tuple[int, ...]) -> tuple[torch.Tensor, Sent]:
    """An empty result of ``out_shape`` and the record of what ``kind`` over ``g`` sends for ``x``."""
    shape = out_shape if kind == "all_gather" else tuple(x.shape)
    return x.new_empty(out_shape), Sent(kind, g.axis, shape, x.dtype, _ring_bytes(kind, g.size, x))


def _rows(x: torch.Tensor, g: AxisGroup, expected: Any, op: str) -> torch.Tensor:
    """``x`` unchanged, after checking that member ``me`` holds ``expected(me)`` rows."""

    def check(t: torch.Tensor, me: int) -> torch.Tensor:
        if t.ndim == 0 or t.shape[0] != expected(me):
            raise ValueError(f"{op} over {g.axis!r}: member {me} should hold {expected(me)} rows along the collective's dim, got shape {tuple(t.shape)}")
        return t

    return backend.per_rank(x, g, check)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _starts(sizes: Sequence[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


# -- resolving axes ------------------------------------------------------------------------------


def _mesh(mesh: Mesh | None, op: str) -> Mesh:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError(f"{op} needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
    return mesh


def _groups(axis: AxisName, mesh: Mesh | None, op: str) -> list[AxisGroup]:
    """The communicators of ``axis`` (a name or a tuple, major to minor), skipping size-1 axes."""
    m = _mesh(mesh, op)
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
        raise ValueError(f"{op} needs a mesh axis name or a tuple of distinct names, got {axis!r}")
    for a in names:
        _check_axis(m, a, op)
    return [backend.axis_group(m, a) for a in names if m.axis_size(a) > 1]


def _check_axis(m: Mesh, axis: str, op: str) -> None:
    """``axis`` is an axis of ``m`` and, inside a ``shard_map`` region, one it makes manual."""
    where = f" inside shard_map({_MANUAL[-1][0]})" if _MANUAL else ""
    if axis not in m.axis_names:
        raise ValueError(f"{op} over {axis!r}{where}: the mesh has axes {tuple(m.axis_names)!r}")
    if _MANUAL and axis not in _MANUAL[-1][1]:
        raise ValueError(f"{op} over {axis!r}{where}: the region makes only {tuple(sorted(_MANUAL[-1][1]))!r} manual")


def _one_group(axis: str, mesh: Mesh | None, op: str) -> AxisGroup | None:
    if not isinstance(axis, str):
        raise ValueError(f"{op} runs over one mesh axis, got {axis!r}; call it once per axis")
    groups = _groups(axis, mesh, op)
    return groups[0] if groups else None


def _axis_size(axis: str, mesh: Mesh | None, op: str) -> int:
    m = _mesh(mesh, op)
    _check_axis(m, axis, op)
    return m.axis_size(axis)


def _sizes(sizes: Sequence[int], n: int, axis: str, op: str) -> tuple[int, ...]:
    out = tuple(int(s) for s in sizes)
    if len(out) != n or any(s < 0 for s in out):
        raise ValueError(f"{op} over {axis!r} (size {n}) needs {n} non-negative sizes, one per rank, got {tuple(sizes)!r}")
    return out


# -- public collectives ----------------------------------------------------------------------------


def psum(x: torch.Tensor, axis: AxisName, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``axis``, on every one of them.

    Example::

        >>> total = vsf.ops.psum(local_grad, "dp")
    """
    for g in _groups(axis, mesh, "psum"):
        x = apply_linear(x, _Psum(g))
    return x


def pmean(x: torch.Tensor, axis: AxisName, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Mean of ``x`` over the ranks of ``axis`` (a tuple: over all of them), on every one of them.

    Example::

        >>> avg = vsf.ops.pmean(local_loss, "dp")
    """
    groups = _groups(axis, mesh, "pmean")
    n = 1
    for g in groups:
        x, n = apply_linear(x, _Psum(g)), n * g.size
    return x / n if n > 1 else x


class _Pmax(torch.autograd.Function):
    """Max over one axis; the gradient goes to the ranks holding the max, split evenly among ties
    (as ``torch.amax``'s does), under the sum-over-ranks convention: ``psum`` of the cotangents."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
        if _RECORDERS:
            out, sent = _sent("all_reduce", g, x, tuple(x.shape))
            _RECORDERS[-1].append(sent)
        else:
            out = backend.all_reduce(x, g, "max")
        ctx.g = g
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, out = ctx.saved_tensors
        hit = (x == out).to(grad.dtype)
        ties = apply_linear(hit, _Psum(ctx.g))
        return apply_linear(grad, _Psum(ctx.g)) * hit / ties.clamp_min(1), None


def pmax(x: torch.Tensor, axis: AxisName, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Elementwise max of ``x`` over the ranks of ``axis``, on every one of them.

    Example::

        >>> top = vsf.ops.pmax(local_scores.amax(), "tp")
    """
    for g in _groups(axis, mesh, "pmax"):
        x = _Pmax.apply(x, g)
    return x


def axis_index(axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """This rank's position along ``axis`` (an int64 scalar tensor; under ``vsf.simulate`` each
    simulated rank holds its own).

    Example::

        >>> first = torch.where(vsf.ops.axis_index("pp") == 0, x, torch.zeros_like(x))
    """
    g = _one_group(axis, mesh, "axis_index")
    zero = torch.zeros((), dtype=torch.int64)
    if g is None or _RECORDERS:
        return zero
    return backend.per_rank(zero, g, lambda t, me: t + me)


def axis_size(axis: AxisName, *, mesh: Mesh | None = None) -> int:
    """The number of ranks along ``axis`` (a tuple: the product).

    Example::

        >>> vsf.ops.axis_size("tp")
        4
    """
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    n = 1
    for a in names:
        n *= _axis_size(a, mesh, "axis_size")
    return n


def all_gather(x: torch.Tensor, axis: AxisName, dim: int = 0, tiled: bool = True, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in axis order (``tiled=False``: stacked on a
    new dim ``dim``).

    Example::

        >>> vsf.ops.all_gather(torch.ones(2, 3), "tp", dim=1).shape   # tp of size 4
        torch.Size([2, 12])
    """
    groups = _groups(axis, mesh, "all_gather")
    if not tiled:
        x = x.unsqueeze(dim)
    for g in reversed(groups):
        x = apply_linear(x, _AllGather(g, dim))
    return x


def psum_scatter(x: torch.Tensor, axis: AxisName, dim: int = 0, tiled: bool = True, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum ``x`` over ``axis`` and keep this rank's equal piece of ``dim`` (``tiled=False``: ``dim``
    has the axis size and is removed).

    Example::

        >>> vsf.ops.psum_scatter(torch.ones(8, 3), "tp").shape     # tp of size 4
        torch.Size([2, 3])
    """
    groups = _groups(axis, mesh, "psum_scatter")
    for g in groups:
        x = apply_linear(x, _PsumScatter(g, dim))
    return x if tiled else x.squeeze(dim)


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, concat_dim: int, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Split ``split_dim`` into equal pieces, send piece ``j`` to rank ``j`` of ``axis``, and
    concatenate the received pieces along ``concat_dim`` in source order (JAX's ``tiled=True``).

    Example::

        >>> vsf.ops.all_to_all(torch.ones(8, 3), "tp", 0, 1).shape  # tp of size 4
        torch.Size([2, 12])
    """
    g = _one_group(axis, mesh, "all_to_all")
    return x if g is None else apply_linear(x, _AllToAll(g, split_dim % x.ndim, concat_dim % x.ndim))


def ppermute(x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Send ``x`` from rank ``src`` to rank ``dst`` of ``axis`` for each ``(src, dst)`` in ``perm``;
    ranks that receive nothing get zeros (JAX's ``ppermute``). ``x`` has one shape on every rank.

    Example::

        >>> n = 4; shifted = vsf.ops.ppermute(x, "pp", [(i, (i + 1) % n) for i in range(n)])
    """
    n = _axis_size(axis, mesh, "ppermute") if isinstance(axis, str) else 0
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= i < n for i in srcs + dsts) or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute over {axis!r} (size {n}) needs (src, dst) pairs of ranks in [0, {n}) with distinct sources and destinations, got {pairs!r}")
    g = _one_group(axis, mesh, "ppermute")
    if g is None:
        return x if pairs else torch.zeros_like(x)
    return apply_linear(x, _Permute(g, pairs))


def all_gather_v(x: torch.Tensor, axis: str, sizes: Sequence[int], dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Ragged all-gather: rank ``i`` of ``axis`` holds ``sizes[i]`` slices along ``dim`` (0
    allowed); every rank gets all of them concatenated in rank order.

    On gloo it moves exactly the data (each rank receives ``sum(sizes) - sizes[me]`` slices); on
    NCCL it gathers pieces padded to ``max(sizes)`` and trims them.

    Example::

        >>> full = vsf.ops.all_gather_v(local_rows, "fsdp", sizes=(1, 2, 1, 0))
    """
    g = _one_group(axis, mesh, "all_gather_v")
    sizes = _sizes(sizes, _axis_size(axis, mesh, "all_gather_v"), axis, "all_gather_v")
    return _identity_rows(x, dim, sizes[0], axis, "all_gather_v") if g is None else apply_linear(x, _AllGatherV(g, sizes, dim % x.ndim))


def reduce_scatter_v(x: torch.Tensor, axis: str, sizes: Sequence[int], dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Ragged reduce-scatter: every rank holds ``sum(sizes)`` slices along ``dim``; rank ``i`` of
    ``axis`` gets the sum over ranks of the ``i``-th run of ``sizes[i]`` slices.

    Example::

        >>> mine = vsf.ops.reduce_scatter_v(full_grad, "fsdp", sizes=(1, 2, 1, 0))
    """
    g = _one_group(axis, mesh, "reduce_scatter_v")
    sizes = _sizes(sizes, _axis_size(axis, mesh, "reduce_scatter_v"), axis, "reduce_scatter_v")
    return _identity_rows(x, dim, sizes[0], axis, "reduce_scatter_v") if g is None else apply_linear(x, _ReduceScatterV(g, sizes, dim % x.ndim))


def all_to_all_v(x: torch.Tensor, axis: str, send_sizes: Sequence[Sequence[int]], dim: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Ragged all-to-all along ``dim``: ``send_sizes[i][j]`` slices go from rank ``i`` to rank ``j``.

    ``send_sizes`` is the whole matrix, the same on every rank (a rank receives column ``me``).
    Rank ``i``'s ``x`` holds ``sum(send_sizes[i])`` slices: the block for rank 0, then rank 1, ...;
    the result stacks the blocks received from rank 0, 1, ... When each rank knows only its own
    row, gather the matrix first: ``all_gather(counts[None], axis).tolist()``.

    Example::

        >>> y = vsf.ops.all_to_all_v(x, "ep", [[1, 0], [2, 3]])   # rank 0 keeps 1 row, rank 1 sends 2 to rank 0
    """
    n = _axis_size(axis, mesh, "all_to_all_v") if isinstance(axis, str) else 0
    counts = tuple(_sizes(row, n, axis, "all_to_all_v") for row in send_sizes)
    if len(counts) != n:
        raise ValueError(f"all_to_all_v over {axis!r} (size {n}) needs an {n}x{n} send_sizes matrix, got {len(counts)} rows")
    g = _one_group(axis, mesh, "all_to_all_v")
    return _identity_rows(x, dim, counts[0][0], axis, "all_to_all_v") if g is None else apply_linear(x, _AllToAllV(g, counts, dim % x.ndim))


def _identity_rows(x: torch.Tensor, dim: int, rows: int, axis: str, op: str) -> torch.Tensor:
    if x.shape[dim] != rows:
        raise ValueError(f"{op} over size-1 axis {axis!r}: dim {dim} of shape {tuple(x.shape)} should have {rows} slices")
    return x
