"""Context parallelism: attention with its queries' sequence split over a mesh axis (``cp``),
keys and values either whole (gathered over the split by the plan) or passed around a ring.

Full (non-causal) attention on query shards with whole keys runs as it is (DTensor runs the
kernel on each rank's rows: :func:`vsf._compat.attention_sequence_rule`). A causal kernel's mask
starts at the first query it is given, which is position 0 only on the first shard, so DTensor is
never told that rule for a causal op; the planner offers it here instead (:func:`sequence_rules`),
and with ``vsf.config.context_parallel = "ring"`` a rule that keeps keys and values split too.
vsf runs those ops block by block (:func:`run`). With the sequence in ``n`` equal blocks and the
rank's queries block ``me``, step ``s`` attends to key block ``me - s`` (mod ``n``), cut from the
whole keys or, on a ring, received from the previous rank (``ppermute``): step 0 is the diagonal
block, causal as the kernel's own mask is (queries and keys start at the same position); for a
causal op a step ``s <= me`` is an earlier block, seen whole, and a later block (``s > me``) is not
seen and weighs nothing. The blocks' outputs merge by the log-sum-exp rule (flash attention's and
ring attention's). The backward walks the same blocks with the merged output and log-sum-exp;
whole keys' gradients are partial sums over the split (each rank's queries' share), reduced where
the plan says; on a ring each block's gradient travels with the block and a last pass brings it
home. Every rank runs the same ops on same-shaped blocks (which blocks and what they weigh depend
on the rank's values only), nothing is ``T x T``, and the per-rank work is ``n`` blocks (a causal
op's unseen ones computed and dropped: the contiguous layout leaves rank 0 the least to use).

Example::

    >>> sequence_rules(causal_sdpa_node)          # one mesh dim: results, then q, k, v
    [[Shard(dim=2), Shard(dim=2), Shard(dim=2), Replicate(), Replicate()]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Placement, Shard

from vsf import _compat, config
from vsf.jit.classify import ATTENTION_OPS
from vsf.jit.graph import meta_of, outputs_meta, tensor_args
from vsf.jit.plan import Collective, Placements, is_shard, split_dim, splits_evenly
from vsf.ops import backend, collectives as ops
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import from_placements

__all__ = ["collectives", "run", "runs", "sequence_rules", "splits_sequence"]

MODES = ("all_gather", "ring")
_FORWARD, _BACKWARD = ATTENTION_OPS


def _given(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by their schema names."""
    names = [a.name for a in _compat.op_schema(node.target).arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _tensor_names(node: torch.fx.Node) -> list[str]:
    given = _given(node)
    return [name for name in given if isinstance(given[name], torch.fx.Node) and "val" in given[name].meta]


def _attention(node: torch.fx.Node) -> bool:
    """Is ``node`` a CPU SDPA kernel (or its backward) without dropout?"""
    return node.op == "call_function" and node.target in ATTENTION_OPS and _given(node).get("dropout_p", 0.0) == 0.0


def _causal(node: torch.fx.Node) -> bool:
    return bool(_given(node).get("is_causal", False))


def _mode() -> str:
    if config.context_parallel not in MODES:
        raise ValueError(f"vsf.config.context_parallel must be one of {MODES}, got {config.context_parallel!r}")
    return config.context_parallel


def sequence_rules(node: torch.fx.Node) -> list[list[Placement]]:
    """vsf's per-mesh-dim rules (results' placements, then the tensor inputs') that split an
    attention node over its queries' sequence: with keys and values whole for a causal node
    (``vsf.config.context_parallel == "all_gather"``; a full one has DTensor's), or with every
    tensor split, keys and values passed around a ring (``"ring"``, no mask argument)."""
    if not _attention(node):
        return []
    names = _tensor_names(node)
    if _mode() == "ring":
        if any(n in names for n in ("attn_mask", "attn_bias")):
            return []
        return [[Shard(2)] * (len(outputs_meta(node)) + len(names))]
    if not _causal(node):
        return []
    given = _given(node)
    return [_compat.attention_sequence_rule(node.target, [(name, tuple(given[name].meta["val"].shape)) for name in names])]


def _split_of(node: torch.fx.Node, ins: Sequence[Placements], name: str) -> list[int]:
    """The mesh dims that split the sequence (dim 2) of input ``name``."""
    return [k for k, p in enumerate(ins[_tensor_names(node).index(name)]) if is_shard(p) and split_dim(p) == 2]


def splits_sequence(node: torch.fx.Node, ins: Sequence[Placements]) -> bool:
    """Does vsf run ``node`` with its inputs laid out as ``ins`` (:func:`run`)? It does for an
    attention node whose queries' sequence they split, causal or with its keys' sequence split too
    (DTensor runs full attention on query shards with whole keys as it is)."""
    return _attention(node) and bool(_split_of(node, ins, "query")) and (_causal(node) or bool(_split_of(node, ins, "key")))


def runs(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Does :func:`run` compute ``node`` with inputs and results laid out as ``ins`` and ``outs``
    (the per-axis choices combined)? It does where they split the queries' sequence and every
    dim of every tensor into equal plain shards (each rank's query heads then meet their own key
    and value heads, and its queries start at its shard's offset), queries and keys are as long
    (the blocks are the queries'), and keys and values are whole, or split like the queries over
    one mesh dim (a ring)."""
    if not splits_sequence(node, ins):
        return False
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    placed = [*ins, *outs]
    shards = [(t, p) for t, p in zip(metas, placed) if t is not None and p is not None]
    keys, queries = _split_of(node, ins, "key"), _split_of(node, ins, "query")
    names = _tensor_names(node)
    lengths = {meta_of(tensor_args(node)[names.index(name)]).shape[2] for name in ("query", "key", "value")}
    return (
        len(metas) == len(placed)
        and len(lengths) == 1
        and not any(isinstance(q, _compat.StridedShard) for _, p in shards for q in p)
        and all(splits_evenly(mesh, t, p) for t, p in shards)
        and (not keys or (keys == queries == _split_of(node, ins, "value") and len(keys) == 1))
    )


def _ring_axis(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements]) -> str | None:
    keys = _split_of(node, ins, "key")
    return mesh.device_axes[keys[0]] if keys else None


def collectives(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements]) -> tuple[Collective, ...]:
    """The collectives :func:`run` sends itself on each rank: on a ring of ``n`` ranks, ``n - 1``
    blocks of keys and of values forward; backward those and ``n`` blocks of their gradients
    (the last step brings each block's gradient home). None with whole keys and values."""
    axis = _ring_axis(mesh, node, ins)
    if axis is None:
        return ()
    n, names = mesh.axis_size(axis), _tensor_names(node)
    blocks = []
    for name in ("key", "value"):
        t = meta_of(tensor_args(node)[names.index(name)])
        shape = (*t.shape[:2], t.shape[2] // n, *t.shape[3:])
        sent = Collective("ppermute", axis, shape, t.dtype, t.numel() // n * t.element_size())
        blocks.append(sent)
    forward = tuple(b for b in blocks for _ in range(n - 1))
    return forward if node.target is _FORWARD else forward + tuple(b for b in blocks for _ in range(n))


def run(mesh: Mesh, node: torch.fx.Node, args: tuple, kwargs: dict[str, Any], ins: Sequence[Placements]) -> Any:
    """``node`` (an attention op whose inputs are laid out as ``ins``, :func:`runs`) on this
    rank's local tensors ``args``/``kwargs``, block by block (see the module docs). Returns the
    op's local results."""
    given = {**dict(zip([a.name for a in _compat.op_schema(node.target).arguments], args)), **kwargs}
    qi = _tensor_names(node).index("query")
    q_meta = meta_of(tensor_args(node)[qi])
    queries = from_placements(mesh, ins[qi], q_meta.ndim)
    block = given["query"].shape[2]
    n = q_meta.shape[2] // block
    split = mesh.device_axes[_split_of(node, ins, "query")[0]]
    me = backend.per_rank(torch.zeros((), dtype=torch.int64), backend.axis_group(mesh, split),
                          lambda _, __, rank: torch.tensor(queries.index(q_meta.shape, rank)[2].start // block), with_rank=True)
    causal = _causal(node)
    seen = [me >= s if causal else torch.ones((), dtype=torch.bool) for s in range(n)]
    ring = _ring_axis(mesh, node, ins)
    blocks = _Ring(mesh, ring, given["key"], given["value"]) if ring else _Gathered(given["key"], given["value"], me, block, n)
    if node.target is _FORWARD:
        return _forward(given, causal, seen, blocks)
    return _backward(given, causal, seen, blocks)


class _Gathered:
    """Key blocks cut from whole keys and values: step ``s`` takes block ``me - s`` (mod ``n``);
    each block's gradient lands at its positions of whole-sized (partial) gradients."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, me: torch.Tensor, block: int, n: int) -> None:
        self.k, self.v, self.me, self.block, self.n = k, v, me, block, n
        self.dk: torch.Tensor | None = None
        self.dv: torch.Tensor | None = None

    def _positions(self, s: int) -> torch.Tensor:
        return torch.arange(self.block) + (self.me - s) % self.n * self.block

    def at(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self._positions(s)
        return self.k.index_select(2, at), self.v.index_select(2, at)

    def add(self, s: int, gk: torch.Tensor, gv: torch.Tensor) -> None:
        at = self._positions(s)
        if self.dk is None:
            self.dk, self.dv = torch.zeros_like(self.k), torch.zeros_like(self.v)
        self.dk, self.dv = self.dk.index_add(2, at, gk), self.dv.index_add(2, at, gv)

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dk, self.dv


class _Ring:
    """Key blocks passed around the ring of ``axis``: before each step after the first, every
    rank sends the block it holds (and, backward, that block's gradient so far) to the next rank,
    so that step ``s`` holds block ``me - s``; after the last step one more pass brings each
    block's gradient to its owner."""

    def __init__(self, mesh: Mesh, axis: str, k: torch.Tensor, v: torch.Tensor) -> None:
        n = mesh.axis_size(axis)
        self.mesh, self.axis, self.perm = mesh, axis, [(i, (i + 1) % n) for i in range(n)]
        self.k, self.v = k, v
        self.dk: torch.Tensor | None = None
        self.dv: torch.Tensor | None = None

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        return ops.ppermute(x, self.axis, self.perm, mesh=self.mesh)

    def at(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        if s:
            self.k, self.v = self._pass(self.k), self._pass(self.v)
            if self.dk is not None:
                self.dk, self.dv = self._pass(self.dk), self._pass(self.dv)
        return self.k, self.v

    def add(self, s: int, gk: torch.Tensor, gv: torch.Tensor) -> None:
        self.dk, self.dv = (gk, gv) if self.dk is None else (self.dk + gk, self.dv + gv)

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pass(self.dk), self._pass(self.dv)


def _forward(given: dict[str, Any], causal: bool, seen: list[torch.Tensor], blocks: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp of the rank's queries: each key block's, merged by the
    log-sum-exp rule (a block not seen weighs nothing)."""
    q, scale = given["query"], given.get("scale")
    outs, lses = [], []
    for s, visible in enumerate(seen):
        k, v = blocks.at(s)
        out, lse = _FORWARD(q, k, v, 0.0, causal and s == 0, scale=scale)
        outs.append(out)
        lses.append(lse.masked_fill(~visible, float("-inf")))
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part - lse).unsqueeze(-1) * o for o, part in zip(outs, lses))
    return out.to(q.dtype), lse


def _backward(given: dict[str, Any], causal: bool, seen: list[torch.Tensor], blocks: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query gradient and the key and value gradients (this rank's share of whole ones, or
    its own blocks' on a ring): each seen key block's, from the kernel's backward with the merged
    output and log-sum-exp."""
    grad, q, out, lse = (given[n] for n in ("grad_out", "query", "out", "logsumexp"))
    scale, zero = given.get("scale"), torch.zeros((), dtype=q.dtype)
    dq = torch.zeros_like(q)
    for s, visible in enumerate(seen):
        k, v = blocks.at(s)
        gq, gk, gv = _BACKWARD(grad, q, k, v, out, lse, 0.0, causal and s == 0, scale=scale)
        # (where, not a product: an unseen block's terms may overflow)
        dq = dq + torch.where(visible, gq, zero)
        blocks.add(s, torch.where(visible, gk, zero), torch.where(visible, gv, zero))
    return (dq, *blocks.grads())
