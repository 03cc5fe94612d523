"""Pytrees to DCP state dicts and back.

DCP walks only dicts and lists, so vsf flattens the tree itself: every tensor leaf becomes one
entry of a flat state dict keyed by its key path (``vsf.tree.keystr``), and the structure plus
one :class:`~vsf.checkpoint.format.LeafRecord` per leaf go to ``tree.json``. Python scalars and
strings are stored by value in the record. On load, each tensor leaf gets a fresh buffer laid out
as the target says, DCP fills it (resharding from whatever was saved), and the tree is rebuilt.

Under :func:`vsf.simulate` this process holds every rank's shards, so it saves full tensors
(gathered with :func:`vsf.device_get`) and lays loaded ones out with :func:`vsf.device_put`.
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

__all__ = ["Want", "buffers", "flatten", "rebuild", "resolve_target"]


def flatten(value: Any) -> tuple[Any, list[LeafRecord], dict[str, torch.Tensor]]:
    """``(treedef, records, state_dict)`` of a tree to save (under simulation, with gathered copies)."""
    pairs, treedef = tree.flatten_with_path(value)
    paths = [tree.keystr(p) for p, _ in pairs]
    records, state = [], {}
    for path, key, (_, leaf) in zip(paths, _unique(paths), pairs):
        if isinstance(leaf, torch.Tensor):
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
    return treedef, records, state


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


def resolve_target(ckpt: Checkpoint, target: Any) -> tuple[Any, list[Want | None]]:
    """The treedef of the result and, per saved leaf, what to load: a :class:`Want` for a tensor, else None.

    ``target=None`` asks for the leaves as saved (same mesh size required). A plain tensor leaf
    comes back on the device of its live target, else on the device of the target's meshes
    (when they agree on one), else on this process's default device.
    """
    if target is None:
        treedef, structs, devices = _saved_treedef(ckpt), [_as_saved(r) for r in _check_meshes(ckpt.leaves)], None
    else:
        pairs, treedef = tree.flatten_with_path(target)
        _check_paths([r.path for r in ckpt.leaves], [tree.keystr(p) for p, _ in pairs], ckpt)
        structs = [_want(r, leaf) for r, (_, leaf) in zip(ckpt.leaves, pairs)]
        devices = [leaf.device if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) else None for _, leaf in pairs]
    default = _plain_device([s for s in structs if s is not None])
    return treedef, [
        None if s is None else Want(s, d if d is not None else default) for s, d in zip(structs, devices or [None] * len(structs))
    ]


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
        saved = "; ".join(f"{_mesh_text(m)} ({m.size} ranks) for {_some([r.path for r in records if r.sharding and r.sharding.mesh == m])}" for m in wrong)
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
        s = NamedSharding(Mesh(m.axis_sizes, m.axis_names, device_type=runtime.default_device_type(), devices=m.devices), s.spec)
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
        f"the checkpoint has a leaf at {saved[i]} that the target lacks" if i < len(saved) and saved[i] not in wanted
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
            raise ValueError(f"{r.path}: the checkpoint holds a {r.kind} there, but the target asks for a tensor {ShapeDtypeStruct.like(leaf)!r}")
        return None
    if not is_tensor:
        raise ValueError(f"{r.path}: the checkpoint holds a tensor there, but the target has a {type(leaf).__name__} ({leaf!r})")
    want = ShapeDtypeStruct.like(leaf)
    if want.shape != r.shape or want.dtype != r.dtype:
        raise ValueError(
            f"{r.path}: the checkpoint holds {r.dtype} of shape {r.shape}, but the target asks for {want.dtype} of shape {want.shape}"
        )
    if want.sharding is not None and want.sharding.spec.unreduced:
        raise ValueError(f"{r.path}: the target sharding {want.sharding.spec!r} is unreduced; a loaded value is reduced")
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
