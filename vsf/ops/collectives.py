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
``pmean``              ``pmean``
``pmax``               ``psum``, to the ranks holding the max
=====================  =========================================

The ragged variants live in :mod:`vsf.ops.ragged`; ``axis_index`` and ``axis_size`` say where a
rank is. Inside a manual region (:mod:`vsf.ops.recording`) a collective may run only over the
axes the region makes manual; inside a region traced into a ``vsf.jit`` graph each collective is
a node of the graph (:mod:`vsf.ops.region`), and its transpose the backward's.

**Gradient convention** (JAX's classic one, and PyTorch's functional collectives'): the objective
is the *sum over ranks* of what each rank computes, so a cotangent arriving on a rank is that
rank's contribution. Hence ``psum`` transposes to ``psum``, and ``all_gather`` to
``psum_scatter``. If every rank computes the same replicated loss, the gradients are that
loss's gradient times the axis size: divide by it, or compute the loss on one rank.

**Axis tuples**: ``psum``, ``pmean``, ``pmax``, ``all_gather`` and ``psum_scatter`` accept a tuple of axes, major to
minor as in a ``P`` entry, and run one collective per axis (gather minor first, scatter major
first), which gives JAX's layout for any order of axes. The other collectives take one axis.
Axes of size 1 have no communicator: collectives over them are identities.

Example::

    >>> with vsf.simulate(4), vsf.use_mesh(vsf.make_mesh((4,), ("tp",))):
    ...     total = vsf.ops.psum(local_piece, "tp")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vsf.ops import backend, region
from vsf.ops.backend import AxisGroup
from vsf.ops.recording import Sent, check_axis, current_region, sent, traces_step
from vsf.sharding.mesh import Mesh, current_mesh

__all__ = [
    "Linear",
    "all_gather",
    "all_to_all",
    "apply_linear",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "rebound",
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

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        """What ``self(x)`` returns, without communicating (an empty tensor of the result's shape),
        and what it would send: a traced region's node (:mod:`vsf.ops.region`) and its plan line."""
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a jitted shard_map")

    #: the tensor dims whose layout the collective changes: over the automatic axes of a jitted
    #: region its operand may be split on any other dim (each rank then runs it on its piece)
    moves: tuple[int, ...] = ()
    #: a sum of per-rank terms goes through it term by term (it is linear)
    passes_partials = True
    #: its result is the same on every rank of its axis (a sum, a gather), whatever each rank gave
    replicates = False


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Linear, key: int | None) -> torch.Tensor:
        ctx.op, ctx.key = op, key
        return _run(x, op, key)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _Collective.apply(grad, ctx.op.transpose(), ctx.key), None, None


def _run(x: torch.Tensor, op: Any, key: int | None) -> torch.Tensor:
    """``op(x)``; inside region ``key`` traced into a ``vsf.jit`` step, the node that runs it."""
    if key is not None:
        return region.collective(x, region.Call(op, key))
    if traces_step():
        raise ValueError(
            f"an {op.abstract(x)[1].kind} over {op.g.axis!r} inside vsf.jit: the named-axis collectives of vsf.ops run only inside a vsf.shard_map region"
        )
    return op(x)


def apply_linear(x: torch.Tensor, op: Linear) -> torch.Tensor:
    """``op(x)``, differentiable (to any order): the backward applies ``op.transpose()``.

    Example::

        >>> y = apply_linear(x, my_redistribution)   # my_redistribution: a vsf.ops.Linear
    """
    return _Collective.apply(x, op, current_region())


def rebound(op: Any) -> Any:
    """``op`` (a collective a traced region recorded) with its axis's communicator as this run has
    it (a step is traced with the simulation switched off, and runs with it on).

    Example::

        >>> rebound(call(node.args[-1]).op)(local)
    """
    return dataclasses.replace(op, g=backend.axis_group(op.g.mesh, op.g.axis))


@dataclass(frozen=True)
class _Psum(Linear):
    g: AxisGroup
    replicates = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.all_reduce(x, self.g)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        return sent("all_reduce", self.g, x, tuple(x.shape))

    def transpose(self) -> Linear:
        return self


@dataclass(frozen=True)
class _AllGather(Linear):
    g: AxisGroup
    dim: int
    replicates = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.all_gather(x, self.g, self.dim)

    @property
    def moves(self) -> tuple[int, ...]:
        return (self.dim,)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        shape = list(x.shape)
        shape[self.dim] *= self.g.size
        return sent("all_gather", self.g, x, tuple(shape))

    def transpose(self) -> Linear:
        return _PsumScatter(self.g, self.dim)


@dataclass(frozen=True)
class _PsumScatter(Linear):
    g: AxisGroup
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.reduce_scatter(x, self.g, self.dim)

    @property
    def moves(self) -> tuple[int, ...]:
        return (self.dim,)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        if x.shape[self.dim] % self.g.size:
            raise ValueError(
                f"psum_scatter over {self.g.axis!r} (size {self.g.size}) needs dim {self.dim} divisible by {self.g.size}, got shape {tuple(x.shape)}"
            )
        shape = list(x.shape)
        shape[self.dim] //= self.g.size
        return sent("reduce_scatter", self.g, x, tuple(shape))

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

    @property
    def moves(self) -> tuple[int, ...]:
        return (self.split_dim, self.concat_dim)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        n = self.g.size
        if x.shape[self.split_dim] % n:
            raise ValueError(
                f"all_to_all over {self.g.axis!r} (size {n}) splits dim {self.split_dim} of shape {tuple(x.shape)}, which is not divisible by {n}"
            )
        shape = list(x.shape)
        shape[self.split_dim] //= n
        shape[self.concat_dim] *= n
        return sent("all_to_all", self.g, x, tuple(shape))

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
        return sent("ppermute", self.g, x, tuple(x.shape))

    def transpose(self) -> Linear:
        return _Permute(self.g, tuple((d, s) for s, d in self.pairs))


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
        check_axis(m, a, op)
    return [backend.axis_group(m, a) for a in names if m.axis_size(a) > 1]


def one_group(axis: str, mesh: Mesh | None, op: str) -> AxisGroup | None:
    """The communicator of the one axis ``axis`` (``None`` for a size-1 axis), for collective ``op``."""
    if not isinstance(axis, str):
        raise ValueError(f"{op} runs over one mesh axis, got {axis!r}; call it once per axis")
    groups = _groups(axis, mesh, op)
    return groups[0] if groups else None


def axis_size_of(axis: str, mesh: Mesh | None, op: str) -> int:
    """The size of ``axis`` (checked as :func:`vsf.ops.recording.check_axis` does), for collective ``op``."""
    m = _mesh(mesh, op)
    check_axis(m, axis, op)
    return m.axis_size(axis)


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


@dataclass(frozen=True)
class _Max:
    """The elementwise max over one axis (not linear: a partial sum does not go through it)."""

    g: AxisGroup
    moves = ()
    passes_partials = False
    replicates = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.all_reduce(x, self.g, "max")

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        return sent("all_reduce", self.g, x, tuple(x.shape))


class _Pmax(torch.autograd.Function):
    """Max over one axis; the gradient goes to the ranks holding the max, split evenly among ties
    (as ``torch.amax``'s does), under the sum-over-ranks convention: ``psum`` of the cotangents."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: AxisGroup, key: int | None) -> torch.Tensor:
        out = _run(x, _Max(g), key)
        ctx.g, ctx.key = g, key
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, out = ctx.saved_tensors
        hit = (x == out).to(grad.dtype)
        psum = _Psum(ctx.g)
        ties = _Collective.apply(hit, psum, ctx.key)
        return _Collective.apply(grad, psum, ctx.key) * hit / ties.clamp_min(1), None, None


def pmax(x: torch.Tensor, axis: AxisName, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Elementwise max of ``x`` over the ranks of ``axis``, on every one of them.

    Example::

        >>> top = vsf.ops.pmax(local_scores.amax(), "tp")
    """
    for g in _groups(axis, mesh, "pmax"):
        x = _Pmax.apply(x, g, current_region())
    return x


def axis_index(axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """This rank's position along ``axis`` (an int64 scalar tensor; under ``vsf.simulate`` each
    simulated rank holds its own).

    Example::

        >>> first = torch.where(vsf.ops.axis_index("pp") == 0, x, torch.zeros_like(x))
    """
    g = one_group(axis, mesh, "axis_index")
    if g is None:
        return torch.zeros((), dtype=torch.int64)
    key = current_region()
    return Index(g)() if key is None else region.axis_index(region.Call(Index(g), key))


@dataclass(frozen=True)
class Index:
    """This rank's position along one axis, as a tensor (every simulated rank's under ``vsf.simulate``).

    Example::

        >>> Index(backend.axis_group(mesh, "tp"))()
    """

    g: AxisGroup

    def __call__(self) -> torch.Tensor:
        return backend.per_rank(torch.zeros((), dtype=torch.int64), self.g, lambda t, me: t + me)


def axis_size(axis: AxisName, *, mesh: Mesh | None = None) -> int:
    """The number of ranks along ``axis`` (a tuple: the product).

    Example::

        >>> vsf.ops.axis_size("tp")
        4
    """
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    n = 1
    for a in names:
        n *= axis_size_of(a, mesh, "axis_size")
    return n


def all_gather(
    x: torch.Tensor, axis: AxisName, dim: int = 0, tiled: bool = True, *, mesh: Mesh | None = None
) -> torch.Tensor:
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


def psum_scatter(
    x: torch.Tensor, axis: AxisName, dim: int = 0, tiled: bool = True, *, mesh: Mesh | None = None
) -> torch.Tensor:
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


def all_to_all(
    x: torch.Tensor, axis: str, split_dim: int, concat_dim: int, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Split ``split_dim`` into equal pieces, send piece ``j`` to rank ``j`` of ``axis``, and
    concatenate the received pieces along ``concat_dim`` in source order (JAX's ``tiled=True``).

    Example::

        >>> vsf.ops.all_to_all(torch.ones(8, 3), "tp", 0, 1).shape  # tp of size 4
        torch.Size([2, 12])
    """
    g = one_group(axis, mesh, "all_to_all")
    return x if g is None else apply_linear(x, _AllToAll(g, split_dim % x.ndim, concat_dim % x.ndim))


def ppermute(x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Send ``x`` from rank ``src`` to rank ``dst`` of ``axis`` for each ``(src, dst)`` in ``perm``;
    ranks that receive nothing get zeros (JAX's ``ppermute``). ``x`` has one shape on every rank.

    Example::

        >>> n = 4; shifted = vsf.ops.ppermute(x, "pp", [(i, (i + 1) % n) for i in range(n)])
    """
    n = axis_size_of(axis, mesh, "ppermute") if isinstance(axis, str) else 0
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if any(not 0 <= i < n for i in srcs + dsts) or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"ppermute over {axis!r} (size {n}) needs (src, dst) pairs of ranks in [0, {n}) with distinct sources and destinations, got {pairs!r}"
        )
    g = one_group(axis, mesh, "ppermute")
    if g is None:
        return x if pairs else torch.zeros_like(x)
    return apply_linear(x, _Permute(g, pairs))
