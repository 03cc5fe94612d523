"""The cost model: what each collective moves, in bytes each rank sends (ring model).

* all-reduce moves ``2(n-1)/n`` of the tensor, all-gather and reduce-scatter ``(n-1)/n``,
  all-to-all ``(n-1)/n`` of the local shard;
* each collective also costs a start-up latency (``vsf.config.collective_latency_bytes``, by
  default :data:`COLLECTIVE_LATENCY_BYTES` of the mesh's device type: :func:`latency_bytes`);
* a balanced split (:class:`~vsf.sharding.placement.BalancedPlacement`) moves to or from another
  shard by gathering the whole dim first;
* a local slice sends nothing but is charged a token cost, and so is a local partition of a
  replicated value into a partial one (each rank keeps its share, ``v / n`` of a sum: a bias
  joining a row-parallel matmul's partial product, as torch TP adds it);
* an op that does real work (a matmul, a convolution, attention: :func:`op_flops`) run on an axis
  without any of its operands or results split there runs all of its FLOPs on every rank, where
  a split one runs ``1/n`` of them: the ``(n-1)/n`` it runs beyond its share is charged as
  ``vsf.config.compute_bytes_per_flop`` bytes per FLOP (:func:`unsplit_bytes`). Elementwise ops,
  views and reductions are not charged (their work is of the order of the bytes they read).

:class:`Codes` numbers the placements of one mesh axis and tabulates every transition's cost.

Example::

    >>> transition_bytes("all_reduce", 4, 1000.0)
    1500.0
    >>> unsplit_bytes(2_000_000, 2, 0.01)  # a 2 MFLOP matmul run whole on both ranks of an axis
    10000.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Replicate
from torch.utils.flop_counter import flop_registry

from vsf import _compat
from vsf.jit.classify import ATTENTION_OPS
from vsf.jit.graph import is_tensor_node
from vsf.jit.plan import Placements, R, is_shard, split_dim
from vsf.sharding.mesh import Mesh
from vsf.sharding.placement import kind_of, one_d

__all__ = [
    "COLLECTIVE_LATENCY_BYTES",
    "Codes",
    "INF",
    "NOT_PARTIAL",
    "OrSum",
    "is_sum",
    "latency_bytes",
    "local_bytes",
    "local_flops",
    "local_shape",
    "op_flops",
    "reachable",
    "through_whole",
    "splits_work",
    "transition_bytes",
    "transition_kind",
    "unsplit_bytes",
]


INF = float("inf")


# Taking a local slice of a replicated value (or partitioning it into a partial one) sends nothing;
# it is charged a token cost so that the planner does not reshard values gratuitously (a later op
# would pay to undo it).
_SLICE_COST = 1e-3


# Each collective also costs a start-up latency, charged as the bytes its link could have sent meanwhile
# (vsf.config.collective_latency_bytes's default, by the mesh's device type: gloo between CPU processes
# starts in 50-300 us at 0.3-0.8 GB/s, NCCL in 10-20 us at 50-400 GB/s): with equal bytes, one
# all-reduce beats a reduce-scatter plus an all-gather.
COLLECTIVE_LATENCY_BYTES: dict[str, float] = {"cpu": 64.0 * 2**10, "cuda": float(2**20)}


def latency_bytes(device_type: str, setting: float | None) -> float:
    """The start-up charge of one collective on a mesh of ``device_type``: ``setting``
    (``vsf.config.collective_latency_bytes``) if set, else :data:`COLLECTIVE_LATENCY_BYTES`'s.

    Example::

        >>> latency_bytes("cpu", None), latency_bytes("cuda", None), latency_bytes("cuda", 4096.0)
        (65536.0, 1048576.0, 4096.0)
    """
    if setting is not None:
        return setting
    if device_type not in COLLECTIVE_LATENCY_BYTES:
        raise ValueError(
            f"vsf.config.collective_latency_bytes has no default for a mesh of device type {device_type!r} "
            f"(defaults for {sorted(COLLECTIVE_LATENCY_BYTES)}); set it to the bytes a collective's start-up costs"
        )
    return COLLECTIVE_LATENCY_BYTES[device_type]


_COLLECTIVE_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})


NOT_PARTIAL = object()  # requirement of a graph output with no out_sharding: anything but Partial


@dataclasses.dataclass(frozen=True)
class OrSum:
    """Requirement of a graph output that may stay an unreduced sum where it is one, else is ``placement``
    (a gradient the caller accumulates: unreduced where the plan holds it so, else replicated or,
    on an axis its param is split over, split alike)."""

    placement: Any


def is_sum(p: Any) -> bool:
    """Is ``p`` an unreduced partial sum (``Partial("sum")``, JAX's unreduced), the one partial
    that adds linearly across calls and that a spec can name?"""
    return type(p) is Partial and p.reduce_op == "sum"


def transition_bytes(kind: str, n: int, full_bytes: float) -> float:
    """Bytes each rank sends for a ``kind`` collective over ``n`` ranks of a ``full_bytes`` tensor
    (for an all-to-all: ``full_bytes`` of the tensor the local shards make up)."""
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n / n,
        "slice": _SLICE_COST,
        "partition": _SLICE_COST,
    }
    return factor[kind] * full_bytes


def transition_kind(src: Placement, dst: Placement) -> str | None:
    """The collective that moves one mesh dim from ``src`` to ``dst`` (``"slice"`` when local,
    ``"invalid"`` when none can, ``None`` when nothing moves)."""
    if src == dst:
        return None
    if isinstance(src, Replicate) and is_shard(dst):
        return "slice"
    if isinstance(src, Replicate) and isinstance(dst, Partial):
        return "partition"  # local: each rank keeps its share of the value
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter" if is_shard(dst) else "invalid"
    if is_shard(src) and is_shard(dst) and "balanced" in (kind_of(src), kind_of(dst)):
        return "all_gather"  # gathered (and put in order), then sliced: vsf has no balanced all-to-all
    if is_shard(src):
        return "all_gather" if isinstance(dst, Replicate) else "all_to_all" if is_shard(dst) else "invalid"
    return "invalid"


def reachable(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Can a value laid out as ``src`` be moved to ``dst`` (a placement per mesh dim, strided shards
    read as plain ones)? On each mesh dim a collective, a local slice or a partition moves it
    (:func:`transition_kind`), or it is a shard wanted as a partial sum (not a max): gathered,
    then partitioned (:func:`vsf.jit.redistribute.transition_path`). No solver chooses that move, but
    DTensor's decision for an op can leave a value so (an embedding's gradient split by hidden
    where the per-axis choices had it a partial sum).

    Example::

        >>> reachable((Shard(1),), (Partial(),)), reachable((Shard(1),), (Partial("max"),))
        (True, False)
    """
    return all(
        transition_kind(one_d(a), one_d(b)) != "invalid" or (is_shard(a) and is_sum(b)) for a, b in zip(src, dst)
    )


def through_whole(src: Sequence[Placement], dst: Sequence[Placement]) -> tuple[Placement, ...]:
    """``dst`` with each mesh dim on which ``src`` is a shard and ``dst`` a partial sum replicated:
    the layout a move from ``src`` to ``dst`` passes through (gathered there, then partitioned).

    Example::

        >>> through_whole((Shard(0), Shard(1)), (Partial(), Shard(0)))
        (Replicate(), Shard(dim=0))
    """
    return tuple(Replicate() if is_shard(a) and is_sum(b) else b for a, b in zip(src, dst))


class Codes:
    """Placements of one axis as small ints, with the byte factor and the fixed (per-collective:
    ``latency``) cost of every transition."""

    def __init__(self, n: int, latency: float) -> None:
        self.n, self.latency = n, latency
        self.of: dict[Any, int] = {}
        self.placements: list[Any] = []
        self.factor: list[list[float]] = []
        self.fixed: list[list[float]] = []
        self.shard: list[bool] = []
        self.partial: list[bool] = []
        # a partial sum's reduction (an all-reduce or a reduce-scatter), which the solver charges
        # on what the other axes' reduce-scatters leave of the value (AxisSolver._reduced_bytes)
        self.reduces: list[list[bool]] = []
        self.free: list[bool] = []  # a value placed so and wanted so costs nothing (every placement's)
        self.code(R)

    def code(self, p: Any) -> int:
        c = self.of.get(p)
        if c is None:  # a new placement: a column for it in each row, and its own row
            c = self.of[p] = len(self.placements)
            self.placements.append(p)
            for a, factor, fixed, reduces in zip(self.placements, self.factor, self.fixed, self.reduces):
                factor.append(self._factor(a, p))
                fixed.append(self._fixed(a, p))
                reduces.append(self._reduces(a, p))
            self.factor.append([self._factor(p, b) for b in self.placements])
            self.fixed.append([self._fixed(p, b) for b in self.placements])
            self.reduces.append([self._reduces(p, b) for b in self.placements])
            self.shard.append(is_shard(p))
            self.partial.append(isinstance(p, Partial))
            self.free.append(self.factor[c][c] == 0.0 and self.fixed[c][c] == 0.0)
        return c

    def _fixed(self, a: Any, b: Any) -> float:
        if b is NOT_PARTIAL:
            return self._fixed(a, R) if isinstance(a, Partial) else 0.0
        if isinstance(b, OrSum):
            return 0.0 if is_sum(a) else self._fixed(a, b.placement)
        return self.latency if transition_kind(a, b) in _COLLECTIVE_KINDS else 0.0

    def _reduces(self, a: Any, b: Any) -> bool:
        if b is NOT_PARTIAL:
            return isinstance(a, Partial)
        if isinstance(b, OrSum):
            return not is_sum(a) and self._reduces(a, b.placement)
        if a is NOT_PARTIAL or isinstance(a, OrSum):
            return False
        return transition_kind(a, b) in ("all_reduce", "reduce_scatter")

    def _factor(self, a: Any, b: Any) -> float:
        if b is NOT_PARTIAL:
            return self._factor(a, R) if isinstance(a, Partial) else 0.0
        if isinstance(b, OrSum):
            return 0.0 if is_sum(a) else self._factor(a, b.placement)
        if a is NOT_PARTIAL or isinstance(a, OrSum):
            return INF
        kind = transition_kind(a, b)
        return 0.0 if kind is None else INF if kind == "invalid" else transition_bytes(kind, self.n, 1.0)

    def is_shard(self, c: int) -> bool:
        return self.shard[c]

    def is_partial(self, c: int) -> bool:
        return self.partial[c]


def local_shape(mesh: Mesh, t: torch.Tensor, placements: Placements) -> tuple[int, ...]:
    """Shape of the largest local shard of ``t`` laid out as ``placements`` (over ``mesh.device_axes``)."""
    shape = list(t.shape)
    for axis, p in zip(mesh.device_axes, placements):
        if is_shard(p):
            d = split_dim(p)
            shape[d] = -(-shape[d] // mesh.axis_size(axis))
    return tuple(shape)


def local_bytes(mesh: Mesh, t: torch.Tensor, placements: Placements) -> int:
    """Bytes of the largest local shard of ``t`` laid out as ``placements``."""
    return math.prod(local_shape(mesh, t, placements)) * t.element_size()


aten = torch.ops.aten

# The CPU attention kernels SDPA traces to take the flash kernel's leading arguments (query, key,
# value; the backward's gradient first): they count as it does.
_COUNTED_AS = {
    ATTENTION_OPS[0]: aten._scaled_dot_product_flash_attention,
    ATTENTION_OPS[1]: aten._scaled_dot_product_flash_attention_backward,
}


def op_flops(node: torch.fx.Node) -> int:
    """FLOPs ``node`` runs on its global shapes, for the ops whose work is more than the bytes
    they touch: those :mod:`torch.utils.flop_counter` counts (``mm``, ``addmm``, ``bmm``,
    ``baddbmm``, convolutions and their backward, attention kernels; a multiply-add is 2 FLOPs)
    and grouped matmuls (:func:`_grouped_mm_flops`); 0 for every other op.

    Example::

        >>> op_flops(mm_node)  # [256, 64] @ [64, 64]
        2097152
    """
    if node.op != "call_function":
        return 0
    if node.target is aten._grouped_mm.default:
        return _grouped_mm_flops(node.args[0].meta["val"], node.args[1].meta["val"])
    target = _COUNTED_AS.get(node.target, getattr(node.target, "overloadpacket", None))
    formula = flop_registry.get(target)
    if formula is None:
        return 0
    meta = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) and is_tensor_node(a) else a  # noqa: E731
    return int(
        formula(
            *_compat.torch_tree_map(meta, node.args),
            out_val=node.meta.get("val"),
            **_compat.torch_tree_map(meta, node.kwargs),
        )
    )


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """A grouped matmul's FLOPs (an MoE's experts; :mod:`torch.utils.flop_counter` counts none):
    each of ``a``'s elements meets one column of ``b`` per output column, wherever the groups'
    offsets fall (``[rows, k] @ [groups, k, n]``, the weights' gradient ``[k, rows] @ [rows, n]``
    per group, or batched ``[groups, m, k] @ [groups, k, n]``): ``2 * a.numel() * n``."""
    return 2 * a.numel() * b.shape[-1]


def splits_work(placements: Sequence[Any]) -> bool:
    """Does an op whose operands and results sit on one mesh dim as ``placements`` (``None`` for
    a non-tensor result) run ``1/n`` of its work on each rank? It does where any of them is
    split: each rank computes its own rows, or its share of a contraction (a partial sum). With
    every one replicated (or partial: a partial operand times a whole one is a whole product of
    each rank's summand) it runs all of it."""
    return any(p is not None and is_shard(p) for p in placements)


def unsplit_bytes(flops: float, n: int, bytes_per_flop: float) -> float:
    """The cost of running ``flops`` whole on each of ``n`` ranks rather than ``1/n`` of them:
    the ``(n-1)/n`` each runs beyond its share, at ``bytes_per_flop`` (``vsf.config.compute_bytes_per_flop``)."""
    return flops * (n - 1) / n * bytes_per_flop


def local_flops(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> float:
    """FLOPs one rank runs for ``node`` laid out as ``ins`` -> ``outs`` (over ``mesh.device_axes``):
    :func:`op_flops` over the size of every mesh dim that splits its work (:func:`splits_work`)."""
    flops = float(op_flops(node))
    for k, axis in enumerate(mesh.device_axes):
        if flops and splits_work([*(p[k] for p in ins), *(None if p is None else p[k] for p in outs)]):
            flops /= mesh.axis_size(axis)
    return flops
