"""One call of a jitted function, its arguments prepared (:class:`Call`), and the
``args[0]['w']``-style names its messages and plans give the arguments' leaves.

Example::

    >>> call = jitted._arguments.prepare((params, batch), {})
    >>> call.names[:2], call.leaves_of([0])[:2]
    (["args[0]['w1']", "args[0]['w2']"], [0, 1])
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, config, tree
from vsf.config import PlanOptions
from vsf.jit.differentiable import grad_mask
from vsf.jit.donation import Donated, check_not_donated
from vsf.jit.plan import Placements
from vsf.sharding.mesh import Mesh, current_mesh, mesh_of
from vsf.sharding.named import NamedSharding, from_placements, resolve, sharding_of
from vsf.sharding.put import device_put, is_sharding_leaf
from vsf.sharding.spec import PartitionSpec

__all__ = ["Arguments", "Call", "all_names", "arg_name", "layouts", "leaf_names", "param_names"]


log = logging.getLogger("vsf.jit")


@dataclasses.dataclass
class Call:
    """One call's arguments, prepared: every tensor leaf a DTensor on ``mesh``."""

    mesh: Mesh
    key: tuple[Any, ...]
    inputs: list[DTensor]
    dyn: tuple[tuple[Any, ...], dict[str, Any]]
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]]
    positions: list[int]  # each dynamic positional argument's position in the call
    leaves: list[Any]  # the leaves as passed (autograd's graph attaches to these)

    @property
    def grad(self) -> tuple[Any, ...] | None:
        """:func:`vsf.jit.differentiable.grad_mask` of the call's leaves."""
        return self.key[4]

    @property
    def options(self) -> PlanOptions:
        """The switches the call plans with (:func:`vsf.config.plan_options`, read as it was prepared)."""
        return self.key[5]

    def leaves_of(self, argnums: Sequence[int]) -> list[int]:
        """Positions, among the call's leaves, of the leaves of positional arguments ``argnums``."""
        return [j for j, _, _ in self.located(argnums)]

    def located(self, argnums: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(j, i, k)`` for each leaf of positional arguments ``argnums``: the call's leaf ``j`` is
        leaf ``k`` of argument ``i``."""
        out, offset = [], 0
        for pos, a in zip(self.positions, self.dyn[0]):
            n = len(tree.leaves(a))
            if pos in argnums:
                out.extend((offset + k, pos, k) for k in range(n))
            offset += n
        return out

    @functools.cached_property
    def names(self) -> list[str]:
        """``args[0]['w']``-style names of the tensor leaves (computed only when needed, once)."""
        return all_names(self.dyn)

    @property
    def arg_trees(self) -> list[tuple[tree.PyTreeSpec, list[tuple[tuple[int, ...], torch.dtype, Placements]]]]:
        """Each positional argument's structure and its leaves' (shape, dtype, placements)."""
        out, offset = [], 0
        for a in self.dyn[0]:
            n = len(tree.leaves(a))
            out.append((tree.structure(a), [k[:3] for k in self.key[1][offset : offset + n]]))
            offset += n
        return out


def layouts(rows: Sequence[tuple[Mesh, Placements, int]]) -> list[NamedSharding]:
    """``from_placements(mesh, placements, ndim)`` of each row, each distinct row worked out once (a
    model's hundreds of leaves share a few layouts; a ``NamedSharding`` is immutable).

    Example::

        >>> layouts([(mesh, (Shard(0), Replicate()), 2)] * 3)  # one NamedSharding, three times
        [NamedSharding(mesh, P('dp', None)), NamedSharding(mesh, P('dp', None)), NamedSharding(mesh, P('dp', None))]
    """
    memo: dict[tuple[Mesh, Placements, int], NamedSharding] = {}
    for row in rows:
        if row not in memo:
            memo[row] = from_placements(*row)
    return [memo[row] for row in rows]


@dataclasses.dataclass(frozen=True, eq=False)
class Arguments:
    """How a jitted function takes its arguments: which are static, the shardings its inputs are
    put in (``in_shardings``), and the backend its programs run on (part of each call's key).
    :meth:`prepare` turns one call's arguments into a :class:`Call`."""

    name: str  # the function's qualified name, for messages
    params: tuple[str, ...]  # its parameter names (:func:`param_names`)
    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]
    in_shardings: Any
    backend: str

    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
        if not self.static_argnums and not self.static_argnames:
            return args, kwargs, ()
        statics = []
        for i in self.static_argnums:
            if i >= len(args):
                raise ValueError(f"static_argnums has {i} but {self.name} got {len(args)} positional arguments")
            statics.append(("arg", i, args[i]))
        for name in self.static_argnames:
            if name in kwargs:
                statics.append(("kw", name, kwargs[name]))
            elif name in self.params and self.params.index(name) < len(args):
                statics.append(("arg", self.params.index(name), args[self.params.index(name)]))
        for s in statics:
            try:
                hash(s[2])
            except TypeError:
                raise TypeError(
                    f"static argument {s[1]!r} of {self.name} must be hashable, got {type(s[2]).__name__}"
                ) from None
        static_pos = {s[1] for s in statics if s[0] == "arg"}
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return dyn_args, dyn_kwargs, tuple(statics)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """The call of the function with ``args`` and ``kwargs``: statics split off, every tensor
        leaf a DTensor on the one mesh the inputs (or ``vsf.use_mesh``) name, and the cache key."""
        dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
        dyn = (dyn_args, dyn_kwargs)
        leaves, treedef = tree.flatten(dyn)
        parts = _compat.dtensor_parts(leaves) if self.in_shardings is None else None
        mesh = _shared_mesh(parts) if parts else None
        if mesh is None:
            inputs, mesh = self._as_dtensors(dyn, leaves)
            parts = _compat.dtensor_parts(inputs)
            kinds: Iterable[str] = ["T" if isinstance(leaf, torch.Tensor) else type(leaf).__name__ for leaf in leaves]
        else:  # every leaf a DTensor on one mesh, none donated, no in_shardings: the leaves are the inputs
            inputs, kinds = leaves, itertools.repeat("T")
        assert parts is not None
        key_leaves = tuple(
            [(shape, local.dtype, placements, kind) for (local, shape, placements, _), kind in zip(parts, kinds)]
        )
        static_pos = {s[1] for s in statics if s[0] == "arg"}
        positions = [i for i in range(len(args)) if i not in static_pos]

        def rebuild(tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            d_args, d_kwargs = tree.unflatten(treedef, tensors)
            full = list(args)
            for pos, value in zip(positions, d_args):
                full[pos] = value
            kw = dict(d_kwargs)
            for kind, where, value in statics:
                if kind == "kw":
                    kw[where] = value
            return tuple(full), kw

        return Call(
            mesh,
            (treedef, key_leaves, statics, mesh, grad_mask(leaves), config.plan_options(), self.backend),
            inputs,
            dyn,
            rebuild,
            positions,
            leaves,
        )

    def _as_dtensors(
        self, dyn: tuple[tuple[Any, ...], dict[str, Any]], leaves: list[Any]
    ) -> tuple[list[DTensor], Mesh]:
        """Each leaf as a DTensor on the one mesh the leaves (or ``vsf.use_mesh``) name, put where
        ``in_shardings`` says, and that mesh; an error naming the leaf for a donated one, a leaf
        that cannot be traced, or leaves on different meshes."""
        targets = self._in_targets(dyn[0], len(leaves))
        name = leaf_names(dyn)
        mesh = self._mesh(name, leaves, targets)
        inputs = [
            self._as_dtensor(leaf, target, mesh, lambda i=i: name(i))
            for i, (leaf, target) in enumerate(zip(leaves, targets))
        ]
        return inputs, mesh

    def _in_targets(self, dyn_args: tuple[Any, ...], n: int) -> list[Any]:
        if self.in_shardings is None:
            return [None] * n
        prefix = (
            self.in_shardings if not is_sharding_leaf(self.in_shardings) else tuple(self.in_shardings for _ in dyn_args)
        )
        per_arg = tree.broadcast_prefix(prefix, dyn_args, is_leaf=is_sharding_leaf, what="in_shardings")
        return per_arg + [None] * (n - len(per_arg))

    def _mesh(self, name: Callable[[int], str], leaves: list[Any], targets: list[Any]) -> Mesh:
        found: dict[Mesh, int] = {}
        for i, (leaf, target) in enumerate(zip(leaves, targets)):
            if isinstance(leaf, DTensor):
                check_not_donated(leaf, lambda i=i: name(i))
                found.setdefault(mesh_of(leaf.device_mesh), i)
            if isinstance(target, NamedSharding):
                found.setdefault(target.mesh, i)
        here = current_mesh()
        if len(found) > 1:
            detail = "; ".join(f"{name(i)} is on {m!r}" for m, i in found.items())
            raise ValueError(f"the inputs of {self.name} live on different meshes: {detail}")
        if found:
            mesh, i = next(iter(found.items()))
            if here is not None and here != mesh:
                raise ValueError(f"{name(i)} is on {mesh!r}, but the current mesh (vsf.use_mesh) is {here!r}")
            return mesh
        if here is None:
            raise ValueError(
                f"{self.name} has no sharded input and no current mesh: pass DTensors, in_shardings, or call it under vsf.use_mesh(mesh)"
            )
        return here

    def _as_dtensor(self, leaf: Any, target: Any, mesh: Mesh, name_of: Callable[[], str]) -> DTensor:
        if isinstance(leaf, DTensor) and target is None:
            return leaf
        name = name_of()
        if isinstance(leaf, (bool, int, float)):
            leaf = torch.tensor(leaf, dtype=torch.float32 if isinstance(leaf, float) else None)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"argument {name} of {self.name} is a {type(leaf).__name__}; only tensors and Python numbers can be traced (mark the argument static)"
            )
        want = resolve(target, name) if target is not None else None
        if isinstance(leaf, DTensor):
            have = sharding_of(leaf)
            if want == have:
                return leaf
            if config.strict:
                raise ValueError(
                    f"{name} arrives as {have.spec!r} but in_shardings asks for {want.spec!r} (vsf.config.strict is set)"
                )
            log.warning(
                "%s: input %s arrives as %r but in_shardings asks for %r; resharding it",
                self.name,
                name,
                have.spec,
                want.spec,
            )
            return device_put(leaf, want)
        return device_put(leaf, want or NamedSharding(mesh, PartitionSpec()))


def _shared_mesh(parts: list[tuple[torch.Tensor, torch.Size, Placements, Any]]) -> Mesh | None:
    """The mesh of every leaf (``parts``: :func:`vsf._compat.dtensor_parts` of the leaves) where they
    share one DeviceMesh, none was donated and it is the current mesh, if one is set; ``None``
    otherwise, where :meth:`Arguments._as_dtensors` decides (and raises the error that says why)."""
    dm = parts[0][3]
    if any(p[3] is not dm or isinstance(p[0], Donated) for p in parts):
        return None
    mesh = mesh_of(dm)
    here = current_mesh()
    return mesh if here is None or here == mesh else None


def param_names(fun: Callable[..., Any]) -> list[str]:
    """``fun``'s parameter names, in order (none where Python cannot read its signature)."""
    try:
        return list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        return []


def leaf_names(dyn: Any) -> Callable[[int], str]:
    """``name(i)``: the ``args[0]['w']``-style name of leaf ``i`` of ``dyn``; the names are
    computed once, on the first call (only messages need them)."""
    names = functools.cache(lambda: all_names(dyn))
    return lambda i: names()[i]


def all_names(dyn: Any) -> list[str]:
    """The ``args[0]['w']``-style names of every leaf of ``dyn``."""
    return [arg_name(p) for p, _ in tree.leaves_with_path(dyn)]


def arg_name(path: Any) -> str:
    """``args[0]['w']``-style name of an argument leaf (path into ``(args, kwargs)``)."""
    entries = list(path)
    head = "args" if entries and entries[0].entry == 0 else "kwargs"
    return head + tree.keystr(tuple(entries[1:]), brackets=True)
