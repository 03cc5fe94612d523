"""Context parallelism: attention with its queries' sequence split over a mesh axis (``cp``),
keys and values either whole (gathered over the split by the plan) or passed around a ring.

Full (non-causal) attention on query shards with whole keys runs as it is (DTensor runs the
kernel on each rank's rows: :func:`vsf.jit.attention.sequence_rule`). A causal kernel's mask
starts at the first query it is given, which is position 0 only on the first shard, so DTensor is
never told that rule for a causal op; the planner offers it here instead (:func:`sequence_rules`),
and a rule that keeps keys and values split too, passed around a ring: ``vsf.config.context_parallel``
forces one (``"all_gather"``, ``"ring"``) or, ``"auto"`` (the default), :func:`mode_of` picks the
ring where the gathered keys and values would exceed a memory budget.
vsf runs those ops block by block (:func:`run`). With the sequence in ``n`` equal blocks and the
rank's queries block ``me``, step ``s`` attends to key block ``me - s`` (mod ``n``), cut from the
whole keys or, on a ring, received from the previous rank (``ppermute``): step 0 is the diagonal
block, causal as the kernel's own mask is (queries and keys start at the same position); for a
causal op a step ``s <= me`` is an earlier block, seen whole, and a later block (``s > me``) is not
seen and weighs nothing. The blocks' outputs merge by the log-sum-exp rule (flash attention's and
ring attention's). The backward walks the same blocks with the merged output and log-sum-exp;
whole keys' gradients are partial sums over the split (each rank's queries' share), reduced where
the plan says; on a ring each block's gradient travels with the block and a last pass brings it
home. Nothing is ``T x T``. Simulated ranks run the same ops on same-shaped blocks (which blocks
and what they weigh depend on the rank's values only: a causal op's unseen ones are computed and
dropped); a real process knows its rank and skips the blocks it does not see, so with contiguous
shards rank ``i`` of a causal op computes ``i + 1`` blocks.

The balanced layout (``vsf.balanced("cp")``: rank ``i`` holds chunks ``i`` and ``2n-1-i`` of
``2n``) evens that out: its causal blocks follow the chunk order (:class:`_Layout`), one causal
block of its own and ``n - 1`` pairs of half-block calls on every rank.

Example::

    >>> sequence_rules(causal_sdpa_node, PlanOptions())          # one mesh dim: results, then q, k, v
    [[Shard(dim=2), Shard(dim=2), Shard(dim=2), Replicate(), Replicate()]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.fx
from torch.distributed.tensor import Placement, Shard

from vsf import _compat, runtime
from vsf.config import PlanOptions
from vsf.jit import attention
from vsf.jit.classify import ATTENTION_OPS
from vsf.jit.graph import meta_of, outputs_meta, tensor_args
from vsf.jit.plan import Collective, Placements, is_shard, split_dim, splits_evenly
from vsf.ops import backend, collectives as ops
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import from_placements
from vsf.sharding.placement import kind_of, split_factor

__all__ = ["collectives", "is_attention", "mode_of", "run", "runs", "sequence_rules", "splits_sequence"]

_FORWARD, _BACKWARD = ATTENTION_OPS


def _given(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by their schema names."""
    names = [a.name for a in _compat.op_schema(node.target).arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _tensor_names(node: torch.fx.Node) -> list[str]:
    given = _given(node)
    return [name for name in given if isinstance(given[name], torch.fx.Node) and "val" in given[name].meta]


def is_attention(node: torch.fx.Node) -> bool:
    """Is ``node`` a CPU SDPA kernel (or its backward) without dropout?"""
    return node.op == "call_function" and node.target in ATTENTION_OPS and _given(node).get("dropout_p", 0.0) == 0.0


def _causal(node: torch.fx.Node) -> bool:
    return bool(_given(node).get("is_causal", False))


def mode_of(node: torch.fx.Node, options: PlanOptions) -> Literal["all_gather", "ring"]:
    """How ``node`` runs on sequence shards: ``options.context_parallel`` when it forces one,
    else (``"auto"``) the ring where the keys and values gathered would exceed
    ``options.context_parallel_gather_bytes`` (on their whole shape), the gather where not.

    Example::

        >>> mode_of(causal_sdpa_node, PlanOptions())           # 2 x 4 x 16 x 8 fp32 keys and values
        'all_gather'
    """
    if options.context_parallel != "auto":
        return options.context_parallel
    given = _given(node)
    kv = [given[name].meta["val"] for name in ("key", "value")]
    gathered = sum(t.numel() * t.element_size() for t in kv)
    return "ring" if gathered > options.context_parallel_gather_bytes else "all_gather"


def sequence_rules(node: torch.fx.Node, options: PlanOptions) -> list[list[Placement]]:
    """vsf's per-mesh-dim rules (results' placements, then the tensor inputs') that split an
    attention node over its queries' sequence: with keys and values whole for a causal node
    (:func:`mode_of` ``"all_gather"``; a full one has DTensor's), or with every tensor split,
    keys and values passed around a ring (``"ring"``, no mask argument)."""
    if not is_attention(node):
        return []
    names = _tensor_names(node)
    if mode_of(node, options) == "ring":
        if any(n in names for n in ("attn_mask", "attn_bias")):
            return []
        return [[Shard(2)] * (len(outputs_meta(node)) + len(names))]
    if not _causal(node):
        return []
    given = _given(node)
    return [attention.sequence_rule(node.target, [(name, tuple(given[name].meta["val"].shape)) for name in names])]


def _split_of(node: torch.fx.Node, ins: Sequence[Placements], name: str) -> list[int]:
    """The mesh dims that split the sequence (dim 2) of input ``name``."""
    return [k for k, p in enumerate(ins[_tensor_names(node).index(name)]) if is_shard(p) and split_dim(p) == 2]


def splits_sequence(node: torch.fx.Node, ins: Sequence[Placements]) -> bool:
    """Does vsf run ``node`` with its inputs laid out as ``ins`` (:func:`run`)? It does for an
    attention node whose queries' sequence they split, causal or with its keys' sequence split too
    (DTensor runs full attention on query shards with whole keys as it is)."""
    return (
        is_attention(node)
        and bool(_split_of(node, ins, "query"))
        and (_causal(node) or bool(_split_of(node, ins, "key")))
    )


def runs(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Does :func:`run` compute ``node`` with inputs and results laid out as ``ins`` and ``outs``
    (the per-axis choices combined)? It does where they split the queries' sequence and every
    dim of every tensor into equal plain shards (each rank's query heads then meet their own key
    and value heads, and its queries start at its shard's offset), queries and keys are as long
    (the blocks are the queries'), and keys and values are whole, or split like the queries over
    one mesh dim (a ring), the keys' split the queries' (both contiguous or both balanced)."""
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
        and not any(split_factor(q) is not None for _, p in shards for q in p)
        and all(splits_evenly(mesh, t, p) for t, p in shards)
        and (not keys or (keys == queries == _split_of(node, ins, "value") and len(keys) == 1))
        and len({ins[names.index(name)][queries[0]] for name in ("query", "key", "value") if keys}) <= 1
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
    k = _split_of(node, ins, "query")[0]
    split, balanced = mesh.device_axes[k], kind_of(ins[qi][k]) == "balanced"
    group = backend.axis_group(mesh, split)
    index = lambda rank: queries.index(q_meta.shape, rank)[2].start // block  # noqa: E731
    # a real process knows its rank while it plans its blocks and skips those it does not see;
    # simulated ranks run the same ops together, so they compute every block and drop the unseen
    me: int | torch.Tensor = (
        index(runtime.rank())
        if group.kind != "simulated"
        else backend.per_rank(
            torch.zeros((), dtype=torch.int64), group, lambda _, __, rank: torch.tensor(index(rank)), with_rank=True
        )
    )
    layout = _Layout(n, 2 if balanced else 1, _causal(node))
    ring = _ring_axis(mesh, node, ins)
    blocks = (
        _Ring(mesh, ring, given["key"], given["value"]) if ring else _Gathered(given["key"], given["value"], me, layout)
    )
    if node.target is _FORWARD:
        return _forward(given, layout, me, blocks)
    return _backward(given, layout, me, blocks)


class _Piece(NamedTuple):
    """One kernel call of a step: query chunks ``qs`` of the rank's block against key chunks
    ``ks`` of the step's key block, causal or not, ``seen`` (a bool, or per simulated rank a bool
    tensor) where those keys come before those queries."""

    qs: slice
    ks: slice
    causal: bool
    seen: bool | torch.Tensor


class _Layout:
    """Which chunks of the sequence a rank's block holds: ``chunks`` of them (1 contiguous;
    2 balanced, chunks ``i`` and ``2n-1-i`` of rank ``i``), and the kernel calls of each step.

    Contiguous: step 0 is the diagonal block (causal); step ``s`` sees block ``me - s`` when it is
    earlier (``s <= me``). Balanced: step 0 is the rank's own two chunks against themselves, whose
    positions rise, so the kernel's causal mask is right for the block; at step ``s`` the key block
    is rank ``j = me - s``'s (mod ``n``): the later query chunk (``2n-1-me``) sees its early chunk
    (``j``) always, the early query chunk sees it where ``j < me`` (``s <= me``), the later query
    chunk sees its late chunk (``2n-1-j``) where ``j > me`` (``s > me``), and the early query chunk
    never sees that one: every rank does one causal block and ``n - 1`` pairs of chunk calls."""

    def __init__(self, n: int, chunks: int, causal: bool) -> None:
        self.n, self.chunks, self.causal = n, chunks, causal

    def pieces(self, s: int, me: int | torch.Tensor) -> list[_Piece]:
        whole = slice(0, self.chunks)
        if not self.causal or s == 0:
            return [_Piece(whole, whole, self.causal, True)]
        if self.chunks == 1:
            return [_Piece(whole, whole, False, me >= s)]
        first, second = slice(0, 1), slice(1, 2)
        return [
            _Piece(second, first, False, True),
            _Piece(first, first, False, me >= s),
            _Piece(second, second, False, me < s),
        ]

    def key_positions(self, j: torch.Tensor | int, block: int) -> torch.Tensor:
        """The sequence positions of rank ``j``'s key block (``block`` of them), in its order."""
        c = block // self.chunks
        if self.chunks == 1:
            return torch.arange(block) + j * block
        return torch.cat([torch.arange(c) + j * c, torch.arange(c) + (2 * self.n - 1 - j) * c])


def _cut(x: torch.Tensor, chunks: slice, of: int) -> torch.Tensor:
    """Chunks ``chunks`` of ``of`` equal ones of ``x``'s sequence (dim 2)."""
    c = x.shape[2] // of
    return x[:, :, chunks.start * c : chunks.stop * c]


class _Gathered:
    """Key blocks cut from whole keys and values: step ``s`` takes rank ``me - s``'s (mod ``n``);
    each block's gradient lands at its positions of whole-sized (partial) gradients."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, me: int | torch.Tensor, layout: _Layout) -> None:
        self.k, self.v, self.me, self.layout = k, v, me, layout
        self.block = k.shape[2] // layout.n
        self.dk: torch.Tensor | None = None
        self.dv: torch.Tensor | None = None

    def _positions(self, s: int) -> torch.Tensor:
        return self.layout.key_positions((self.me - s) % self.layout.n, self.block)

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


def _visible(seen: bool | torch.Tensor) -> bool:
    """Is a piece computed: always under simulation (masked by its ``seen`` tensor), in a real
    process only where its keys are seen."""
    return isinstance(seen, torch.Tensor) or seen


def _forward(
    given: dict[str, Any], layout: _Layout, me: int | torch.Tensor, blocks: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp of the rank's queries: each query chunk's pieces merged by the
    log-sum-exp rule (a piece not seen weighs nothing)."""
    q, scale, m = given["query"], given.get("scale"), layout.chunks
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(m)]
    for s in range(layout.n):
        k, v = blocks.at(s)
        for piece in layout.pieces(s, me):
            if not _visible(piece.seen):
                continue
            out, lse = _FORWARD(
                _cut(q, piece.qs, m), _cut(k, piece.ks, m), _cut(v, piece.ks, m), 0.0, piece.causal, scale=scale
            )
            if isinstance(piece.seen, torch.Tensor):
                lse = lse.masked_fill(~piece.seen, float("-inf"))
            width = out.shape[2] // (piece.qs.stop - piece.qs.start)
            for u in range(piece.qs.start, piece.qs.stop):
                at = slice((u - piece.qs.start) * width, (u - piece.qs.start + 1) * width)
                parts[u].append((out[:, :, at], lse[:, :, at]))
    outs, lses = [], []
    for chunk in parts:
        lse = torch.logsumexp(torch.stack([part for _, part in chunk]), dim=0)
        outs.append(sum(torch.exp(part - lse).unsqueeze(-1) * o for o, part in chunk))
        lses.append(lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _backward(
    given: dict[str, Any], layout: _Layout, me: int | torch.Tensor, blocks: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query gradient and the key and value gradients (this rank's share of whole ones, or
    its own blocks' on a ring): each seen piece's, from the kernel's backward with the merged
    output and log-sum-exp."""
    grad, q, out, lse = (given[n] for n in ("grad_out", "query", "out", "logsumexp"))
    scale, zero, m = given.get("scale"), torch.zeros((), dtype=q.dtype), layout.chunks
    dq = [torch.zeros_like(_cut(q, slice(u, u + 1), m)) for u in range(m)]
    for s in range(layout.n):
        k, v = blocks.at(s)
        dk = [torch.zeros_like(_cut(k, slice(u, u + 1), m)) for u in range(m)]
        dv = [torch.zeros_like(_cut(v, slice(u, u + 1), m)) for u in range(m)]
        for piece in layout.pieces(s, me):
            if not _visible(piece.seen):
                continue
            qs, ks = piece.qs, piece.ks
            gq, gk, gv = _BACKWARD(
                _cut(grad, qs, m),
                _cut(q, qs, m),
                _cut(k, ks, m),
                _cut(v, ks, m),
                _cut(out, qs, m),
                _cut(lse.unsqueeze(-1), qs, m).squeeze(-1),
                0.0,
                piece.causal,
                scale=scale,
            )
            if isinstance(piece.seen, torch.Tensor):
                # (where, not a product: an unseen piece's terms may overflow)
                gq, gk, gv = (torch.where(piece.seen, g, zero) for g in (gq, gk, gv))
            for acc, g, chunks in ((dq, gq, qs), (dk, gk, ks), (dv, gv, ks)):
                width = g.shape[2] // (chunks.stop - chunks.start)
                for u in range(chunks.start, chunks.stop):
                    acc[u] = acc[u] + g[:, :, (u - chunks.start) * width : (u - chunks.start + 1) * width]
        blocks.add(s, torch.cat(dk, dim=2), torch.cat(dv, dim=2))
    return (torch.cat(dq, dim=2), *blocks.grads())
