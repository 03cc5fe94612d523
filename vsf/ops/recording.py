"""How a manual region (``vsf.shard_map``) sees the collectives its body runs.

* :func:`manual_axes`: inside a region, a collective over an axis the region does not make
  manual, or over an axis the mesh lacks, is an error naming the region (:func:`check_axis`);
  :func:`current_region` names the region being traced into a ``vsf.jit`` graph, if any.
* :func:`sent`: what a collective sends (kind, axis, local shape, bytes), as a plan lists it.
* :func:`tracing_step` and :func:`differentiating`: what is in flight while code runs (a ``vsf.jit``
  step traced on global shapes; how many ``vsf.grad`` transforms differentiate it).

Example::

    >>> with manual_axes("mlp", ("tp",)):
    ...     vsf.ops.psum(x, "dp")
    ValueError: psum over 'dp' inside shard_map(mlp): the region makes only ('tp',) manual
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from vsf.ops.backend import AxisGroup
from vsf.sharding.mesh import Mesh

__all__ = [
    "CollectiveKind",
    "Sent",
    "check_axis",
    "current_region",
    "differentiating",
    "grad_depth",
    "manual_axes",
    "sent",
    "tracing_step",
    "traces_step",
]


CollectiveKind = Literal[
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "ppermute"
]  # what a collective does


@dataclass(frozen=True)
class Sent:
    """One collective a manual region runs, as its plan lists it: kind, mesh axis, the local shape
    it moves (the gathered shape for an all-gather), and the bytes each rank sends; ``most``: the
    most one rank may send, where that depends on values the step computes (a counted exchange's
    routing) and exceeds ``bytes``, the average rank's."""

    kind: CollectiveKind
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    most: int | None = None


MANUAL: list[
    tuple[str, frozenset[str], int | None]
] = []  # (region name, its manual axes, its key when traced), innermost last


@contextlib.contextmanager
def manual_axes(region: str, axes: Sequence[str], key: int | None = None) -> Iterator[None]:
    """Inside, collectives may run only over ``axes`` (those a ``shard_map`` region makes manual);
    ``key``: the region is being traced into a ``vsf.jit`` graph under that key
    (:mod:`vsf.ops.region`), so its collectives become nodes of the graph."""
    MANUAL.append((region, frozenset(axes), key))
    try:
        yield
    finally:
        MANUAL.pop()


def current_region() -> int | None:
    """The key of the region being traced into a ``vsf.jit`` graph, if one is (innermost).

    Example::

        >>> with manual_axes("mlp", ("tp",), key=7):
        ...     current_region()
        7
    """
    return MANUAL[-1][2] if MANUAL else None


@contextlib.contextmanager
def _counted(counter: list[int]) -> Iterator[None]:
    """``counter[0]`` one higher inside (also after an error, as it was)."""
    counter[0] += 1
    try:
        yield
    finally:
        counter[0] -= 1


_STEP_TRACES = [0]  # how many vsf.jit steps are being traced (on global shapes) right now


@contextlib.contextmanager
def tracing_step() -> Iterator[None]:
    """Inside, a ``vsf.jit`` step is being traced on global shapes: a named-axis collective met
    outside a region there is an error (its operand is a global value, not a rank's).

    Example::

        >>> with tracing_step():
        ...     traces_step()
        True
    """
    with _counted(_STEP_TRACES):
        yield


def traces_step() -> bool:
    """Is a ``vsf.jit`` step being traced on global shapes (:func:`tracing_step`)?

    Example::

        >>> traces_step()     # outside vsf.jit's tracing
        False
    """
    return _STEP_TRACES[0] > 0


_GRAD_DEPTH = [0]  # how many vsf.grad transforms differentiate the code running now


@contextlib.contextmanager
def differentiating() -> Iterator[None]:
    """Inside, one more ``vsf.grad`` transform differentiates the code that runs (:func:`grad_depth`).

    Example::

        >>> with differentiating():
        ...     grad_depth()
        1
    """
    with _counted(_GRAD_DEPTH):
        yield


def grad_depth() -> int:
    """How many ``vsf.grad`` transforms differentiate the code running now: from 2 on, an inner
    gradient's backward is itself differentiated by an outer one (a gradient penalty).

    Example::

        >>> grad_depth()     # outside any vsf.grad
        0
    """
    return _GRAD_DEPTH[0]


def _ring_bytes(kind: str, n: int, x: torch.Tensor) -> int:
    """Bytes each rank sends for ``kind`` over ``n`` ranks on the local tensor ``x`` (ring model)."""
    full = x.numel() * x.element_size()
    return int(round(full * {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "ppermute": 1}.get(kind, (n - 1) / n)))


def sent(
    kind: CollectiveKind,
    g: AxisGroup,
    x: torch.Tensor,
    out_shape: tuple[int, ...],
    nbytes: int | None = None,
    most: int | None = None,
) -> tuple[torch.Tensor, Sent]:
    """An empty result of ``out_shape`` (a traced collective's fake result) and the record of
    what ``kind`` over ``g`` sends for ``x`` (``nbytes``, or the ring model's figure; ``most``: see :class:`Sent`)."""
    shape = out_shape if kind == "all_gather" else tuple(x.shape)
    return x.new_empty(out_shape), Sent(
        kind, g.axis, shape, x.dtype, _ring_bytes(kind, g.size, x) if nbytes is None else nbytes, most
    )


def check_axis(m: Mesh, axis: str, op: str) -> None:
    """``axis`` is an axis of ``m`` and, inside a ``shard_map`` region, one it makes manual."""
    where = f" inside shard_map({MANUAL[-1][0]})" if MANUAL else ""
    if axis not in m.axis_names:
        raise ValueError(f"{op} over unknown mesh axis {axis!r}{where}: the mesh has axes {tuple(m.axis_names)!r}")
    if MANUAL and axis not in MANUAL[-1][1]:
        raise ValueError(f"{op} over {axis!r}{where}: the region makes only {tuple(sorted(MANUAL[-1][1]))!r} manual")
