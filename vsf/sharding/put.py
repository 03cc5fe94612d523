"""Placing pytrees on a mesh and gathering them back.

``device_put`` cuts each full tensor by :meth:`NamedSharding.index` (the layout vsf documents)
and wraps the local pieces as DTensors; ``device_get`` asks DTensor to reassemble them, so a
round trip checks vsf's layout against DTensor's own.

Balanced layouts (``P(None, vsf.balanced("cp"))``) are DTensor's contiguous shards of the
balanced view (:meth:`NamedSharding.index_view`): gathered by DTensor and put back in the
original order, moved through the full value.

Ragged layouts (``P(vsf.ragged(...), ...)``), which DTensor cannot move, are moved by
:func:`vsf.sharding.ragged.reshard` over their axis: straight to or from ``Replicate``,
``Partial``, ``Shard`` or another ragged split of that axis when nothing else changes (one
ragged collective, or a local slice), else through ``Replicate`` on the ragged axis with
DTensor moving the other axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vsf import _compat, config, ops, runtime, tree
from vsf.ops import backend
from vsf.sharding import fingerprint, ragged
from vsf.sharding.mesh import mesh_of
from vsf.sharding.named import NamedSharding, from_placements, resolve, sharding_of
from vsf.sharding.placement import balanced_order, has_balanced, has_ragged, kind_of, layout_of
from vsf.sharding.spec import PartitionSpec

__all__ = ["assemble", "device_get", "device_put", "from_local", "is_sharding_leaf", "local_device", "place"]


def is_sharding_leaf(x: Any) -> bool:
    """Leaves of a shardings prefix tree: ``NamedSharding``, ``P``, or ``None`` (leave as is)."""
    return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def device_put(x: Any, shardings: Any) -> Any:
    """Lay out every tensor leaf of ``x`` as its sharding says and return DTensors.

    ``shardings`` is a pytree prefix of ``x`` whose leaves are ``NamedSharding``s, bare ``P``s
    (under :func:`vsf.use_mesh`) or ``None`` (leave that subtree unchanged). Plain tensors must
    hold the full value on every rank; DTensors are redistributed. Non-tensor leaves may only
    be given a trivial spec ``P()``.

    On several processes, plain tensors are checked to be the same everywhere: a fingerprint
    of each (:mod:`vsf.sharding.fingerprint`) is compared over its mesh's ranks, in one small
    all-gather per call (per mesh) whatever the number of leaves, and a value that differs
    raises ``ValueError`` naming the leaf and the ranks (a process's own half of a batch would
    otherwise be taken as the global batch: build that with
    :func:`vsf.make_array_from_process_local_data`). ``vsf.config.check_across_processes =
    False`` skips it (a hot loop whose values are known to agree); DTensors and a single process
    never pay for it. Under :func:`vsf.simulate` a per-rank value is checked the same way.

    Example::

        >>> with vsf.simulate(4):
        ...     mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        ...     params = {"w": torch.randn(8, 4), "b": torch.zeros(4)}
        ...     params = vsf.device_put(params, {"w": vsf.NamedSharding(mesh, P("dp", "tp")),
        ...                                      "b": vsf.NamedSharding(mesh, P())})
        ...     vsf.typeof(params["w"])
        'f32[8@dp,4@tp]'
    """
    return place(x, shardings, "device_put")


def place(x: Any, shardings: Any, what: str) -> Any:
    """:func:`device_put` for ``what`` (the function named in its errors).

    Example::

        >>> place(batch, shardings, "make_array_from_process_local_data")
    """
    pairs, treedef = tree.flatten_with_path(x)
    per_leaf = tree.broadcast_prefix(shardings, x, is_leaf=is_sharding_leaf, what="shardings")
    out = [_put_at(path, leaf, s, what) for (path, leaf), s in zip(pairs, per_leaf)]
    if config.check_across_processes:
        fingerprint.check_same(
            [
                (tree.keystr(path), leaf, resolve(s).mesh)
                for (path, leaf), s in zip(pairs, per_leaf)
                if s is not None and isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor)
            ],
            what,
        )
    return tree.unflatten(treedef, out)


def _put_at(path: tree.KeyPath, leaf: Any, s: NamedSharding | PartitionSpec | None, what: str) -> Any:
    """Place one leaf; an error from any layer below names the leaf's key path."""
    try:
        return _put(leaf, s)
    except (ValueError, TypeError) as e:
        if type(e) not in (ValueError, TypeError):  # a subclass may not take a plain message
            raise
        raise type(e)(f"{what} of {tree.keystr(path)} ({_describe(leaf)}): {e}") from e


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{'DTensor' if isinstance(leaf, DTensor) else 'tensor'} of shape {tuple(leaf.shape)}"
    return type(leaf).__name__


def _put(leaf: Any, s: NamedSharding | PartitionSpec | None) -> Any:
    if s is None:
        return leaf
    s = resolve(s)
    if not isinstance(leaf, torch.Tensor):
        if s.spec.normalized() != PartitionSpec():
            raise TypeError(
                f"a {type(leaf).__name__} leaf is not a tensor, so it cannot take {s.spec!r}; give it P() or None"
            )
        return leaf
    s.check(leaf.shape)
    if isinstance(leaf, DTensor):
        return _reshard(leaf, s)
    return distribute(leaf, s)


def _reshard(x: DTensor, s: NamedSharding) -> DTensor:
    src = sharding_of(x)
    if src == s:
        return x
    if src.mesh != s.mesh or src.balanced or s.balanced:
        return distribute(_full(x), s)
    gained = [a for a in s.spec.unreduced if a not in src.spec.unreduced and s.mesh.axis_size(a) > 1]
    if gained:
        raise ValueError(
            f"cannot make a reduced value unreduced over {tuple(gained)} ({src.spec!r} -> {s.spec!r}); "
            f"only a computation produces partial sums"
        )
    if src.is_fully_replicated:
        return distribute(x.to_local(), s)  # every rank holds the whole value: cutting it is local
    if src.ragged is not None or s.ragged is not None:
        return _reshard_ragged(x, src, s)
    if _simulated_empty_shards(x, s):
        return distribute(_assemble(x), s)
    with _compat.quiet_redistribute():
        return x.redistribute(s.mesh.device_mesh, s.placements)


def _reshard_ragged(x: DTensor, src: NamedSharding, dst: NamedSharding) -> DTensor:
    """Move a DTensor between layouts at least one of which is ragged (see the module docs)."""
    if src == dst:
        return x
    summed = tuple(a for a in src.spec.unreduced if a not in dst.spec.unreduced and src.mesh.axis_size(a) > 1)
    if summed and src.ragged is not None:  # reduce first, on the local shards: a psum is layout-blind
        reduced = NamedSharding(
            src.mesh, PartitionSpec(*src.spec, unreduced=tuple(a for a in src.spec.unreduced if a not in summed))
        )
        return _reshard_ragged(
            from_local(ops.psum(x.to_local(), summed, mesh=src.mesh), reduced, x.shape), reduced, dst
        )
    axis = _direct_axis(src, dst)
    if axis is not None:
        group = ragged.group_shape(src, axis, tuple(x.shape))
        local = ragged.reshard(x.to_local(), group, _layout(src, axis), _layout(dst, axis), mesh=src.mesh)
        return from_local(local, dst, x.shape)
    if src.ragged is not None:  # gather over the ragged axis, then DTensor moves the others
        x, src = _reshard_ragged(x, src, ragged.without_ragged(src)), ragged.without_ragged(src)
    if dst.ragged is None:
        return _reshard(x, dst)
    mid = ragged.without_ragged(dst)  # DTensor moves the others, then each rank keeps its rows
    return _reshard_ragged(_reshard(x, mid), mid, dst)


def _direct_axis(src: NamedSharding, dst: NamedSharding) -> str | None:
    """The one mesh axis the layouts differ on, when one side is ragged there and the other is a
    layout :func:`ragged.reshard` takes (Replicate, Partial, a Shard of a dim no other axis splits)."""
    axes = src.mesh.device_axes
    differ = [a for a, p, q in zip(axes, src.placements, dst.placements) if p != q]
    if len(differ) != 1:
        return None
    a = differ[0]
    pair = (_layout_placement(src, a), _layout_placement(dst, a))
    if not has_ragged([pair]):
        return None
    for p in pair:
        if kind_of(p) == "strided":
            return None
        if isinstance(p, Shard) and any(b != a for s in (src, dst) for b in s.spec.entry_axes(p.dim)):
            return None  # another axis splits that dim too: the split is nested, not one axis's
    return a


def _layout_placement(s: NamedSharding, axis: str) -> Placement:
    return s.placements[s.mesh.device_axes.index(axis)]


def _layout(s: NamedSharding, axis: str) -> ragged.Layout:
    return layout_of(_layout_placement(s, axis))


def from_local(local: torch.Tensor, sharding: NamedSharding, shape: Sequence[int]) -> DTensor:
    """This rank's shard ``local`` of a tensor of global ``shape`` laid out as ``sharding``, as a
    DTensor (no communication, no check: ``local`` must have ``sharding.shard_shape(shape, rank)``).

    The inverse of ``x.to_local()``; for a ragged layout ``local`` has the flattened rows of
    :meth:`NamedSharding.index_view`. Under :func:`vsf.simulate` pass the per-rank tensor.

    Example::

        >>> x = vsf.sharding.from_local(piece, vsf.NamedSharding(mesh, P(vsf.ragged("fsdp", (1, 3)))), (8, 4))
    """
    shape = tuple(int(n) for n in shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local, sharding.mesh.device_mesh, sharding.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def local_device(device_type: str) -> torch.device:
    """The device this process's shards live on for a mesh of ``device_type``."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def distribute(full: torch.Tensor, s: NamedSharding) -> DTensor:
    """Cut ``full`` (the whole value, present on every rank) into ``s``'s shards as a DTensor."""
    shape = tuple(full.shape)
    device = local_device(s.mesh.device_type)
    zero_coord = {a for a in s.spec.unreduced if s.mesh.axis_size(a) > 1}
    mode, ranks = _compat.active_local_mode(), backend.local_ranks()
    with _compat.local_mode_disabled():
        values = _compat.local_shards(full.detach(), runtime.rank())
        pieces = {}
        for r in ranks:
            if mode is None and r not in s.mesh.devices:
                pieces[r] = full.new_empty((0,) * len(shape), device=device)
                continue
            source = values[r] if r in values else values[runtime.rank()]
            piece = s.index_view(source)[s.index(shape, r)].to(device, copy=True).contiguous()
            if any(s.mesh.coordinate(r)[a] for a in zero_coord):
                piece.zero_()
            pieces[r] = piece
    return assemble(pieces, s, shape)


def assemble(pieces: dict[int, torch.Tensor], s: NamedSharding, shape: Sequence[int]) -> DTensor:
    """The DTensor of global ``shape`` laid out as ``s`` whose local tensor on rank ``r`` is
    ``pieces[r]`` (every simulated rank's under :func:`vsf.simulate`, else this process's). No
    communication, no check.

    Example::

        >>> assemble({vsf.runtime.rank(): my_rows}, vsf.NamedSharding(mesh, P("dp")), (8, 16))
    """
    local = _compat.make_local(pieces) if _compat.active_local_mode() is not None else pieces[runtime.rank()]
    return from_local(local, s, shape)


def device_get(x: Any) -> Any:
    """Gather every DTensor leaf of ``x`` into a full plain tensor (collective: call on every rank).
    Each is a tensor of its own, as ``jax.device_get``'s arrays are: a later step that donates ``x``
    and writes its buffers in place does not change it.

    Example::

        >>> full = vsf.device_get(params)["w"]   # torch.Tensor of the global shape
    """
    if not runtime.computes_values():
        raise RuntimeError("device_get needs values, and planning-only simulation (compute=False) has none")
    return tree.map(lambda leaf: _full(leaf) if isinstance(leaf, torch.Tensor) else leaf, x)


def _full(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor) and _replicated_here(t):
        return _compat.dtensor_local(t).clone()  # its full value, without full_tensor()'s redistribute (a loss: 4 us)
    if isinstance(t, DTensor) and has_balanced([t.placements]):
        return _unbalance(t, sharding_of(t))
    if isinstance(t, DTensor):
        layout = _layout_of(t)
        if layout.ragged is not None:  # gathered over the ragged axis by vsf, not DTensor
            s = sharding_of(t)
            return _full(_reshard_ragged(t, s, ragged.without_ragged(s)))
        if _simulated_empty_shards(t):
            return _assemble(t)
    with _compat.quiet_redistribute():
        full = t.full_tensor() if isinstance(t, DTensor) else t
    if _compat.is_local_tensor(full):
        with _compat.local_mode_disabled():
            return _compat.reconcile(full)
    return _owned(full, t)


def _owned(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``full`` (``t``'s full value), copied where it shares ``t``'s local memory (DTensor's
    ``full_tensor()`` of a value whole on this rank is a view of it)."""
    if (
        isinstance(t, DTensor)
        and full.untyped_storage().data_ptr() == _compat.dtensor_local(t).untyped_storage().data_ptr()
    ):
        return full.clone()
    return full


def _replicated_here(t: DTensor) -> bool:
    """Is ``t`` whole on every rank (replicated on every mesh axis), a real tensor (not simulated
    ranks) and outside autograd, so its local tensor is its full value?"""
    return (
        not t.requires_grad
        and all(type(p) is Replicate for p in t.placements)
        and not _compat.is_local_tensor(_compat.dtensor_local(t))
    )


def _unbalance(t: DTensor, s: NamedSharding) -> torch.Tensor:
    """The full value of ``t`` laid out balanced as ``s``: DTensor gathers the balanced view,
    whose chunks then go back to their positions."""
    full = _full(from_local(_compat.dtensor_local(t), s.as_contiguous(), t.shape))
    for dim, b in s.balanced.items():
        with _compat.local_mode_disabled():  # (the order too: made under simulation, it is one per rank)
            back = torch.argsort(balanced_order(t.shape[dim], s.mesh.axis_size(b.axis)))
            full = full.index_select(dim, back.to(full.device))
    return full


def _layout_of(t: DTensor) -> NamedSharding:
    """Which rank holds which block of ``t`` (pending reductions of any kind left aside)."""
    return from_placements(
        mesh_of(t.device_mesh), [Replicate() if isinstance(p, Partial) else p for p in t.placements], t.ndim
    )


def _simulated_empty_shards(t: DTensor, *targets: NamedSharding) -> bool:
    """Simulated ranks with an empty shard, which DTensor cannot gather or move under LocalTensorMode."""
    if not _compat.is_local_tensor(_compat.dtensor_local(t)):
        return False
    layouts = [_layout_of(t), *targets]
    return any(sl.stop == sl.start for s in layouts for idx in s.devices_indices_map(t.shape).values() for sl in idx)


def _assemble(t: DTensor) -> torch.Tensor:
    """The full value from every simulated rank's shard, placed by vsf's layout.

    Used where DTensor's own gather cannot run under LocalTensorMode: when some shards are empty
    (its per-rank padding and unpadding fail there; real runs are unaffected).
    """
    s = sharding_of(t)
    sharding_axes = {a for d in range(t.ndim) for a in s.spec.entry_axes(d)} | set(s.spec.unreduced)
    shards = _compat.local_shards(_compat.dtensor_local(t), runtime.rank())
    with _compat.local_mode_disabled():
        full = torch.zeros(t.shape, dtype=t.dtype, device=next(iter(shards.values())).device)
        for r, local in shards.items():
            coord = s.mesh.coordinate(r)
            if all(coord[a] == 0 for a in s.mesh.axis_names if a not in sharding_axes):
                full[s.index(t.shape, r)] += local
    return full
