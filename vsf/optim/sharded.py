"""Where optimizer state lives: each state leaf follows its param, ZeRO shards it further.

The rule (optax's, plus ZeRO as maxtext and veScale do it):

* a state leaf with its param's shape (Adam's ``mu``/``nu``, a momentum trace, accumulated
  gradients) has its param's sharding; scalars (step counts) are replicated;
* with ``zero_axes``, those leaves are split further over the zero axes the param does not
  already use (axes of size 1 are skipped), all of them on one dim, in the order given:

  1. the first dim the param does not shard whose size divides by the product of their sizes;
  2. else the first dim the param shards whose local (per-rank) size divides by it: the zero
     axes become the minor axes of that dim's entry (a ``P("fsdp", "tp")`` weight becomes
     ``P(("fsdp", "dp"), "tp")``, a ``P("tp")`` bias ``P(("tp", "dp"))``). The split is even,
     so it holds on DTensor even when the entry's order differs from the mesh's (``_StridedShard``);
  3. else, with ``uneven=True``, the first unsharded dim, ``torch.chunk``-style (trailing ranks
     hold less or nothing);

  otherwise it is an error naming the leaf, its shape, spec and the axis sizes;
* ZeRO stage 1 shards only the state, stage 2 the gradients too, stage 3 the params too.

Each state shard is a slice of its rank's param shard, so an update needs no communication
beyond reducing each gradient once into the state's layout (a reduce-scatter) and gathering
each update once into the param's layout (an all-gather; none at stage 3).

Example::

    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((4,), ("dp",))
    ...     params = vsf.device_put({"w": torch.randn(8, 6)}, vsf.NamedSharding(mesh, P()))
    ...     tx = vsf.optim.adamw(1e-3)
    ...     state = vsf.optim.init_sharded(tx, params, zero_axes=("dp",))
    ...     vsf.typeof(state.mu["w"])
    'f32[8@dp,6]'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, tree
from vsf.optim import _leaves
from vsf.optim.base import GradientTransformation, Params, State, Updates
from vsf.sharding.mesh import Mesh, held_only_by_its_ranks
from vsf.sharding.named import NamedSharding, resolve, sharding_of
from vsf.sharding.put import device_put, is_sharding_leaf
from vsf.sharding.spec import PartitionSpec

__all__ = ["ZeroLayout", "init_sharded", "sharded", "state_shardings", "zero_layout"]


class ZeroLayout(NamedTuple):
    """Sharding pytrees for one ZeRO stage: ``params`` and ``grads`` have the params' structure,
    ``state`` the optimizer state's."""

    params: Any
    grads: Any
    state: Any


class _Plan(NamedTuple):
    ref: _leaves.Flat  # the params
    shardings: list[NamedSharding]  # each param's own sharding
    zero: list[NamedSharding]  # each param's sharding split further over the zero axes
    mesh: Mesh


def zero_layout(
    tx: GradientTransformation,
    params: Params,
    param_shardings: Any = None,
    *,
    zero_axes: Sequence[str] = (),
    stage: int = 1,
    uneven: bool = False,
) -> ZeroLayout:
    """The shardings of params, gradients and optimizer state for ZeRO ``stage`` over ``zero_axes``.

    ``params`` may be DTensors (their shardings are used) or any tensors (meta too) with
    ``param_shardings``, a pytree prefix of ``NamedSharding``s (or bare ``P``s under
    :func:`vsf.use_mesh`). The state's structure comes from running ``tx.init`` on meta tensors.

    Example::

        >>> layout = vsf.optim.zero_layout(tx, params, zero_axes=("dp",), stage=2)
        >>> grads = vsf.device_put(grads, layout.grads)          # reduce-scattered over dp
    """
    return _layout(tx, _plan(params, param_shardings, zero_axes, uneven), stage)


def state_shardings(
    tx: GradientTransformation,
    params: Params,
    param_shardings: Any = None,
    *,
    zero_axes: Sequence[str] = (),
    stage: int = 1,
    uneven: bool = False,
) -> Any:
    """The sharding pytree of ``tx``'s state for ``params`` (see the module docs for the rule).

    Every ZeRO stage shards the state the same way; ``stage`` is accepted so the same keyword
    arguments serve :func:`zero_layout` and :func:`init_sharded` (``zero_layout(...).state``).

    Example::

        >>> specs = vsf.optim.state_shardings(tx, params, zero_axes=("dp",))
        >>> specs.mu["w"].spec
        P('dp')
    """
    return zero_layout(tx, params, param_shardings, zero_axes=zero_axes, stage=stage, uneven=uneven).state


def init_sharded(
    tx: GradientTransformation, params: Params, *, zero_axes: Sequence[str] = (), stage: int = 1, uneven: bool = False
) -> State:
    """``tx.init(params)`` with the state laid out by :func:`state_shardings`, built shard by shard
    (the ``init`` of :func:`sharded`).

    ``params`` must be DTensors on one mesh (or on the stage meshes of a ``vsf.pipeline``, each
    leaf's state on its own stage's mesh; scalars such as Adam's count on the first's). ``tx.init`` runs on the params redistributed to
    the state's layout (a local slice: no communication, no full copy), so each rank allocates
    only its own shards. With ``stage=3`` the params must already be sharded over ``zero_axes``
    (``vsf.device_put(params, zero_layout(...).params)``).

    Example::

        >>> state = vsf.optim.init_sharded(tx, params, zero_axes=("dp",))
    """
    ref = _leaves.flat(params)
    for path, leaf in zip(ref.paths, ref.leaves):
        if not isinstance(leaf, DTensor):
            raise TypeError(
                f"init_sharded needs DTensor params (vsf.device_put them first); {tree.keystr(path)} is a {type(leaf).__name__}"
            )
    plan = _plan(params, None, zero_axes, uneven)
    layout = _layout(tx, plan, stage)
    if stage == 3:
        for path, have, want in zip(ref.paths, plan.shardings, plan.zero):
            if have.placements != want.placements:
                raise ValueError(
                    f"stage 3 shards the params over {tuple(zero_axes)} too, but {tree.keystr(path)} is laid out as "
                    f"{have.spec!r} (stage 3 needs {want.spec!r}); vsf.device_put(params, zero_layout(...).params) first"
                )
    state = tx.init(device_put(params, plan.ref.unflatten(plan.zero)))
    expected = tree.leaves(layout.state)
    pairs = tree.leaves_with_path(state)
    for (path, leaf), want in zip(pairs, expected):
        if isinstance(leaf, torch.Tensor) and not (
            isinstance(leaf, DTensor) and tuple(leaf.placements) == want.placements
        ):
            got = sharding_of(leaf)
            raise ValueError(
                f"init made state leaf {tree.keystr(path)} as {'a plain tensor' if got is None else repr(got.spec)}, "
                f"expected {want.spec!r}: a transform's init must build its state from the params it is given "
                f"(e.g. torch.zeros_like), so that each rank allocates only its shard"
            )
    return state


def sharded(
    tx: GradientTransformation, *, zero_axes: Sequence[str] = (), stage: int = 1, uneven: bool = False
) -> GradientTransformation:
    """``tx`` with its state laid out by :func:`state_shardings` and each gradient reduced
    straight into that layout.

    ``init`` is :func:`init_sharded`; ``update`` brings the gradients to the layout of the first
    per-parameter state leaf (e.g. Adam's ``mu``) once, before ``tx`` sees them: a ``Partial``
    gradient becomes one reduce-scatter into the ZeRO-sharded layout, and stateless transforms
    first in the chain (``clip_by_global_norm``) work on the shards. The state is ``tx``'s own,
    so ``tx.update`` on it gives the same numbers, reducing each gradient where each transform
    needs it. Under ``vsf.jit`` the planner lays the gradients out either way.

    Example::

        >>> stx = vsf.optim.sharded(vsf.optim.chain(vsf.optim.clip_by_global_norm(1.0), vsf.optim.adamw(1e-3)), zero_axes=("dp",))
        >>> state = stx.init(params)                       # Adam's moments split over dp too
        >>> updates, state = stx.update(grads, state, params)
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"sharded needs a GradientTransformation, got {type(tx).__name__}")

    def init(params: Params) -> State:
        return init_sharded(tx, params, zero_axes=zero_axes, stage=stage, uneven=uneven)

    def update(updates: Updates, state: State, params: Params | None = None) -> tuple[Updates, State]:
        ref = _leaves.flat(updates)
        layout = _leaves.param_layout(state, ref)
        if layout is not None:
            updates = ref.unflatten(_leaves.settle(ref.leaves, layout, ref.paths, "updates"))
        return tx.update(updates, state, params)

    return GradientTransformation(init, update)


# -- the rule ------------------------------------------------------------------------------------


def _layout(tx: GradientTransformation, plan: _Plan, stage: int) -> ZeroLayout:
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
    keep = plan.ref.unflatten(plan.shardings)
    zero = plan.ref.unflatten(plan.zero)
    return ZeroLayout(zero if stage == 3 else keep, zero if stage >= 2 else keep, _state_layout(tx, plan))


def _plan(params: Params, param_shardings: Any, zero_axes: Sequence[str], uneven: bool) -> _Plan:
    ref = _leaves.flat(params)
    if not ref.leaves:
        raise ValueError("params have no leaves, so there is no state to lay out")
    if param_shardings is None:
        shardings = []
        for path, leaf in zip(ref.paths, ref.leaves):
            s = sharding_of(leaf) if isinstance(leaf, torch.Tensor) else None
            if s is None:
                raise TypeError(
                    f"params leaf {tree.keystr(path)} is not a DTensor: pass param_shardings, or vsf.device_put the params first"
                )
            shardings.append(s)
    else:
        given = tree.broadcast_prefix(param_shardings, params, is_leaf=is_sharding_leaf, what="param_shardings")
        shardings = []
        for path, leaf, s in zip(ref.paths, ref.leaves, given):
            if s is None:
                raise ValueError(f"param_shardings gives no sharding for {tree.keystr(path)}")
            s = resolve(s, tree.keystr(path))
            s.check(tuple(leaf.shape), tree.keystr(path))
            shardings.append(s)
    mesh = shardings[0].mesh
    for path, s in zip(ref.paths, shardings):
        # a pipeline's params live on its stages' meshes (each pp coordinate's), alike but for their ranks
        stages = held_only_by_its_ranks(s.mesh) and held_only_by_its_ranks(mesh) and s.mesh.shape == mesh.shape
        if s.mesh != mesh and not stages:
            first = tree.keystr(ref.paths[0])
            raise ValueError(
                f"params live on more than one mesh: {first} on {mesh!r}, {tree.keystr(path)} on {s.mesh!r}"
            )
    axes = tuple(zero_axes) if not isinstance(zero_axes, str) else (zero_axes,)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"zero_axes names {a!r}, which is not an axis of the mesh {mesh.shape}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"zero_axes must be distinct, got {axes!r}")
    zero = [
        _zero(s, tuple(leaf.shape), axes, uneven, tree.keystr(path))
        for path, leaf, s in zip(ref.paths, ref.leaves, shardings)
    ]
    return _Plan(ref, shardings, zero, mesh)


def _zero(
    s: NamedSharding, shape: tuple[int, ...], zero_axes: tuple[str, ...], uneven: bool, where: str
) -> NamedSharding:
    """``s`` split further over the ``zero_axes`` it does not use yet (see the module docs)."""
    if s.spec.unreduced:
        raise ValueError(f"{where} is laid out as {s.spec!r}: a parameter cannot be an unreduced partial sum")
    axes = tuple(a for a in zero_axes if a not in s.spec.axes and s.mesh.axis_size(a) > 1)
    if not axes:
        return s
    n = math.prod(s.mesh.axis_size(a) for a in axes)
    entries = list(s.spec) + [None] * (len(shape) - len(s.spec))
    lead = s.spec.ragged.dims if s.spec.ragged is not None else 0  # dims a ragged entry flattens into rows
    free = [d for d in range(lead, len(shape)) if entries[d] is None]
    sharded = [d for d in range(lead, len(shape)) if entries[d] is not None]
    dim = next((d for d in free if shape[d] % n == 0), None)
    if dim is None:
        # the local shard's size along an already-sharded dim divides: the zero axes go minor there
        dim = next((d for d in sharded if shape[d] % (s.num_shards(d) * n) == 0), None)
    if dim is None and uneven and free:
        dim = free[0]
    if dim is None:
        sizes = ", ".join(f"{a}={s.mesh.axis_size(a)}" for a in axes)
        dims = ", ".join(f"dim {d} = {shape[d]}" for d in free) or "none"
        local = (
            ", ".join(f"dim {d} = {shape[d]}/{s.num_shards(d)} over {s.spec.entry_axes(d)}" for d in sharded) or "none"
        )
        hint = " (uneven=True splits the first unsharded dim unevenly)" if free else ""
        raise ValueError(
            f"cannot shard {where} (shape {shape}, {s.spec!r}) over zero_axes {axes} ({sizes}, {n} ways): "
            f"no unsharded dim divides by {n} and no sharded dim's local size does; unsharded dims: {dims}; "
            f"sharded dims: {local}{hint}"
        )
    entries[dim] = s.spec.entry_axes(dim) + axes
    out = NamedSharding(s.mesh, PartitionSpec(*entries).normalized())
    out.check(shape, where)
    return out


def _state_layout(tx: GradientTransformation, plan: _Plan) -> Any:
    """Run ``tx.init`` on meta tensors and give each state leaf its sharding."""
    with _compat.local_mode_disabled():
        meta = plan.ref.unflatten([torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") for p in plan.ref.leaves])
        abstract = tx.init(meta)
    units, ids = _leaves.param_units(abstract, _leaves.flat(meta))
    replicated = NamedSharding(plan.mesh, PartitionSpec())
    out = []
    for path, unit, unit_ids in zip(units.paths, units.leaves, ids):
        if unit_ids is not None:
            out.append(tree.unflatten(tree.structure(unit), [plan.zero[i] for i in unit_ids]))
        elif isinstance(unit, torch.Tensor) and unit.ndim > 0:
            raise ValueError(
                f"state leaf {tree.keystr(path)} (shape {tuple(unit.shape)}) is neither a scalar nor shaped like "
                f"a param at the same key path, so state_shardings cannot place it"
            )
        else:
            out.append(replicated)
    return units.unflatten(out)
