"""Building a params pytree directly in its sharding: no rank ever holds a whole parameter.

:func:`init_sharded` calls an initialiser (``init(key, shape, dtype, sharding=...)``, e.g. from
:mod:`vsf.nn.initializers`) for every leaf of a tree of :class:`vsf.ShapeDtypeStruct` s, each with
its own key and sharding; every rank computes only its own shard of each leaf (the samplers'
sharded path), so a 1B-parameter model on 1024 ranks allocates about a 1024th of it per rank.

How it relates to a module's own ``reset_parameters``: torch's initialisers draw from the global
generator into whole tensors, so each rank would build every full parameter and the values depend
on the draw order and the generator's state, not on the layout-independent (key, index). Here the
module is only a description of shapes: build it on the ``meta`` device (no memory), take
``vsf.tree.from_module(model)`` (meta tensors work as shapes) or ``vsf.eval_shape``, choose an
initialiser per leaf (the same ``fan_in`` formulas as ``reset_parameters``:
``vsf.nn.initializers.kaiming_uniform(a=math.sqrt(5))`` is ``nn.Linear``'s weight init), and
run the step with ``vsf.tree.apply(model, params, ...)``. To keep a module's own
``reset_parameters`` instead, run it under :class:`vsf.random.keyed` on DTensor parameters: its
``uniform_`` / ``normal_`` calls then draw keyed, sharding-invariant values (in call order).

Example::

    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(1024, 4096)
    >>> shapes = vsf.tree.from_module(model)
    >>> init = {"weight": vsf.nn.initializers.kaiming_uniform(a=math.sqrt(5)), "bias": vsf.nn.initializers.zeros}
    >>> params = vsf.random.init_sharded(init, vsf.random.key(0), shapes, {"weight": vsf.NamedSharding(mesh, P("tp")), "bias": vsf.NamedSharding(mesh, P())})
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from vsf import tree
from vsf.abstract import ShapeDtypeStruct
from vsf.random.keys import check_key, fold_in
from vsf.sharding.named import NamedSharding, resolve
from vsf.sharding.put import is_sharding_leaf

__all__ = ["init_sharded", "leaf_key"]

Init = Callable[..., torch.Tensor]


def leaf_key(key: torch.Tensor, path: tree.KeyPath) -> torch.Tensor:
    """The key of the leaf at ``path``: ``fold_in(key, crc32(keystr(path)))``, so adding or
    removing other leaves never changes a leaf's values."""
    return fold_in(key, zlib.crc32(tree.keystr(path).encode()))


def init_sharded(init: Init | Any, key: torch.Tensor, shapes: Any, shardings: Any = None) -> Any:
    """Initialise every leaf of ``shapes`` in its sharding.

    * ``init``: one initialiser for every leaf, or a pytree prefix of ``shapes`` with one per
      subtree (``init(key, shape, dtype, sharding=s)``, JAX's initialiser signature plus
      ``sharding``).
    * ``shapes``: a pytree of :class:`vsf.ShapeDtypeStruct` s (from :func:`vsf.eval_shape`) or
      tensors (meta tensors of a module built on ``torch.device("meta")``).
    * ``shardings``: a pytree prefix of ``NamedSharding`` / ``P`` / ``None``; without it each
      struct's own ``sharding`` (``None``: a plain tensor).

    Leaf ``path`` draws from :func:`leaf_key` ``(key, path)``; the result equals the same call
    without shardings, gathered, bit for bit. Example::

        >>> shapes = vsf.eval_shape(lambda: vsf.tree.from_module(GPT(cfg)))
        >>> params = vsf.random.init_sharded(vsf.nn.initializers.normal(0.02), key, shapes, shardings)
    """
    check_key(key, "vsf.random.init_sharded")
    pairs, treedef = tree.flatten_with_path(shapes)
    inits = tree.broadcast_prefix(init, shapes, is_leaf=callable, what="init")
    targets = (
        [None] * len(pairs)
        if shardings is None
        else tree.broadcast_prefix(shardings, shapes, is_leaf=is_sharding_leaf, what="shardings")
    )
    out = []
    for (path, leaf), fn, target in zip(pairs, inits, targets):
        where = f"vsf.random.init_sharded at {tree.keystr(path)}"
        struct = _struct(leaf, where)
        s = resolve(target, where) if target is not None else struct.sharding if shardings is None else None
        if isinstance(s, NamedSharding):
            s.check(struct.shape, where)
        out.append(fn(leaf_key(key, path), struct.shape, struct.dtype, sharding=s))
    return tree.unflatten(treedef, out)


def _struct(leaf: Any, where: str) -> ShapeDtypeStruct:
    if isinstance(leaf, (ShapeDtypeStruct, torch.Tensor)):
        return ShapeDtypeStruct.like(leaf)
    raise TypeError(f"{where}: expected a vsf.ShapeDtypeStruct or a tensor, got {type(leaf).__name__} {leaf!r}")
