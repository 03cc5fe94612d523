"""The backend switch: how a collective over one mesh axis is carried out.

Three backends run the same collectives on a rank's local tensor:

* ``"simulated"`` - inside :func:`vsf.simulate` (``LocalTensorMode``), where a local tensor is a
  ``LocalTensor`` holding every rank's value. Even collectives run through PyTorch's functional
  collectives, which compute the right per-rank values there; the ragged exchange and per-rank
  steps (whose sizes differ by rank) are computed here, rank by rank.
* ``"gloo"`` - real processes on CPU. gloo rejects uneven list ``all_gather`` / ``all_to_all``, so
  every ragged collective goes through ``all_to_all_single`` with split sizes, which moves
  exactly the data (no padding on the wire).
* ``"nccl"`` - CUDA. Ragged all-gather and reduce-scatter pad each piece to the largest one and use
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (NCCL's fastest collectives), then trim.

A planning-only simulation (``vsf.simulate(n, compute=False)``) takes the process-group path on
the fake group: shapes are right, values are not.

Example::

    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    ...     axis_group(mesh, "tp").kind, axis_group(mesh, "tp").size
    ('simulated', 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from vsf import _compat, runtime
from vsf.sharding.mesh import Mesh

__all__ = [
    "AxisGroup",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_group",
    "exchange",
    "exchange_counted",
    "local_ranks",
    "per_rank",
    "reduce_scatter",
]

Counts = tuple[tuple[int, ...], ...]


class AxisGroup(NamedTuple):
    """One mesh axis as a communicator: its mesh, name, size, process group and backend kind."""

    mesh: Mesh
    axis: str
    size: int
    group: dist.ProcessGroup
    kind: str  # "simulated" | "gloo" | "nccl"

    def index(self, rank: int) -> int:
        """Position of global ``rank`` along the axis (its rank inside the axis group)."""
        return self.mesh.coordinate(rank)[self.axis]

    def members(self, rank: int) -> tuple[int, ...]:
        """Global ranks of ``rank``'s axis group, in axis order (in its own copy of a sub-mesh: ``Mesh.copy_devices``)."""
        coord, devices = self.mesh.coordinate(rank), self.mesh.copy_devices(rank)
        out = []
        for i in range(self.size):
            coord[self.axis] = i
            flat = 0
            for name, size in self.mesh.shape.items():
                flat = flat * size + coord[name]
            out.append(devices[flat])
        return tuple(out)

    @property
    def pads_ragged(self) -> bool:
        """Whether ragged all-gather / reduce-scatter pad to the largest piece (NCCL) instead of
        moving exactly the data through ``all_to_all_single`` (gloo, simulated)."""
        return self.kind == "nccl"


def axis_group(mesh: Mesh, axis: str) -> AxisGroup:
    """The communicator of ``mesh`` axis ``axis`` (which must be larger than 1)."""
    size = mesh.axis_size(axis)
    if size == 1:
        raise ValueError(f"mesh axis {axis!r} has size 1 and no communicator; collectives over it are identities")
    group = mesh.device_mesh.get_group(axis)
    if _compat.active_local_mode() is not None:
        try:
            for r in local_ranks():
                mesh.copy_devices(r)
        except ValueError:
            raise ValueError(
                f"under simulation a collective needs a mesh whose copies hold all {runtime.world_size()} ranks (every "
                f"rank's value lives in this process: the whole mesh, or a sub-mesh of it), got {mesh!r}; pass the whole mesh and name the axis"
            ) from None
        kind = "simulated"
    else:
        kind = "nccl" if "nccl" in str(dist.get_backend(group)) and mesh.device_type == "cuda" else "gloo"
    return AxisGroup(mesh, axis, size, group, kind)


def local_ranks() -> list[int]:
    """The global ranks whose values this process computes: every simulated rank under
    :func:`vsf.simulate`, else this process's rank."""
    mode = _compat.active_local_mode()
    return sorted(mode.ranks) if mode is not None else [runtime.rank()]


# -- even collectives: PyTorch's functional collectives (right on every backend) ----------------


def all_reduce(x: torch.Tensor, g: AxisGroup, op: str = "sum") -> torch.Tensor:
    """The reduction ``op`` (``"sum"``, ``"max"``) of ``x`` over the axis, on every member."""
    return _wait(_compat.functional_collectives.all_reduce(x.contiguous(), op, g.group))


def all_gather(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    """The members' ``x`` concatenated along ``dim`` in axis order."""
    return _wait(_compat.functional_collectives.all_gather_single(x.contiguous(), dim, g.group))


def reduce_scatter(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    """Member ``i`` gets the ``i``-th of ``size`` equal pieces (along ``dim``) of the sum of ``x``."""
    if x.shape[dim] % g.size:
        raise ValueError(
            f"reduce-scatter over {g.axis!r} (size {g.size}) needs dim {dim} divisible by {g.size}, got shape {tuple(x.shape)}"
        )
    return _wait(_compat.functional_collectives.reduce_scatter_single(x.contiguous(), "sum", dim, g.group))


def all_to_all(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Even all-to-all over dim 0: the ``j``-th of ``size`` row blocks goes to member ``j``;
    the received blocks are stacked in source order."""
    if x.shape[0] % g.size:
        raise ValueError(
            f"all-to-all over {g.axis!r} (size {g.size}) needs dim 0 divisible by {g.size}, got shape {tuple(x.shape)}"
        )
    return _wait(_compat.functional_collectives.all_to_all_single(x.contiguous(), None, None, g.group))


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, _compat.functional_collectives.AsyncCollectiveTensor) else t


# -- ragged steps: per-rank functions and the exchange ------------------------------------------


def per_rank(
    x: torch.Tensor, g: AxisGroup, fn: Callable[..., torch.Tensor], *, with_rank: bool = False
) -> torch.Tensor:
    """Apply ``fn(local, index)`` on each rank, ``index`` being the rank's position on the axis
    (``fn(local, index, rank)`` with ``with_rank``, ``rank`` the global rank).

    Use it for local steps whose sizes depend on the rank (slicing one's own piece, padding it).
    Under simulation every simulated rank runs ``fn`` on its own value.
    """

    def call(v: torch.Tensor, r: int) -> torch.Tensor:
        return fn(v, g.index(r), r) if with_rank else fn(v, g.index(r))

    if g.kind != "simulated":
        return call(x, runtime.rank())
    values = _values(x)
    with _compat.local_mode_disabled():
        return _compat.make_local({r: call(v, r) for r, v in values.items()})


def exchange(x: torch.Tensor, g: AxisGroup, counts: Counts) -> torch.Tensor:
    """Ragged all-to-all over dim 0, moving exactly the data.

    ``counts[i][j]`` is the number of dim-0 rows member ``i`` sends to member ``j`` (the same
    matrix on every rank). Member ``i``'s ``x`` holds ``sum(counts[i])`` rows: the block for
    member 0, then for member 1, ... The result holds ``sum(counts[i][j] for i)`` rows on member
    ``j``: the blocks from member 0, 1, ... in order.
    """
    n = g.size
    if len(counts) != n or any(len(row) != n for row in counts) or any(c < 0 for row in counts for c in row):
        raise ValueError(f"exchange over {g.axis!r} needs a {n}x{n} matrix of non-negative row counts, got {counts!r}")
    if g.kind == "simulated":
        return _simulated_exchange(x, g, counts)
    me = g.index(runtime.rank())
    _check_rows(x, sum(counts[me]), g, me)
    # the functional collective, so that a traced program (vsf.jit's, over local shards) records it
    recv = [counts[i][me] for i in range(n)]
    return _wait(_compat.functional_collectives.all_to_all_single(x.contiguous(), recv, list(counts[me]), g.group))


def exchange_counted(x: torch.Tensor, counts: torch.Tensor, g: AxisGroup, rows: int) -> torch.Tensor:
    """:func:`exchange` with the row counts a tensor computed this step (an ``[n, n]`` integer
    matrix, the same on every member of the axis group, read when it runs), member ``i`` sending
    the first ``sum(counts[i])`` rows of ``x``; the result is padded with zero rows to ``rows``.
    Each axis group has its own matrix (the groups of another axis route their own tokens).
    """
    n = g.size
    if counts.shape != (n, n):
        raise ValueError(
            f"exchange over {g.axis!r} needs a {n}x{n} matrix of row counts, got shape {tuple(counts.shape)}"
        )
    if g.kind == "simulated":
        xs, cs = _values(x), _values(counts)
        with _compat.local_mode_disabled():
            out = {}
            for r in xs:
                matrix, me = _read_counts(cs[r]), g.index(r)
                blocks = [xs[src][sum(matrix[i][:me]) : sum(matrix[i][: me + 1])] for i, src in enumerate(g.members(r))]
                out[r] = _padded(torch.cat(blocks), rows, g.axis, me)
            return _compat.make_local(out)
    return torch.ops.vsf.exchange_counted(x, counts, g.group.group_name, g.axis, rows)


def _read_counts(counts: torch.Tensor) -> list[list[int]]:
    """The rows of a count matrix as Python ints, each read by ``item()`` (an op a dispatch mode
    sees, where ``tolist()`` reads memory directly): a simulated step that reads them is one whose
    Python code depends on computed values, which :mod:`vsf.jit.replay` must see to refuse to
    record it (a recording would keep this step's counts for every later step)."""
    return [[int(c.item()) for c in row.unbind(0)] for row in counts.unbind(0)]


@torch.library.custom_op("vsf::exchange_counted", mutates_args=())
def _exchange_counted(x: torch.Tensor, counts: torch.Tensor, group: str, axis: str, rows: int) -> torch.Tensor:
    """A real rank's counted exchange, one op: a program traced on fake tensors (``vsf.jit``'s
    over local shards) keeps it whole and reads the counts when it runs."""
    pg = _compat.process_group_named(group)
    matrix, me = counts.tolist(), dist.get_rank(pg)
    recv = x.new_empty((sum(row[me] for row in matrix), *x.shape[1:]))
    dist.all_to_all_single(
        recv, x[: sum(matrix[me])].contiguous(), [row[me] for row in matrix], list(matrix[me]), group=pg
    )
    return _padded(recv, rows, axis, me)


@_exchange_counted.register_fake
def _(x: torch.Tensor, counts: torch.Tensor, group: str, axis: str, rows: int) -> torch.Tensor:
    return x.new_empty((rows, *x.shape[1:]))


def _padded(t: torch.Tensor, rows: int, axis: str, me: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(
            f"member {me} of axis {axis!r} receives {t.shape[0]} rows, more than the {rows} its buffer holds"
        )
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _simulated_exchange(x: torch.Tensor, g: AxisGroup, counts: Counts) -> torch.Tensor:
    values = _values(x)
    with _compat.local_mode_disabled():
        for r, v in values.items():
            _check_rows(v, sum(counts[g.index(r)]), g, g.index(r))
        out = {}
        for r in values:
            me = g.index(r)
            blocks = []
            for i, src in enumerate(g.members(r)):
                start = sum(counts[i][:me])
                blocks.append(values[src][start : start + counts[i][me]])
            out[r] = torch.cat(blocks).clone()
        return _compat.make_local(out)


def _check_rows(x: torch.Tensor, rows: int, g: AxisGroup, me: int) -> None:
    if x.ndim == 0 or x.shape[0] != rows:
        raise ValueError(
            f"member {me} of axis {g.axis!r} must send {rows} rows (dim 0), but its tensor has shape {tuple(x.shape)}"
        )


def _values(x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every simulated rank's value of ``x`` (a plain tensor is the same value on every rank); a
    sub-mesh's ranks and those of its copies alike (``Mesh.copy_devices``)."""
    ranks = local_ranks()
    shards = _compat.local_shards(x, ranks[0])
    return {r: shards.get(r, x) for r in ranks} if _compat.is_local_tensor(x) else dict.fromkeys(ranks, x)
