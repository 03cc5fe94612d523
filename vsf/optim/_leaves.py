"""How every transform in ``vsf.optim`` touches its leaves.

A transform's math is written once, over lists of plain tensors, with ``torch._foreach_*`` ops.
This module feeds it:

* :func:`flat` / :func:`leaves_like` flatten trees and check that they match leaf for leaf
  (the error names the first differing key path);
* :func:`settle` brings each DTensor leaf to the layout its state (or params) has, once, at
  the start of an update: a ``Partial`` gradient is reduced there (a reduce-scatter when the
  state is sharded), a replicated one is sliced locally;
* :func:`leafwise` unwraps DTensors to their local shards, runs the list math once per
  ``(device, dtypes)`` group, and wraps the results with the layout's placements, so eager
  updates on DTensors cost no DTensor dispatch per op. On plain tensors (including the fake
  tensors of a ``make_fx`` trace) the same code runs the same ops on the tensors themselves.

Nothing here reads a tensor value on the host, so every transform traces.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from vsf import _compat, tree
from vsf.sharding.mesh import group_across, mesh_of
from vsf.sharding.named import from_placements
from vsf.sharding.placement import has_ragged
from vsf.sharding.put import device_put

__all__ = [
    "FLOATING",
    "Flat",
    "bump",
    "check_floating",
    "flat",
    "global_norm",
    "leafwise",
    "leaves_like",
    "local",
    "mask_leaves",
    "opmath",
    "param_units",
    "param_layout",
    "settle",
    "settle_partial",
    "where",
    "wrap",
    "zero_count",
    "zeros_like",
]

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Flat(NamedTuple):
    """A tree's leaves in flatten order, its structure, and each leaf's key path."""

    leaves: list[Any]
    treedef: tree.PyTreeSpec
    paths: list[tree.KeyPath]

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """A tree of this structure holding ``leaves``."""
        return tree.unflatten(self.treedef, leaves)


def flat(x: Any) -> Flat:
    """Flatten ``x`` with key paths."""
    pairs, treedef = tree.flatten_with_path(x)
    return Flat([leaf for _, leaf in pairs], treedef, [p for p, _ in pairs])


def leaves_like(ref: Flat, x: Any, what: str, ref_what: str) -> list[Any]:
    """The leaves of ``x``, which must have ``ref``'s structure and leaf shapes; else a
    ``ValueError`` naming the first key path where they differ."""
    pairs, treedef = tree.flatten_with_path(x)
    if treedef == ref.treedef:
        for (path, leaf), want in zip(pairs, ref.leaves):
            with _compat.metadata_reads():
                shape, want_shape = tuple(getattr(leaf, "shape", ())), tuple(getattr(want, "shape", ()))
            if shape != want_shape:
                raise ValueError(
                    f"{what} leaf {tree.keystr(path)} has shape {shape}, but {ref_what} have shape {want_shape} there"
                )
        return [leaf for _, leaf in pairs]
    got = [p for p, _ in pairs]
    for want_path, got_path in itertools.zip_longest(ref.paths, got):
        if want_path == got_path:
            continue
        if want_path is None or want_path in set(got):
            raise ValueError(
                f"{what} do not match {ref_what}: {what} have a leaf at {tree.keystr(got_path)}, which {ref_what} do not have"
            )
        raise ValueError(
            f"{what} do not match {ref_what}: {what} have no leaf at {tree.keystr(want_path)}, which {ref_what} have"
        )
    raise ValueError(
        f"{what} do not match {ref_what}: same key paths, different containers ({treedef} vs {ref.treedef})"
    )


def check_floating(leaves: Sequence[Any], paths: Sequence[tree.KeyPath], what: str) -> None:
    """``TypeError`` naming the first leaf that is not a floating-point tensor."""
    for leaf, path in zip(leaves, paths):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what} leaf {tree.keystr(path)} is a {type(leaf).__name__}; vsf.optim transforms need tensors"
            )
        with _compat.metadata_reads():
            dtype = leaf.dtype
        if dtype not in FLOATING:
            raise TypeError(
                f"{what} leaf {tree.keystr(path)} has dtype {dtype}; vsf.optim transforms handle "
                f"{', '.join(str(d).removeprefix('torch.') for d in FLOATING)}"
            )


def mask_leaves(mask: Any, x: Any, what: str = "mask") -> list[bool]:
    """One bool per leaf of ``x`` from ``mask``: a bool pytree prefix of ``x``, or a callable
    returning one (optax's convention: ``mask(params)``)."""
    m = mask(x) if callable(mask) else mask
    return tree.broadcast_prefix(m, x, is_leaf=lambda v: isinstance(v, bool), what=what)


# -- layouts ----------------------------------------------------------------------------------


def local(x: Any) -> Any:
    """The local shard of a DTensor (this rank's, or every simulated rank's); other values as they are."""
    return _compat.dtensor_local(x) if isinstance(x, DTensor) else x


def wrap(t: torch.Tensor, like: Any) -> torch.Tensor:
    """``t`` (a local shard) as a DTensor laid out like ``like``; ``t`` itself when ``like`` is plain."""
    if not isinstance(like, DTensor):
        return t
    if t.dtype == like.dtype:
        return _compat.dtensor_like(t, like)
    return DTensor.from_local(
        t, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def zeros_like(x: Any) -> Any:
    """Zeros shaped and laid out like every tensor leaf of ``x``, made from the local shards (a
    ragged DTensor has no DTensor ops)."""
    return tree.map(lambda t: wrap(torch.zeros_like(local(t)), t), x)


def redistribute(x: DTensor, placements: Sequence[Any]) -> DTensor:
    """``x`` with ``placements`` on its mesh: DTensor's ``redistribute``, or ``vsf.device_put``'s
    when either layout is ragged (DTensor cannot move those)."""
    if has_ragged([x.placements, placements]):
        return device_put(x, from_placements(mesh_of(x.device_mesh), placements, x.ndim))
    with _compat.quiet_redistribute():
        return x.redistribute(x.device_mesh, placements)


def settle(
    xs: Sequence[torch.Tensor], layout: Sequence[torch.Tensor], paths: Sequence[tree.KeyPath], what: str
) -> list[torch.Tensor]:
    """Each leaf of ``xs`` redistributed to the layout of the matching ``layout`` leaf.

    A DTensor is redistributed once (``Partial`` -> ``Shard`` is a reduce-scatter, ``Replicate``
    -> ``Shard`` a local slice). A plain tensor against a DTensor layout is taken as replicated
    (DTensor's ``implicit_replication``). A DTensor against a plain layout is an error.
    """
    return [_settle_one(x, ref, path, what) for x, ref, path in zip(xs, layout, paths)]


def _settle_one(x: torch.Tensor, ref: torch.Tensor, path: tree.KeyPath, what: str) -> torch.Tensor:
    with _compat.metadata_reads():
        different = tuple(x.shape) != tuple(ref.shape)
    if different:
        raise ValueError(f"{what} leaf {tree.keystr(path)} has shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
    if not isinstance(ref, DTensor):
        if isinstance(x, DTensor):
            raise ValueError(
                f"{what} leaf {tree.keystr(path)} is a DTensor but what it lines up with (its optimizer state or "
                f"param) is a plain tensor; keep params, gradients and state all DTensors (initialise the state "
                f"from DTensor params: tx.init or vsf.optim.init_sharded) or all plain"
            )
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim, run_check=False)
    if x.device_mesh != ref.device_mesh:
        raise ValueError(f"{what} leaf {tree.keystr(path)} lives on {x.device_mesh}, its state on {ref.device_mesh}")
    if tuple(x.placements) == tuple(ref.placements):
        return x
    return redistribute(x, ref.placements)


def settle_partial(
    xs: Sequence[torch.Tensor], params: Sequence[torch.Tensor] | None, paths: Sequence[tree.KeyPath], what: str
) -> list[torch.Tensor]:
    """Reduce the leaves that are unreduced partial sums, once: to their param's layout when
    ``params`` are given, else to ``Replicate`` on the partial axes. Other leaves are unchanged."""
    out = []
    for i, x in enumerate(xs):
        if not (isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements)):
            out.append(x)
        elif params is not None and isinstance(params[i], DTensor):
            out.append(_settle_one(x, params[i], paths[i], what))
        else:
            out.append(redistribute(x, [Replicate() if isinstance(p, Partial) else p for p in x.placements]))
    return out


def leafwise(
    fn: Callable[..., tuple[list[torch.Tensor], ...]],
    operands: Sequence[Sequence[Any]],
    layout: Sequence[torch.Tensor],
    outputs: int = 1,
) -> list[list[torch.Tensor]]:
    """Run ``fn`` over local shards, one ``(device, dtypes)`` group of leaves at a time.

    ``operands`` are columns (one entry per leaf), already settled to ``layout``; a column may
    hold per-leaf Python values (e.g. mask bools). ``fn(*columns)`` gets each column's entries
    for one group and returns a tuple of ``outputs`` lists; every result is wrapped like
    ``layout``. Without leaves (an empty tree, e.g. what ``masked`` selects from matrices only)
    ``fn`` is not called and the results are ``outputs`` empty lists.
    """
    cols = [[local(x) for x in col] for col in operands]
    groups: dict[tuple[Any, ...], list[int]] = {}
    with _compat.metadata_reads():
        for i in range(len(layout)):
            key = tuple((c[i].device, c[i].dtype) if isinstance(c[i], torch.Tensor) else None for c in cols)
            groups.setdefault(key, []).append(i)
    outs: list[list[Any]] | None = None
    for idx in groups.values():
        results = fn(*[[c[i] for i in idx] for c in cols])
        if outs is None:
            outs = [[None] * len(layout) for _ in results]
        for out, res in zip(outs, results):
            for i, t in zip(idx, res):
                out[i] = wrap(t, layout[i])
    return outs if outs is not None else [[] for _ in range(outputs)]


def param_units(state: Any, params: Flat) -> tuple[Flat, list[list[int] | None]]:
    """Split ``state`` into units: per-parameter subtrees and other leaves.

    A per-parameter subtree has leaves only at key paths the params have, each with its
    param's shape (optax's ``mu``/``nu``/``trace``; a ``masked`` state may leave holes).
    Returns the units (with their key paths and the structure above them) and per unit the
    param index of each of its leaves (``None`` for a unit that is a plain state leaf, such as
    a step count).
    """
    index = {p: i for i, p in enumerate(params.paths)}
    shapes = [tuple(getattr(leaf, "shape", ())) for leaf in params.leaves]
    memo: dict[int, list[int] | None] = {}

    def match(node: Any) -> list[int] | None:
        if id(node) not in memo:
            memo[id(node)] = _match(node, index, shapes)
        return memo[id(node)]

    pairs, treedef = tree.flatten_with_path(state, is_leaf=lambda n: match(n) is not None)
    units = Flat([u for _, u in pairs], treedef, [p for p, _ in pairs])
    return units, [match(u) for u in units.leaves]


def _match(node: Any, index: dict[Any, int], shapes: list[tuple[int, ...]]) -> list[int] | None:
    pairs, _ = tree.flatten_with_path(node)
    if not pairs or not all(isinstance(leaf, torch.Tensor) for _, leaf in pairs):
        return None
    ids = [index.get(p) for p, _ in pairs]
    if any(i is None or tuple(leaf.shape) != shapes[i] for i, (_, leaf) in zip(ids, pairs)):
        return None
    return ids  # type: ignore[return-value]


def param_layout(state: Any, params: Flat) -> list[torch.Tensor] | None:
    """The leaves of the first per-parameter subtree of ``state`` that covers every param."""
    units, ids = param_units(state, params)
    for unit, unit_ids in zip(units.leaves, ids):
        if unit_ids is not None and len(unit_ids) == len(params.leaves):
            return tree.leaves(unit)
    return None


# -- scalars ------------------------------------------------------------------------------------


def zero_count(params: Sequence[Any]) -> torch.Tensor:
    """A 0-d int32 step count (optax's ``count``): replicated on the mesh of the first DTensor
    param, else on the first param's device."""
    first = next((p for p in params if isinstance(p, torch.Tensor)), None)
    device = local(first).device if first is not None else torch.device("cpu")
    count = torch.zeros((), dtype=torch.int32, device=device)
    if isinstance(first, DTensor):
        return DTensor.from_local(count, first.device_mesh, [Replicate()] * first.device_mesh.ndim, run_check=False)
    return count


def bump(count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(steps done before this one, steps done after it)`` as local float64 0-d tensors, and
    the incremented count in ``count``'s layout."""
    before = local(count)
    after = before + 1
    return before.to(torch.float64), after.to(torch.float64), wrap(after, count)


def opmath(value: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """``value`` as a foreach op on tensors like ``like`` sees it: rounded to the dtype its kernels
    compute in (float64 for float64 tensors, else float32); a 0-d tensor also moved to
    ``like``'s device. Rounding here is what the op would do to a Python float anyway, so
    arithmetic on the result (e.g. ``opmath(1 - lr * wd, p) - 1``) matches torch's scalars."""
    wide = like.dtype == torch.float64
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64 if wide else torch.float32)
    if isinstance(value, float) and not wide:
        return struct.unpack("f", struct.pack("f", value))[0]
    return value


def where(cond: torch.Tensor, a: Any, b: Any) -> Any:
    """Leafwise ``torch.where(cond, a, b)`` over two trees of one structure and layout (``cond`` local 0-d)."""
    return tree.map(lambda x, y: wrap(torch.where(cond.to(local(x).device), local(x), local(y)), x), a, b)


# -- reductions -----------------------------------------------------------------------------------


def global_norm(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``xs`` together, as a local 0-d tensor equal on every rank.

    Each leaf contributes its local sum of squares divided by the number of ranks holding the
    same shard (its replication), so summing over every rank counts each element once. The sums
    of one mesh are added locally and reduced with one all-reduce per mesh axis.
    """
    per_mesh: dict[Any, list[torch.Tensor]] = {}
    groups: dict[tuple[Any, ...], list[tuple[torch.Tensor, float]]] = {}
    for x in xs:
        mesh = x.device_mesh if isinstance(x, DTensor) else None
        loc = local(x)
        groups.setdefault((mesh, loc.device, loc.dtype), []).append((loc, 1.0 / _replication(x)))
    for (mesh, _, dtype), members in groups.items():
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        norms = torch._foreach_norm([t for t, _ in members], 2, dtype=acc)
        squares = torch.stack(norms).square()
        weights = [w for _, w in members]
        if any(w != 1.0 for w in weights):
            squares = squares * torch.tensor(weights, dtype=acc, device=squares.device)
        per_mesh.setdefault(mesh, []).append(squares.sum())
    total = None
    over_stages: dict[Any, torch.Tensor] = {}
    for mesh, sums in per_mesh.items():
        s = sum(sums[1:], sums[0]) if len(sums) > 1 else sums[0]
        if mesh is not None:
            with _compat.quiet_redistribute():
                partial = DTensor.from_local(s, mesh, [Partial()] * mesh.ndim, run_check=False)
                s = local(partial.redistribute(mesh, [Replicate()] * mesh.ndim))
        group = None if mesh is None else group_across(mesh_of(mesh))
        if group is not None:
            over_stages[group] = over_stages[group] + s if group in over_stages else s
            continue
        total = s if total is None else total + s
    for group, s in over_stages.items():
        # a pipeline stage's leaves: the other stages' processes hold the rest of the tree
        dist.all_reduce(s, group=group)
        total = s if total is None else total + s
    if total is None:
        return torch.zeros(())
    return total.sqrt()


def _replication(x: torch.Tensor) -> int:
    if not isinstance(x, DTensor):
        return 1
    sizes = x.device_mesh.shape
    return math.prod(n for n, p in zip(sizes, x.placements) if isinstance(p, Replicate))
