"""Eager math on sharded DTensors in any vsf layout, ragged ones included.

DTensor has no strategy for a :class:`~vsf.sharding.placement.RaggedPlacement` (its ops raise; a
``vsf.jit`` plan is to handle ragged operands itself). For eager code these helpers compute on
the local shards and communicate only what the math needs, never gathering a value:

* :func:`elementwise` - ``fn`` on the local shards of tensors laid out alike, with replicated
  scalars and plain numbers; the result keeps the layout;
* :func:`sum`, :func:`mean` - a local reduction, then one ``psum`` over each mesh axis that splits
  a reduced dim (the ragged axis when the reduction covers the rows); ``mean`` divides by the
  global count;
* :func:`norm` - the ``p``-norm of all elements: local power sum, one ``psum`` per sharding axis.

They work on any vsf layout; for non-ragged ones DTensor's own ops compute the same. They read
the DTensors' local shards directly, so no gradient flows back to a DTensor argument (use
``vsf.jit`` / ``vsf.grad`` for differentiable steps).

Example::

    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((4,), ("fsdp",))
    ...     s = vsf.NamedSharding(mesh, P(vsf.ragged("fsdp", (1, 2, 1, 0))))
    ...     x, y = vsf.device_put(torch.randn(8, 3), s), vsf.device_put(torch.randn(8, 3), s)
    ...     z = eager.elementwise(lambda a, b: a * b + 1, x, y)       # ragged like x
    ...     total, m = eager.sum(z), eager.mean(z, dim=1)              # replicated 0-d; ragged (8,)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, ops
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import from_local
from vsf.sharding.spec import PartitionSpec

__all__ = ["elementwise", "mean", "norm", "sum"]

Dims = int | Sequence[int] | None


def elementwise(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)`` computed on local shards: every DTensor argument of rank > 0 must have the
    same shape and layout, 0-d ones must be replicated; plain numbers and 0-d plain tensors are
    taken as replicated scalars. The result has the layout of the DTensor arguments.

    ``fn`` must be elementwise (its value at an element depends only on the arguments' values
    there); nothing checks that.

    Example::

        >>> z = vsf.sharding.eager.elementwise(torch.lerp, m, g, 0.1)    # m, g ragged alike
    """
    like = next((a for a in args if isinstance(a, DTensor) and a.ndim > 0), None)
    if like is None:
        raise TypeError("elementwise needs at least one DTensor argument of rank > 0 to take the layout from")
    layout = sharding_of(like)
    if layout.spec.unreduced:
        raise ValueError(
            f"elementwise on an unreduced value ({layout.spec!r}) is not elementwise on its sum; reduce it first"
        )
    for i, a in enumerate(args):
        _check_operand(i, a, like, layout)
    out = fn(*[_compat.dtensor_local(a) if isinstance(a, DTensor) else a for a in args])
    return from_local(out, layout, like.shape)


def _check_operand(i: int, a: Any, like: DTensor, layout: NamedSharding) -> None:
    if isinstance(a, DTensor):
        s = sharding_of(a)
        if a.ndim == 0:
            if not s.is_fully_replicated or s.mesh != layout.mesh:
                raise ValueError(
                    f"elementwise argument {i} is a 0-d DTensor laid out as {s.spec!r}; a scalar must be replicated on {layout.mesh!r}"
                )
        elif tuple(a.shape) != tuple(like.shape) or s != layout:
            raise ValueError(
                f"elementwise argument {i} has shape {tuple(a.shape)} laid out as {s.spec!r}, but the first tensor has shape "
                f"{tuple(like.shape)} laid out as {layout.spec!r}; device_put one to the other's layout first"
            )
    elif isinstance(a, torch.Tensor) and a.ndim > 0:
        raise ValueError(
            f"elementwise argument {i} is a plain tensor of shape {tuple(a.shape)}; only 0-d plain tensors are taken as scalars"
        )


def sum(x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    """``x.sum(dim, keepdim)`` of a DTensor: reduce the local shard, then ``psum`` over the mesh
    axes that split a reduced dim. A ragged split's rows are reduced all together or not at all
    (its leading ``dims`` are all in ``dim`` or none is).

    Example::

        >>> vsf.sharding.eager.sum(x)             # 0-d, replicated
        >>> vsf.sharding.eager.sum(x, dim=1)      # still ragged over the rows
    """
    return _reduce(x, dim, keepdim, average=False)


def mean(x: torch.Tensor, dim: Dims = None, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(dim, keepdim)`` of a DTensor: :func:`sum` divided by the global number of
    elements reduced (not the local one).

    Example::

        >>> vsf.sharding.eager.mean(x)
    """
    return _reduce(x, dim, keepdim, average=True)


def norm(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """The ``p``-norm of all elements of a DTensor (``torch.linalg.vector_norm(x, p)``), replicated:
    ``sum(|x|^p)`` of the local shard, one ``psum`` per mesh axis that shards ``x``, then the
    ``1/p`` power; ``p=inf`` takes the largest ``|x|`` over those axes.

    Example::

        >>> vsf.sharding.eager.norm(grad)
    """
    if not isinstance(x, DTensor):
        return torch.linalg.vector_norm(x, p)
    s = sharding_of(x)
    if s.spec.unreduced:
        raise ValueError(f"the norm of an unreduced value ({s.spec!r}) needs its sum; reduce it first")
    local = _compat.dtensor_local(x)
    axes = _sharding_axes(s, range(x.ndim))
    if p == math.inf:
        top = local.abs().amax() if local.numel() else local.new_zeros(())
        for a in axes:
            top = ops.all_gather(top.reshape(1), a, mesh=s.mesh).amax()
        value = top
    else:
        value = _psum(local.abs().pow(p).sum(), axes, s.mesh).pow(1.0 / p)
    return from_local(value, NamedSharding(s.mesh, PartitionSpec()), ())


def _reduce(x: torch.Tensor, dim: Dims, keepdim: bool, average: bool) -> torch.Tensor:
    if not isinstance(x, DTensor):
        return x.mean(_all(dim, x.ndim), keepdim) if average else x.sum(_all(dim, x.ndim), keepdim)
    s = sharding_of(x)
    shape, dims = tuple(x.shape), _all(dim, x.ndim)
    r = s.ragged
    lead = 0 if r is None else r.dims
    rows_reduced = r is not None and bool(set(dims) & set(range(lead)))
    if rows_reduced and not set(range(lead)) <= set(dims):
        raise ValueError(
            f"{r!r} flattens dims 0..{lead - 1} into rows; a reduction must cover all of them or none, got dim={tuple(dims)}"
        )
    local_dims = sorted({0 if d < lead else d - lead + 1 for d in dims} if r is not None else set(dims))
    local = _compat.dtensor_local(x).sum(local_dims, keepdim=keepdim)
    if rows_reduced and keepdim and lead > 1:  # the rows dim stood for `lead` dims of size 1 now
        local = local.reshape(*[1] * (lead - 1), *local.shape)
    local = _psum(local, _sharding_axes(s, dims), s.mesh)
    if average:
        local = local / math.prod(shape[d] for d in dims)
    entries = [None if d in dims else e for d, e in enumerate(list(s.spec) + [None] * (len(shape) - len(s.spec)))]
    if rows_reduced:
        entries[0] = None
    kept = entries if keepdim else [e for d, e in enumerate(entries) if d not in dims]
    out_shape = (
        tuple(1 if d in dims else n for d, n in enumerate(shape))
        if keepdim
        else tuple(n for d, n in enumerate(shape) if d not in dims)
    )
    out = NamedSharding(s.mesh, PartitionSpec(*kept, unreduced=s.spec.unreduced).normalized())
    return from_local(local, out, out_shape)


def _all(dim: Dims, ndim: int) -> list[int]:
    """``dim`` as a sorted list of non-negative dims (all of them for ``None``)."""
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    bound = max(ndim, 1)  # a 0-d tensor takes dim 0 or -1, as torch does
    if any(not -bound <= d < bound for d in dims):
        raise ValueError(f"dim {dim!r} is out of range for a tensor of rank {ndim}")
    return sorted({d % bound for d in dims}) if ndim else []


def _sharding_axes(s: NamedSharding, dims: Sequence[int]) -> tuple[str, ...]:
    """The mesh axes larger than 1 that split any of ``dims`` (a ragged entry names its axis at dim 0)."""
    return tuple(dict.fromkeys(a for d in dims for a in s.spec.entry_axes(d) if s.mesh.axis_size(a) > 1))


def _psum(x: torch.Tensor, axes: tuple[str, ...], mesh: Mesh) -> torch.Tensor:
    return ops.psum(x, axes, mesh=mesh) if axes else x
