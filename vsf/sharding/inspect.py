"""Looking at sharded values: ``typeof``, per-rank shards, and a picture of the layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from vsf import _compat, runtime
from vsf.sharding.mesh import Mesh, mesh_of
from vsf.sharding.named import Index, from_placements, sharding_of
from vsf.sharding.placement import kind_of
from vsf.sharding.spec import RaggedShard

__all__ = ["AddressableShard", "shards", "type_string", "typeof", "visualize_sharding"]

_DTYPE = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.float8_e4m3fn: "f8e4m3fn",
    torch.float8_e5m2: "f8e5m2",
}


def typeof(x: torch.Tensor) -> str:
    """JAX-style type of a tensor: dtype, global shape, and the axes each dim is split over.

    A ragged split is written ``ROWS@AXIS~(UNITS)``, with ``xB`` after it for blocks of ``B``
    rows; ``ROWS`` is ``d0*d1`` when it flattens two leading dims. A balanced split
    (``vsf.balanced("cp")``) is written ``N@cp~bal``, a packed one (``vsf.packed("tp", 2)``) ``N@tp~pk2``.

    Example::

        >>> vsf.typeof(params["w"])          # rows over dp, columns over tp
        'f32[8@dp,4@tp]'
        >>> vsf.typeof(grad)                 # a partial sum over tp, not yet reduced
        'f32[8,4]{U:tp}'
        >>> vsf.typeof(ragged_w)             # P(vsf.ragged("fsdp", (1, 2, 1, 0)), "tp")
        'f32[8@fsdp~(1,2,1,0),4@tp]'
        >>> vsf.typeof(blocked)              # P(vsf.ragged("fsdp", (3, 1), dims=2, block=4))
        'f32[2*8@fsdp~(3,1)x4,5]'
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"typeof expects a tensor, got {type(x).__name__}")
    if not isinstance(x, DTensor):
        return type_string(tuple(x.shape), x.dtype, None)
    return type_string(tuple(x.shape), x.dtype, mesh_of(x.device_mesh), x.placements)


def type_string(
    shape: tuple[int, ...], dtype: torch.dtype, mesh: Mesh | None, placements: Sequence[Placement] = ()
) -> str:
    """``typeof``'s text for a tensor of ``shape`` and ``dtype`` laid out on ``mesh`` as DTensor
    ``placements`` (``mesh=None``: unsharded). Partial sums show as ``{U:axis}`` (JAX's unreduced),
    other pending reductions by their op, e.g. ``{avg:dp}``. Placements no ``P`` expresses (nested
    splits a redistribution passes through) show each dim's splits in mesh order, DTensor's way:
    ``f32[128@<dp,fsdp,tp/sf16>]``."""
    name = _DTYPE.get(dtype, str(dtype).removeprefix("torch."))
    if mesh is None:
        return f"{name}[{','.join(str(n) for n in shape)}]"
    pending: dict[str, list[str]] = {}
    for axis, p in zip(mesh.device_axes, placements):
        if isinstance(p, Partial) and mesh.axis_size(axis) > 1:
            pending.setdefault("U" if p.reduce_op == "sum" else p.reduce_op, []).append(axis)
    plain = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    try:
        s = from_placements(mesh, plain, len(shape))
    except ValueError:  # a layout no P expresses (a step of a redistribution): DTensor's own terms
        return (
            f"{name}[{','.join(_placements_string(n, d, mesh, plain) for d, n in enumerate(shape))}]"
            + _pending_string(pending)
        )
    r = s.ragged
    dims = [] if r is None else [_ragged_string(shape, r)]
    for dim in range(0 if r is None else r.dims, len(shape)):
        n = shape[dim]
        axes = [a for a in s.spec.entry_axes(dim) if mesh.axis_size(a) > 1]
        mark = "~bal" if dim in s.balanced else f"~pk{s.packed[dim].parts}" if dim in s.packed else ""
        dims.append(f"{n}@{axes[0]}{mark}" if len(axes) == 1 else f"{n}@({','.join(axes)})" if axes else str(n))
    return f"{name}[{','.join(dims)}]" + _pending_string(pending)


def _pending_string(pending: dict[str, list[str]]) -> str:
    return "".join("{" + f"{op}:{','.join(a)}" + "}" for op, a in pending.items())


def _placements_string(n: int, dim: int, mesh: Mesh, placements: Sequence[Placement]) -> str:
    """Dim ``dim`` (of size ``n``) as DTensor splits it, axis by axis in mesh order, each strided
    split with its split factor: ``128@<dp,fsdp,tp/sf16>``."""
    axes = []
    p: Any  # a placement, read as its kind says
    for axis, p in zip(mesh.device_axes, placements):
        k = kind_of(p)
        if k == "strided" and p.dim == dim:
            axes.append(f"{axis}/sf{p.split_factor}")
        elif k == "balanced" and p.dim == dim:
            axes.append(f"{axis}~bal" + (f"/sf{p.split_factor}" if p.split_factor is not None else ""))
        elif k == "shard" and p.dim == dim:
            axes.append(axis)
    return f"{n}@<{','.join(axes)}>" if axes else str(n)


def _ragged_string(shape: tuple[int, ...], r: RaggedShard) -> str:
    block = f"x{r.block}" if r.block > 1 else ""
    return f"{'*'.join(str(n) for n in shape[: r.dims])}@{r.axis}~({','.join(str(u) for u in r.units)}){block}"


class AddressableShard(NamedTuple):
    """One rank's piece of a sharded value: which rank, which global slice, and its data.

    For a ragged layout ``index[0]`` slices the flattened rows of the leading dims
    (:meth:`NamedSharding.index_view`) and ``data`` has those rows.
    """

    rank: int
    index: Index
    data: torch.Tensor


def shards(x: torch.Tensor) -> list[AddressableShard]:
    """Every shard this process holds (all ranks' under :func:`vsf.simulate`), in rank order.

    Example::

        >>> for s in vsf.debug.shards(params["w"]):
        ...     print(s.rank, s.index, s.data.shape)
    """
    s = sharding_of(x)
    if s is None or not isinstance(x, DTensor):
        full = tuple(slice(0, n) for n in x.shape)
        return [AddressableShard(r, full, t) for r, t in sorted(_compat.local_shards(x, runtime.rank()).items())]
    local = _compat.local_shards(x.to_local(), runtime.rank())
    return [AddressableShard(r, s.index(x.shape, r), local[r]) for r in sorted(local)]


def visualize_sharding(x: torch.Tensor) -> str:
    """A text picture of which ranks hold which block of a 1D or 2D tensor.

    Each cell is one block, labelled with the ranks that hold it; rows and columns are labelled
    with the global slices they cover. Ranks whose shard is empty are listed below the grid.
    A ragged layout is drawn over its flattened rows (a 2D tensor ragged over both dims as 1D).

    Example::

        >>> print(vsf.debug.visualize_sharding(params["w"]))
    """
    if x.ndim not in (1, 2):
        raise ValueError(f"visualize_sharding draws 1D or 2D tensors, got {x.ndim}D (shape {tuple(x.shape)})")
    s = sharding_of(x)
    layout = s.devices_indices_map(tuple(x.shape)) if s else {sh.rank: sh.index for sh in shards(x)}
    ndim = len(next(iter(layout.values())))  # a ragged layout's index covers its flattened rows
    blocks: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    empty = []
    for rank, idx in sorted(layout.items()):
        idx2 = (slice(0, 1), idx[0]) if ndim == 1 else idx
        if any(sl.stop <= sl.start for sl in idx2):
            empty.append(rank)
            continue
        blocks.setdefault(((idx2[0].start, idx2[0].stop), (idx2[1].start, idx2[1].stop)), []).append(rank)
    rows = sorted({k[0] for k in blocks})
    cols = sorted({k[1] for k in blocks})
    labels = {k: _ranks_label(v) for k, v in blocks.items()}
    width = max([len(v) for v in labels.values()] + [len(f"{c[0]}:{c[1]}") for c in cols]) + 2
    row_names = [f"[{r[0]}:{r[1]}]" if ndim == 2 else "" for r in rows]
    pad = max(len(n) for n in row_names) + 1 if ndim == 2 else 0
    title = typeof(x) + ("" if s is None else f" on {dict(zip(s.mesh.axis_names, s.mesh.axis_sizes))}")
    lines = [title, " " * pad + " " + " ".join(f"{c[0]}:{c[1]}".center(width) for c in cols)]
    rule = lambda l, m, r: " " * pad + l + m.join("─" * width for _ in cols) + r  # noqa: E731
    lines.append(rule("┌", "┬", "┐"))
    for i, r in enumerate(rows):
        cells = "│".join(labels.get((r, c), "?").center(width) for c in cols)
        lines.append(row_names[i].rjust(pad - 1) + (" " if pad else "") + "│" + cells + "│")
        lines.append(rule("├", "┼", "┤") if i < len(rows) - 1 else rule("└", "┴", "┘"))
    if empty:
        lines.append(f"empty shards (uneven split): ranks {_ranks_label(empty)}")
    if s is not None and s.ragged is not None and s.ragged.dims > 1:
        lines.append(f"slices are of the {s.ragged.dims} leading dims flattened into rows")
    if s is not None and s.spec.unreduced:
        lines.append(f"each block is an unreduced partial sum over {', '.join(s.spec.unreduced)}")
    return "\n".join(lines)


def _ranks_label(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)
