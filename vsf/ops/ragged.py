"""Ragged named-axis collectives: the pieces differ in size from rank to rank.

``all_gather_v`` and ``reduce_scatter_v`` transpose to each other and ``all_to_all_v(M)`` to
``all_to_all_v(M transposed)`` (see :mod:`vsf.ops.collectives` for the gradient convention).
``all_to_all_counted`` is ``all_to_all_v`` whose matrix is a tensor computed in the step (an
expert-parallel dispatch's token counts), its operand and result padded to fixed row counts, so
that it runs inside ``vsf.jit`` with counts that differ from step to step and rank to rank.
On gloo and simulated ranks they move exactly the data through one ``all_to_all_single`` with
split sizes; on NCCL all-gather and reduce-scatter pad each piece to the largest one.

**Inside a jitted region** (``vsf.shard_map`` in ``vsf.jit``) each is a collective of the plan
where its operand and its result have one shape on every rank, as every value of a traced graph
has: ``all_to_all_v`` whose send matrix has equal row sums (each rank sends as many rows) and
equal column sums (each receives as many), which covers a capacity-balanced MoE dispatch; and
``all_gather_v`` / ``reduce_scatter_v`` with equal sizes. Other sizes would give a value a
different shape on each rank, which a traced graph cannot hold: an error says so.

Example::

    >>> full = vsf.ops.all_gather_v(local_rows, "fsdp", sizes=(1, 2, 1, 0))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vsf.ops import backend, region
from vsf.ops.backend import AxisGroup, Counts
from vsf.ops.collectives import Linear, apply_linear, axis_size_of, one_group
from vsf.ops.recording import Sent, current_region, sent, traces_step
from vsf.sharding.mesh import Mesh

__all__ = ["all_gather_v", "all_to_all_counted", "all_to_all_v", "reduce_scatter_v"]


@dataclass(frozen=True)
class _AllGatherV(Linear):
    g: AxisGroup
    sizes: tuple[int, ...]
    dim: int
    replicates = True

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

    @property
    def moves(self) -> tuple[int, ...]:
        return (self.dim,)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        _one_shape(self.sizes, "all_gather_v", self.g.axis, "its operand")
        _traced_rows(x, self.dim, self.sizes[0], "all_gather_v")
        shape = list(x.shape)
        shape[self.dim] = sum(self.sizes)
        return sent("all_gather", self.g, x, tuple(shape))

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

    @property
    def moves(self) -> tuple[int, ...]:
        return (self.dim,)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        _one_shape(self.sizes, "reduce_scatter_v", self.g.axis, "its result")
        _traced_rows(x, self.dim, sum(self.sizes), "reduce_scatter_v")
        shape = list(x.shape)
        shape[self.dim] = self.sizes[0]
        return sent("reduce_scatter", self.g, x, tuple(shape))

    def transpose(self) -> Linear:
        return _AllGatherV(self.g, self.sizes, self.dim)


@dataclass(frozen=True)
class _AllToAllV(Linear):
    g: AxisGroup
    counts: Counts
    dim: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return backend.exchange(x.movedim(self.dim, 0), self.g, self.counts).movedim(0, self.dim)

    @property
    def moves(self) -> tuple[int, ...]:
        return (self.dim,)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        """The result's shape and what the rank that sends the most sends (rows to other ranks)."""
        _one_shape(
            tuple(sum(row) for row in self.counts),
            "all_to_all_v",
            self.g.axis,
            "its operand (the send matrix's row sums)",
        )
        _one_shape(
            tuple(sum(col) for col in zip(*self.counts)),
            "all_to_all_v",
            self.g.axis,
            "its result (the send matrix's column sums)",
        )
        _traced_rows(x, self.dim, sum(self.counts[0]), "all_to_all_v")
        shape = list(x.shape)
        shape[self.dim] = sum(row[0] for row in self.counts)
        row_bytes = x.numel() // max(x.shape[self.dim], 1) * x.element_size()
        most = max(sum(c for j, c in enumerate(row) if j != i) for i, row in enumerate(self.counts))
        return sent("all_to_all_v", self.g, x, tuple(shape), most * row_bytes)

    def transpose(self) -> Linear:
        return _AllToAllV(self.g, tuple(zip(*self.counts)), self.dim)


@dataclass(frozen=True)
class _AllToAllCounted:
    """The ragged all-to-all of :func:`all_to_all_counted`: ``rows_in`` rows in (a rank sends the
    first ``sum(counts[me])``), ``rows_out`` rows out (what it receives, then zero rows); with
    ``transposed`` it exchanges by the transposed matrix, which makes it its own transpose's."""

    g: AxisGroup
    rows_in: int
    rows_out: int
    transposed: bool
    moves = (0,)
    passes_partials = True
    replicates = False

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return backend.exchange_counted(x, counts.T if self.transposed else counts, self.g, self.rows_out)

    def abstract(self, x: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        """The result's shape and the most the average rank sends: the rows of the smaller of its
        operand and its result (the ranks together send as many rows as they receive), all
        leaving the rank. A dispatch and its combine so count each token copy once (their
        analytic volume); which rank sends more depends on the counts, known when it runs: at
        most its operand's rows (a combine's: its receive buffer, full when every token copy of
        the axis is routed to its experts), the record's ``most`` where that is more."""
        _traced_rows(x, 0, self.rows_in, "all_to_all_counted")
        row_bytes = x.numel() // max(x.shape[0], 1) * x.element_size()
        average = min(self.rows_in, self.rows_out) * row_bytes
        most = self.rows_in * row_bytes
        return sent("all_to_all_v", self.g, x, (self.rows_out, *x.shape[1:]), average, most if most > average else None)

    def transpose(self) -> "_AllToAllCounted":
        return _AllToAllCounted(self.g, self.rows_out, self.rows_in, not self.transposed)


class _Counted(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: torch.Tensor, op: _AllToAllCounted, key: int | None) -> torch.Tensor:
        ctx.op, ctx.key = op, key
        ctx.save_for_backward(counts)
        if key is not None:
            return region.exchange(x, counts, region.Call(op, key))
        if traces_step():
            raise ValueError(
                f"an all_to_all_counted over {op.g.axis!r} inside vsf.jit: the named-axis collectives of vsf.ops run only inside a vsf.shard_map region"
            )
        return op(x, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (counts,) = ctx.saved_tensors
        return _Counted.apply(grad, counts, ctx.op.transpose(), ctx.key), None, None, None


def _one_shape(rows: tuple[int, ...], op: str, axis: str, what: str) -> None:
    """Inside a jitted region: ``rows`` (per rank) must be equal, a traced value having one shape."""
    if len(set(rows)) > 1:
        raise ValueError(
            f"{op} over {axis!r} inside a jitted shard_map: {what} would hold {rows} rows on ranks 0..{len(rows) - 1}, "
            "but a value of a traced graph has one shape on every rank. Inside vsf.jit give every rank as many rows "
            "(pad to the largest piece), or run it outside vsf.jit (eager shard_map takes any sizes)"
        )


def _traced_rows(x: torch.Tensor, dim: int, rows: int, op: str) -> None:
    if x.shape[dim] != rows:
        raise ValueError(f"{op}: every rank should hold {rows} rows along dim {dim}, got shape {tuple(x.shape)}")


def _rows(x: torch.Tensor, g: AxisGroup, expected: Any, op: str) -> torch.Tensor:
    """``x`` unchanged, after checking that member ``me`` holds ``expected(me)`` rows."""

    def check(t: torch.Tensor, me: int) -> torch.Tensor:
        if t.ndim == 0 or t.shape[0] != expected(me):
            raise ValueError(
                f"{op} over {g.axis!r}: member {me} should hold {expected(me)} rows along the collective's dim, got shape {tuple(t.shape)}"
            )
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


def _sizes(sizes: Sequence[int], n: int, axis: str, op: str) -> tuple[int, ...]:
    out = tuple(int(s) for s in sizes)
    if len(out) != n or any(s < 0 for s in out):
        raise ValueError(
            f"{op} over {axis!r} (size {n}) needs {n} non-negative sizes, one per rank, got {tuple(sizes)!r}"
        )
    return out


def all_gather_v(
    x: torch.Tensor, axis: str, sizes: Sequence[int], dim: int = 0, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Ragged all-gather: rank ``i`` of ``axis`` holds ``sizes[i]`` slices along ``dim`` (0
    allowed); every rank gets all of them concatenated in rank order.

    On gloo it moves exactly the data (each rank receives ``sum(sizes) - sizes[me]`` slices); on
    NCCL it gathers pieces padded to ``max(sizes)`` and trims them.

    Example::

        >>> full = vsf.ops.all_gather_v(local_rows, "fsdp", sizes=(1, 2, 1, 0))
    """
    g = one_group(axis, mesh, "all_gather_v")
    sizes = _sizes(sizes, axis_size_of(axis, mesh, "all_gather_v"), axis, "all_gather_v")
    return (
        _identity_rows(x, dim, sizes[0], axis, "all_gather_v")
        if g is None
        else apply_linear(x, _AllGatherV(g, sizes, dim % x.ndim))
    )


def reduce_scatter_v(
    x: torch.Tensor, axis: str, sizes: Sequence[int], dim: int = 0, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Ragged reduce-scatter: every rank holds ``sum(sizes)`` slices along ``dim``; rank ``i`` of
    ``axis`` gets the sum over ranks of the ``i``-th run of ``sizes[i]`` slices.

    Example::

        >>> mine = vsf.ops.reduce_scatter_v(full_grad, "fsdp", sizes=(1, 2, 1, 0))
    """
    g = one_group(axis, mesh, "reduce_scatter_v")
    sizes = _sizes(sizes, axis_size_of(axis, mesh, "reduce_scatter_v"), axis, "reduce_scatter_v")
    return (
        _identity_rows(x, dim, sizes[0], axis, "reduce_scatter_v")
        if g is None
        else apply_linear(x, _ReduceScatterV(g, sizes, dim % x.ndim))
    )


def all_to_all_v(
    x: torch.Tensor, axis: str, send_sizes: Sequence[Sequence[int]], dim: int = 0, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Ragged all-to-all along ``dim``: ``send_sizes[i][j]`` slices go from rank ``i`` to rank ``j``.

    ``send_sizes`` is the whole matrix, the same on every rank (a rank receives column ``me``).
    Rank ``i``'s ``x`` holds ``sum(send_sizes[i])`` slices: the block for rank 0, then rank 1, ...;
    the result stacks the blocks received from rank 0, 1, ... When each rank knows only its own
    row, gather the matrix first: ``all_gather(counts[None], axis).tolist()``.

    Example::

        >>> y = vsf.ops.all_to_all_v(x, "ep", [[1, 0], [2, 3]])   # rank 0 keeps 1 row, rank 1 sends 2 to rank 0
    """
    n = axis_size_of(axis, mesh, "all_to_all_v") if isinstance(axis, str) else 0
    counts = tuple(_sizes(row, n, axis, "all_to_all_v") for row in send_sizes)
    if len(counts) != n:
        raise ValueError(
            f"all_to_all_v over {axis!r} (size {n}) needs an {n}x{n} send_sizes matrix, got {len(counts)} rows"
        )
    g = one_group(axis, mesh, "all_to_all_v")
    return (
        _identity_rows(x, dim, counts[0][0], axis, "all_to_all_v")
        if g is None
        else apply_linear(x, _AllToAllV(g, counts, dim % x.ndim))
    )


def all_to_all_counted(
    x: torch.Tensor, counts: torch.Tensor, axis: str, rows: int, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Ragged all-to-all along dim 0 whose send matrix is a tensor: ``counts[i][j]`` rows go from
    rank ``i`` of ``axis`` to rank ``j`` (``counts``: an ``[n, n]`` integer tensor, the same on every
    rank of the axis, e.g. ``all_gather`` of each rank's own row; it may differ from step to step).

    Rank ``i`` sends the first ``sum(counts[i])`` rows of ``x`` (the block for rank 0, then rank
    1, ...); the result stacks the blocks received from rank 0, 1, ... and pads them with zero rows
    to ``rows`` (at least the most a rank can receive), so that operand and result have one shape
    on every rank and every step, as a value of a ``vsf.jit`` graph must. Its backward exchanges
    the cotangent's received rows back by the transposed matrix. This is an expert-parallel
    dispatch (tokens to the ranks that hold their experts) and, transposed, its combine.

    Example::

        >>> counts = vsf.ops.all_gather(mine[None], "ep")          # [n, n]: rank i's row is its own
        >>> got = vsf.ops.all_to_all_counted(rows, counts, "ep", rows=n * rows.shape[0])
    """
    n = axis_size_of(axis, mesh, "all_to_all_counted")
    if counts.shape != (n, n) or counts.dtype.is_floating_point:
        raise ValueError(
            f"all_to_all_counted over {axis!r} (size {n}) needs an {n}x{n} integer counts tensor, got {counts.dtype} of shape {tuple(counts.shape)}"
        )
    g = one_group(axis, mesh, "all_to_all_counted")
    if g is None:
        return _padded_rows(x, rows)
    return _Counted.apply(x, counts, _AllToAllCounted(g, x.shape[0], rows, False), current_region())


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] > rows:
        raise ValueError(f"all_to_all_counted: {x.shape[0]} rows do not fit the result's {rows}")
    return _pad_rows(x, rows)


def _identity_rows(x: torch.Tensor, dim: int, rows: int, axis: str, op: str) -> torch.Tensor:
    if x.shape[dim] != rows:
        raise ValueError(
            f"{op} over size-1 axis {axis!r}: dim {dim} of shape {tuple(x.shape)} should have {rows} slices"
        )
    return x
