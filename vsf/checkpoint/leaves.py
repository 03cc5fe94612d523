"""Pytrees to DCP state dicts and back.

DCP walks only dicts and lists, so vsf flattens the tree itself: every tensor leaf becomes one
entry of a flat state dict keyed by its key path (``vsf.tree.keystr``), and the structure plus
one :class:`~vsf.checkpoint.format.LeafRecord` per leaf go to ``tree.json``. Python scalars and
strings are stored by value in the record. On load, each tensor leaf gets a fresh buffer laid out
as the target says, DCP fills it (resharding from whatever was saved), and the tree is rebuilt.

Under :func:`vsf.simulate` this process holds every rank's shards, so it saves full tensors
(gathered with :func:`vsf.device_get`) and lays loaded ones out with :func:`vsf.device_put`.

**Leaves held by some ranks only** (a pipeline's params and optimizer state under ``torchrun``:
each rank holds its stage's leaves, ``None`` at the others'). A rank's tree is flattened with
``None`` as a slot, so every rank sees the same slots; :func:`merge` joins the ranks' records
into one tree (a slot saved by some rank is a leaf, a slot ``None`` on every rank stays ``None``).
On load, ``None`` in a rank's target at a saved leaf means "held elsewhere": this rank reads
nothing there and its result has ``None`` there, so the target of a pipelined run is its own
live (or :func:`vsf.eval_shape`-d) state; every saved leaf must be asked for by some rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from vsf import runtime, tree
from vsf.abstract import ShapeDtypeStruct, empty
from vsf.checkpoint.format import VALUE_TYPES, Checkpoint, LeafRecord
from vsf.sharding.mesh import Mesh, current_mesh
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import device_get, device_put, local_device

__all__ = ["Want", "buffers", "flatten", "merge", "missing_everywhere", "rebuild", "resolve_target"]


def flatten(value: Any) -> tuple[Any, list[LeafRecord | None], dict[str, torch.Tensor]]:
    """``(slots, records, state_dict)`` of a tree to save (under simulation, with gathered copies).

    ``slots`` is the structure with ``None`` as a leaf; ``records`` has one entry per slot (``None``
    where this rank's tree has ``None``); ``state_dict`` holds this rank's tensors.
    """
    pairs, slots = tree.flatten_with_path(value, is_leaf=_is_none)
    paths = [tree.keystr(p) for p, _ in pairs]
    records: list[LeafRecord | None] = []
    state = {}
    for path, key, (_, leaf) in zip(paths, _unique(paths), pairs):
        if leaf is None:
            records.append(None)
        elif isinstance(leaf, torch.Tensor):
            sharding = _savable_sharding(leaf, path)
            records.append(LeafRecord(path, key, "tensor", tuple(leaf.shape), leaf.dtype, sharding))
            state[key] = _gathered(leaf, path) if runtime.is_simulated() else leaf.detach()
        elif type(leaf) in VALUE_TYPES.values():
            records.append(LeafRecord(path, key, type(leaf).__name__, value=leaf))
        else:
            raise TypeError(
                f"vsf.checkpoint cannot save the leaf at {path}: a {type(leaf).__name__}; leaves must be tensors, "
                f"DTensors, bool, int, float, str or None (register other containers with vsf.tree)"
            )
    return slots, records, state


def _is_none(x: Any) -> bool:
    return x is None


def merge(slots: Any, per_rank: Sequence[tuple[bytes, list[LeafRecord | None]]]) -> tuple[Any, list[LeafRecord]]:
    """The saved tree's ``(treedef, records)`` from every rank's ``(pickled slots, records)``.

    A slot takes the record of the first rank holding it; a slot no rank holds is ``None`` in the
    saved tree. The ranks must save trees of one structure.

    Example::

        >>> # rank 0 saves {"a": x, "b": None}, rank 1 {"a": None, "b": y}: the checkpoint holds {"a": x, "b": y}
    """
    mine = pickle.dumps(slots)
    for rank, (theirs, _) in enumerate(per_rank):
        if theirs != mine:
            raise ValueError(
                f"the ranks save trees of different structures (rank {rank}: {pickle.loads(theirs)}; this rank: {slots}); "
                f"every rank must pass the same tree, with None where it holds no part of a leaf"
            )
    merged = [next((r[i] for _, r in per_rank if r[i] is not None), None) for i in range(slots.num_leaves)]
    treedef = tree.structure(tree.unflatten(slots, [None if r is None else 0 for r in merged]))
    return treedef, [r for r in merged if r is not None]


def _unique(paths: Sequence[str]) -> list[str]:
    """DCP keys: the key paths, made unique where two render alike (``{'a.b': x, 'a': {'b': y}}``)."""
    seen: set[str] = set()
    out = []
    for i, p in enumerate(paths):
        key = p if p not in seen else f"{p}#{i}"
        seen.add(key)
        out.append(key)
    return out


def _savable_sharding(x: torch.Tensor, path: str) -> NamedSharding | None:
    s = sharding_of(x)
    if s is not None and any(s.mesh.axis_size(a) > 1 for a in s.spec.unreduced):
        raise ValueError(
            f"{path} is an unreduced partial sum over {s.spec.unreduced} ({s.spec!r}); a checkpoint stores "
            f"values, so reduce it first (e.g. vsf.device_put to a spec without unreduced axes)"
        )
    return s


def _gathered(x: torch.Tensor, path: str) -> torch.Tensor:
    try:
        return device_get(x)
    except AssertionError as e:  # LocalTensor.reconcile: the simulated ranks disagree
        raise ValueError(
            f"{path} is a plain tensor whose value differs between the simulated ranks; a plain leaf must be "
            f"the same on every rank (make it a DTensor to save one piece per rank)"
        ) from e


class Want(NamedTuple):
    """How one tensor leaf comes back: laid out as ``struct`` says, on ``device`` if it is a plain tensor."""

    struct: ShapeDtypeStruct
    device: torch.device


def resolve_target(ckpt: Checkpoint, target: Any) -> tuple[Any, list[LeafRecord], list[Want | None]]:
    """The treedef of the result, the saved leaves this rank loads, and per such leaf what to load:
    a :class:`Want` for a tensor, else None.

    ``target=None`` asks for the leaves as saved (same mesh size required). ``None`` in ``target``
    at a saved leaf skips it here (it is held by other ranks; the result has ``None`` there). A
    plain tensor leaf comes back on the device of its live target, else on the device of the
    target's meshes (when they agree on one), else on this process's default device.
    """
    if target is None:
        treedef, here, structs, devices = (
            _saved_treedef(ckpt),
            ckpt.leaves,
            [_as_saved(r) for r in _check_meshes(ckpt.leaves)],
            None,
        )
    else:
        pairs, _ = tree.flatten_with_path(target, is_leaf=_is_none)
        here, leaves_ = _match(ckpt, [(tree.keystr(p), leaf) for p, leaf in pairs])
        treedef = tree.structure(target)
        structs = [_want(r, leaf) for r, leaf in zip(here, leaves_)]
        devices = [
            leaf.device if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) else None
            for leaf in leaves_
        ]
    default = _plain_device([s for s in structs if s is not None])
    return (
        treedef,
        here,
        [
            None if s is None else Want(s, d if d is not None else default)
            for s, d in zip(structs, devices or [None] * len(structs))
        ],
    )


def _match(ckpt: Checkpoint, slots: list[tuple[str, Any]]) -> tuple[list[LeafRecord], list[Any]]:
    """The saved leaves the target's non-``None`` slots ask for, with those slots' leaves, in order.

    A ``None`` slot matches a saved leaf at its path (held elsewhere) or nothing (a ``None`` value).
    """
    saved = {r.path for r in ckpt.leaves}
    kept = [(p, leaf) for p, leaf in slots if leaf is not None or p in saved]
    _check_paths([r.path for r in ckpt.leaves], [p for p, _ in kept], ckpt)
    pairs = [(r, leaf) for r, (_, leaf) in zip(ckpt.leaves, kept) if leaf is not None]
    return [r for r, _ in pairs], [leaf for _, leaf in pairs]


def missing_everywhere(ckpt: Checkpoint, loaded: Sequence[Sequence[str]]) -> None:
    """Raise naming the saved leaves that no rank's target asks for (``None`` on every rank)."""
    asked = {k for keys in loaded for k in keys}
    lost = [r.path for r in ckpt.leaves if r.key not in asked]
    if lost:
        raise ValueError(
            f"the target has None at {_some(lost)} on every rank, but the checkpoint {ckpt.path} holds a leaf there; "
            f"None in a target means 'held by another rank': some rank must ask for each saved leaf"
        )


def _plain_device(structs: list[ShapeDtypeStruct]) -> torch.device:
    types = {s.sharding.mesh.device_type for s in structs if s.sharding is not None}
    return local_device(types.pop() if len(types) == 1 else runtime.default_device_type())


def _saved_treedef(ckpt: Checkpoint) -> Any:
    try:
        return pickle.loads(ckpt.treedef_pickle)
    except Exception as e:
        raise ValueError(
            f"cannot rebuild the tree structure saved in {ckpt.path} ({type(e).__name__}: {e}); import the "
            f"modules that define its containers, or pass target= with the structure to load into"
        ) from e


def _check_meshes(records: list[LeafRecord]) -> list[LeafRecord]:
    world = runtime.world_size()
    meshes = {r.sharding.mesh for r in records if r.sharding is not None}
    wrong = sorted((m for m in meshes if m.size != world), key=repr)
    if wrong:
        here = current_mesh()
        saved = "; ".join(
            f"{_mesh_text(m)} ({m.size} ranks) for {_some([r.path for r in records if r.sharding and r.sharding.mesh == m])}"
            for m in wrong
        )
        raise ValueError(
            f"the checkpoint's leaves were saved on {saved}, but this run has {world} rank(s)"
            f"{f' (current mesh {_mesh_text(here)})' if here else ''}. Without a target, leaves come back as saved, "
            f"which needs the same mesh; pass target= (ShapeDtypeStructs, live arrays, or vsf.eval_shape(...)) "
            f"with shardings on this run's mesh to reshard"
        )
    return records


def _mesh_text(m: Mesh) -> str:
    return f"mesh {m.shape}"


def _some(paths: list[str], n: int = 4) -> str:
    return ", ".join(paths[:n]) + (f" and {len(paths) - n} more" if len(paths) > n else "")


def _as_saved(r: LeafRecord) -> ShapeDtypeStruct | None:
    if r.kind != "tensor":
        return None
    s = r.sharding
    if s is not None and s.mesh.device_type != runtime.default_device_type():
        m = s.mesh
        s = NamedSharding(
            Mesh(m.axis_sizes, m.axis_names, device_type=runtime.default_device_type(), devices=m.devices), s.spec
        )
    return ShapeDtypeStruct(r.shape, r.dtype, s)


def _check_paths(saved: list[str], wanted: list[str], ckpt: Checkpoint) -> None:
    if saved == wanted:
        return
    for i, (a, b) in enumerate(zip(saved, wanted)):
        if a != b:
            break
    else:
        i = min(len(saved), len(wanted))
    first = (
        f"the checkpoint has a leaf at {saved[i]} that the target lacks"
        if i < len(saved) and saved[i] not in wanted
        else f"the target has a leaf at {wanted[i]} that the checkpoint lacks"
    )
    raise ValueError(
        f"the target's tree does not match the checkpoint {ckpt.path}: {first} "
        f"(checkpoint: {len(saved)} leaves, target: {len(wanted)} leaves)"
    )


def _want(r: LeafRecord, leaf: Any) -> ShapeDtypeStruct | None:
    is_tensor = isinstance(leaf, (torch.Tensor, ShapeDtypeStruct))
    if r.kind != "tensor":
        if is_tensor:
            raise ValueError(
                f"{r.path}: the checkpoint holds a {r.kind} there, but the target asks for a tensor {ShapeDtypeStruct.like(leaf)!r}"
            )
        return None
    if not is_tensor:
        raise ValueError(
            f"{r.path}: the checkpoint holds a tensor there, but the target has a {type(leaf).__name__} ({leaf!r})"
        )
    want = ShapeDtypeStruct.like(leaf)
    if want.shape != r.shape or want.dtype != r.dtype:
        raise ValueError(
            f"{r.path}: the checkpoint holds {r.dtype} of shape {r.shape}, but the target asks for {want.dtype} of shape {want.shape}"
        )
    if want.sharding is not None and want.sharding.spec.unreduced:
        raise ValueError(
            f"{r.path}: the target sharding {want.sharding.spec!r} is unreduced; a loaded value is reduced"
        )
    return want


def buffers(records: list[LeafRecord], wants: list[Want | None]) -> dict[str, torch.Tensor]:
    """Fresh tensors for DCP to fill: laid out as wanted (under simulation: whole, laid out later)."""
    return {r.key: _buffer(w) for r, w in zip(records, wants) if w is not None}


def _buffer(w: Want) -> torch.Tensor:
    s = w.struct
    if s.sharding is None:
        return torch.empty(s.shape, dtype=s.dtype, device=w.device)
    return torch.empty(s.shape, dtype=s.dtype) if runtime.is_simulated() else empty(s)


def rebuild(treedef: Any, records: list[LeafRecord], wants: list[Want | None], state: dict[str, torch.Tensor]) -> Any:
    """The loaded tree: filled buffers for tensors, saved values for the rest."""
    leaves = []
    for r, w in zip(records, wants):
        if w is None:
            leaves.append(r.value)
        elif runtime.is_simulated() and w.struct.sharding is not None:
            leaves.append(device_put(state[r.key], w.struct.sharding))
        else:
            leaves.append(state[r.key])
    return tree.unflatten(treedef, leaves)
