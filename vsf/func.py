"""Function transforms over pytrees: ``grad``, ``value_and_grad``, ``with_sharding_constraint``.

They work eagerly on DTensors (using ``torch.autograd.grad``, which DTensor supports, with plain
tensors a model creates treated as replicated) and inside :func:`vsf.jit`, where the backward ops
they run are traced into the same joint graph as the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.experimental import implicit_replication

from vsf import _compat, tree
from vsf.sharding.constraint import constrain
from vsf.sharding.named import NamedSharding, resolve
from vsf.sharding.put import device_put, is_sharding_leaf

__all__ = ["grad", "value_and_grad", "with_sharding_constraint"]

_DEPTH = [0]  # nesting of grad transforms, so an inner grad keeps its graph for the outer one


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """``fun``'s value and its gradient with respect to the pytree argument(s) ``argnums``.

    ``fun`` must return a scalar tensor (or ``(scalar, aux)`` with ``has_aux=True``). Gradients
    have the structure of the differentiated arguments; a leaf that does not affect the value gets
    zeros; non-floating leaves get ``None``.

    Example::

        >>> loss, grads = vsf.value_and_grad(loss_fn)(params, batch)
        >>> (loss, aux), grads = vsf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for i in nums:
            if i >= len(args):
                raise ValueError(f"argnums {argnums!r} asks for argument {i}, but {len(args)} positional arguments were given")
        flat = {i: tree.flatten(args[i]) for i in nums}
        with torch.enable_grad(), implicit_replication():
            diff = {i: [_watch(x) for x in flat[i][0]] for i in nums}
            call_args = [tree.unflatten(flat[i][1], diff[i]) if i in nums else a for i, a in enumerate(args)]
            _DEPTH[0] += 1
            try:
                out = fun(*call_args, **kwargs)
            finally:
                _DEPTH[0] -= 1
            value, aux = out if has_aux else (out, None)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise TypeError(f"grad needs {getattr(fun, '__name__', 'fun')} to return a scalar tensor, got {shape}")
            wrt = [x for i in nums for x in diff[i] if _differentiable(x)]
            grads = iter(torch.autograd.grad(value, wrt, allow_unused=True, create_graph=_DEPTH[0] > 0) if wrt else ())
        out_grads = []
        for i in nums:
            leaves = [(_zero_if_none(next(grads), x) if _differentiable(x) else None) for x in diff[i]]
            out_grads.append(tree.unflatten(flat[i][1], leaves))
        g = out_grads[0] if isinstance(argnums, int) else tuple(out_grads)
        value = value if _DEPTH[0] > 0 else _reduced(value.detach())
        return ((value, aux) if has_aux else value), g

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of scalar-valued ``fun`` with respect to argument(s) ``argnums`` (JAX's ``grad``).

    Example::

        >>> grads = vsf.grad(loss_fn)(params, batch)
    """
    vg = value_and_grad(fun, argnums, has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        (value_aux, g) = vg(*args, **kwargs)
        return (g, value_aux[1]) if has_aux else g

    return wrapped


def _reduced(value: torch.Tensor) -> torch.Tensor:
    """An eager DTensor value with pending reductions, reduced (it is one number: cheap, and printable)."""
    if isinstance(value, DTensor) and any(isinstance(p, Partial) for p in value.placements):
        with _compat.quiet_redistribute():
            return value.redistribute(value.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in value.placements])
    return value


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _watch(x: Any) -> Any:
    if not _differentiable(x):
        return x
    return x if (x.requires_grad and _DEPTH[0] > 0) else x.detach().requires_grad_(True)


def _zero_if_none(g: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if g is None else g


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """Pin the sharding of every tensor leaf of ``x`` (shardings: a pytree prefix of ``x``).

    Inside :func:`vsf.jit` the propagator must give those values exactly that sharding
    (``P.UNCONSTRAINED`` dims are left to it); eagerly, DTensor leaves are resharded.

    Example::

        >>> h = vsf.with_sharding_constraint(h, P("dp", None, "tp"))
    """
    pairs, treedef = tree.flatten_with_path(x)
    per_leaf = tree.broadcast_prefix(shardings, x, is_leaf=is_sharding_leaf, what="shardings")
    out = []
    for (path, leaf), s in zip(pairs, per_leaf):
        if s is None or not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        s = resolve(s, tree.keystr(path))
        if is_fake(leaf):
            _check_constraint(s, leaf, tree.keystr(path))
            out.append(constrain(leaf, s))
        elif leaf.requires_grad and s.spec.ragged is None:
            out.append(_reshard_in_graph(leaf, s, tree.keystr(path)))
        else:
            out.append(device_put(leaf, s))
    return tree.unflatten(treedef, out)


def _reshard_in_graph(x: torch.Tensor, s: NamedSharding, where: str) -> torch.Tensor:
    """Reshard eagerly through DTensor's differentiable ops, so a gradient flows back through the
    constraint (``device_put`` makes a new leaf)."""
    s.check(tuple(x.shape), where)
    dm = s.mesh.device_mesh
    if not isinstance(x, DTensor):
        if _compat.active_local_mode() is not None and not isinstance(x, _compat.LocalTensor):
            return device_put(x, s)  # a plain tensor made outside the simulation: no graph to keep
        x = DTensor.from_local(x, dm, [Replicate()] * dm.ndim, run_check=False)
    with _compat.quiet_redistribute():
        return x.redistribute(dm, s.placements)


def _check_constraint(s: NamedSharding, x: torch.Tensor, where: str) -> None:
    if len(s.spec) > x.ndim:
        raise ValueError(f"with_sharding_constraint {s.spec!r} for {where} has {len(s.spec)} entries but the value has rank {x.ndim} (shape {tuple(x.shape)})")
