"""What a committed checkpoint directory holds, and how its two vsf files are written and read.

A checkpoint is a directory with:

* DCP's files: ``.metadata`` and one ``__<rank>_<n>.distcp`` data file per writing rank
  (each rank writes only the shards it owns; replicated shards once);
* ``tree.json``: the format version, the pickled tree structure and one record per leaf (its
  key path, kind, shape, dtype and sharding as saved; Python scalars and strings by value);
* ``COMMITTED``: the commit marker, written last: for every file its size and the checksums
  (:mod:`vsf.checkpoint.checksum`) of consecutive blocks covering it, with a CRC-32 of the
  marker itself.

A directory without a valid marker is not a checkpoint. Readers check the format version of
both files and refuse versions they do not know.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch

from vsf.checkpoint.checksum import BLOCK, checksums
from vsf.errors import CorruptCheckpointError, NotACheckpointError
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import BalancedShard, PackedShard, PartitionSpec, RaggedShard

__all__ = [
    "FORMAT_VERSION",
    "MARKER",
    "TREE",
    "Checkpoint",
    "DCP_METADATA",
    "FileRecord",
    "LeafRecord",
    "decode_marker",
    "decode_tree",
    "encode_marker",
    "encode_tree",
    "read_checkpoint",
]

FORMAT_VERSION = 2  # 2: block checksums of checksum.py (1: CRC-32 per item); ragged spec entries
MARKER = "COMMITTED"
TREE = "tree.json"
DCP_METADATA = ".metadata"
VALUE_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """One leaf as saved: ``kind`` is ``"tensor"`` (``sharding`` None for a plain tensor) or a value type."""

    path: str
    key: str
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    sharding: NamedSharding | None = None
    value: Any = None


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """A written file: its size and ``(offset, length, checksum)`` of consecutive blocks covering it."""

    size: int
    blocks: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, data: bytes) -> "FileRecord":
        """The record of a file holding ``data``, in blocks of :data:`~vsf.checkpoint.checksum.BLOCK` bytes."""
        sums = checksums(bytearray(data))
        return cls(len(data), tuple((i * BLOCK, min(BLOCK, len(data) - i * BLOCK), c) for i, c in enumerate(sums)))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint as read from disk (files verified against the marker by their users)."""

    path: Path
    files: dict[str, FileRecord]
    leaves: list[LeafRecord]
    treedef_pickle: bytes


# -- tree.json ----------------------------------------------------------------------------


def encode_tree(treedef: Any, leaves: list[LeafRecord]) -> bytes:
    """The bytes of ``tree.json``."""
    body = {
        "format_version": FORMAT_VERSION,
        "treedef": base64.b64encode(pickle.dumps(treedef)).decode("ascii"),
        "leaves": [_leaf_json(r) for r in leaves],
    }
    return json.dumps(body, indent=1).encode()


def decode_tree(data: bytes, where: Path) -> tuple[list[LeafRecord], bytes]:
    """Leaf records and the pickled treedef from the bytes of ``tree.json``."""
    body = _json(data, where)
    _check_version(body, where)
    try:
        return [_leaf_from_json(r) for r in body["leaves"]], base64.b64decode(body["treedef"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where} is not a valid vsf tree description: {e!r}") from e


def _leaf_json(r: LeafRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"path": r.path, "key": r.key, "kind": r.kind}
    if r.kind == "tensor":
        out.update(shape=list(r.shape), dtype=str(r.dtype).removeprefix("torch."), sharding=_sharding_json(r.sharding))
    else:
        out["value"] = r.value
    return out


def _leaf_from_json(d: dict[str, Any]) -> LeafRecord:
    if d["kind"] == "tensor":
        dtype = getattr(torch, d["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {d['dtype']!r} for leaf {d['path']}")
        return LeafRecord(d["path"], d["key"], "tensor", tuple(d["shape"]), dtype, _sharding_from_json(d["sharding"]))
    if d["kind"] not in VALUE_TYPES:
        raise ValueError(f"unknown leaf kind {d['kind']!r} for leaf {d['path']}")
    return LeafRecord(d["path"], d["key"], d["kind"], value=VALUE_TYPES[d["kind"]](d["value"]))


def _sharding_json(s: NamedSharding | None) -> dict[str, Any] | None:
    if s is None:
        return None
    m = s.mesh
    return {
        "mesh": {
            "axis_sizes": list(m.axis_sizes),
            "axis_names": list(m.axis_names),
            "devices": list(m.devices),
            "device_type": m.device_type,
        },
        "spec": [_entry_json(e) for e in s.spec],
        "unreduced": list(s.spec.unreduced),
    }


def _entry_json(entry: Any) -> Any:
    """A spec entry as JSON: None, an axis, a list of axes, or a tagged object for other kinds."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return list(entry)
    if isinstance(entry, RaggedShard):
        return {"ragged": entry.axis, "units": list(entry.units), "dims": entry.dims, "block": entry.block}
    if isinstance(entry, PackedShard):
        return {"packed": entry.axis, "parts": entry.parts}
    if isinstance(entry, BalancedShard):
        return {"balanced": entry.axis}
    raise TypeError(f"vsf.checkpoint cannot store the spec entry {entry!r} ({type(entry).__name__})")


def _entry_from_json(entry: Any) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    if isinstance(entry, dict) and entry.keys() == {"ragged", "units", "dims", "block"}:
        return RaggedShard(entry["ragged"], entry["units"], dims=entry["dims"], block=entry["block"])
    if isinstance(entry, dict) and entry.keys() == {"packed", "parts"}:
        return PackedShard(entry["packed"], entry["parts"])
    if isinstance(entry, dict) and entry.keys() == {"balanced"}:
        return BalancedShard(entry["balanced"])
    raise ValueError(f"unknown spec entry {entry!r} (written by a newer vsf?)")


def _sharding_from_json(d: dict[str, Any] | None) -> NamedSharding | None:
    if d is None:
        return None
    m = d["mesh"]
    mesh = Mesh(m["axis_sizes"], m["axis_names"], device_type=m["device_type"], devices=m["devices"])
    return NamedSharding(mesh, PartitionSpec(*(_entry_from_json(e) for e in d["spec"]), unreduced=d["unreduced"]))


# -- COMMITTED ----------------------------------------------------------------------------


def encode_marker(files: dict[str, FileRecord]) -> bytes:
    """The bytes of the commit marker for ``files`` (name -> record)."""
    contents = {
        "format_version": FORMAT_VERSION,
        "files": {name: {"size": r.size, "blocks": [list(b) for b in r.blocks]} for name, r in sorted(files.items())},
    }
    return json.dumps({"contents": contents, "crc32": zlib.crc32(_canonical(contents))}).encode()


def decode_marker(data: bytes, where: Path) -> dict[str, FileRecord]:
    """File records from the bytes of a commit marker, after checking its own checksum and version."""
    body = _json(data, where)
    contents = body.get("contents") if isinstance(body, dict) else None
    if not isinstance(contents, dict) or body.get("crc32") != zlib.crc32(_canonical(contents)):
        raise CorruptCheckpointError(
            f"{where}: the commit marker is damaged (its checksum does not match its contents)"
        )
    _check_version(contents, where)
    return {name: FileRecord(r["size"], tuple(tuple(b) for b in r["blocks"])) for name, r in contents["files"].items()}


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _json(data: bytes, where: Path) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e}); the file is damaged") from e


def _check_version(body: Any, where: Path) -> None:
    version = body.get("format_version") if isinstance(body, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where} has checkpoint format version {version!r}, but this vsf reads version {FORMAT_VERSION} only"
        )


# -- reading ------------------------------------------------------------------------------


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check the marker and ``tree.json`` of the committed checkpoint at ``path``.

    Raises :class:`NotACheckpointError` when ``path`` is missing or has no marker (an interrupted
    save), :class:`CorruptCheckpointError` when a vsf file is damaged, ``ValueError`` for an
    unknown format version.
    """
    path = Path(path)
    if not path.is_dir():
        raise NotACheckpointError(f"{path} does not exist or is not a directory, so it is not a vsf checkpoint")
    marker = path / MARKER
    if not marker.is_file():
        raise NotACheckpointError(
            f"{path} is not a committed vsf checkpoint: it has no {MARKER} marker (an interrupted save leaves none)"
        )
    files = decode_marker(marker.read_bytes(), marker)
    for name in (TREE, DCP_METADATA):
        if name not in files:
            raise CorruptCheckpointError(f"{marker} lists no {name}")
    read_verified(path, DCP_METADATA, files[DCP_METADATA])  # checked here: DCP would hide the error
    data = read_verified(path, TREE, files[TREE])
    leaves, treedef_pickle = decode_tree(data, path / TREE)
    return Checkpoint(path, files, leaves, treedef_pickle)


def read_verified(directory: Path, name: str, record: FileRecord) -> bytes:
    """The whole of a small file, checked against its record."""
    where = directory / name
    try:
        data = where.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing from the checkpoint") from None
    if len(data) != record.size:
        raise CorruptCheckpointError(
            f"{where} has {len(data)} bytes, but {record.size} were written: it is truncated or altered"
        )
    buffer = bytearray(data)
    for offset, length, expected in record.blocks:
        if checksums(memoryview(buffer)[offset : offset + length]) != [expected]:
            raise CorruptCheckpointError(
                f"{where}: bytes {offset}..{offset + length} fail their checksum: the file is damaged"
            )
    return data
