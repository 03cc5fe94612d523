"""Context parallelism for causal attention: the queries' sequence split over a mesh axis (``cp``),
keys and values whole, each rank attending with its own queries' positions.

Full (non-causal) attention splits over the queries as it is (DTensor runs the kernel on each
rank's rows: :func:`vsf._compat.attention_sequence_rule`). A causal kernel's mask starts at the
first query it is given, which is position 0 only on the first shard, so DTensor is never told
that rule for a causal op; the planner offers it here instead (:func:`sequence_rule`), and the
program runs the op block by block (:func:`run`). With the sequence in ``n`` equal blocks and
the rank's queries block ``me``, step ``s`` attends to key block ``me - s`` (mod ``n``): step 0 is
the diagonal block, causal as the kernel's own mask is (queries and keys start at the same
position); a step ``s <= me`` is an earlier block, seen whole; a later block (``s > me``) is not
seen and weighs nothing. The blocks' outputs merge by the log-sum-exp rule (flash attention's
and ring attention's). The backward walks the same blocks with the merged output and
log-sum-exp; its key and value gradients are partial sums over the split (each rank's queries'
share), reduced where the plan says. Every rank runs the same ops on same-shaped blocks (which
blocks and what they weigh depend on the rank's values only), nothing is ``T x T``, and the
per-rank work is ``n`` blocks (the unseen ones computed and dropped).

Example::

    >>> sequence_rule(causal_sdpa_node)          # one mesh dim: results, then q, k, v
    [Shard(dim=2), Shard(dim=2), Shard(dim=2), Replicate(), Replicate()]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.distributed.tensor import Placement

from vsf import _compat
from vsf.jit.classify import ATTENTION_OPS
from vsf.jit.graph import meta_of, outputs_meta, tensor_args
from vsf.jit.plan import Placements, is_shard, split_dim, splits_evenly
from vsf.ops import backend
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import from_placements

__all__ = ["is_causal_attention", "run", "runs", "sequence_rule", "splits_sequence"]


def _given(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by their schema names."""
    names = [a.name for a in _compat.op_schema(node.target).arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def is_causal_attention(node: torch.fx.Node) -> bool:
    """Is ``node`` a CPU SDPA kernel (or its backward) with the causal mask and no dropout?"""
    if node.op != "call_function" or node.target not in ATTENTION_OPS:
        return False
    given = _given(node)
    return bool(given.get("is_causal", False)) and given.get("dropout_p", 0.0) == 0.0


def _tensor_names(node: torch.fx.Node) -> list[str]:
    given = _given(node)
    return [name for name in given if isinstance(given[name], torch.fx.Node) and "val" in given[name].meta]


def sequence_rule(node: torch.fx.Node) -> list[Placement] | None:
    """The per-mesh-dim rule (results' placements, then the tensor inputs') that splits a causal
    attention node over its queries' sequence; ``None`` for any other node."""
    if not is_causal_attention(node):
        return None
    given = _given(node)
    return _compat.attention_sequence_rule(node.target, [(name, tuple(given[name].meta["val"].shape)) for name in _tensor_names(node)])


def _query_index(node: torch.fx.Node) -> int:
    return _tensor_names(node).index("query")


def splits_sequence(node: torch.fx.Node, ins: Sequence[Placements]) -> bool:
    """Do the placements ``ins`` of a causal attention node's inputs split its queries' sequence?"""
    return is_causal_attention(node) and any(is_shard(p) and split_dim(p) == 2 for p in ins[_query_index(node)])


def runs(mesh: Mesh, node: torch.fx.Node, ins: Sequence[Placements], outs: Sequence[Placements | None]) -> bool:
    """Does :func:`run` compute ``node`` with inputs and results laid out as ``ins`` and ``outs``
    (the per-axis choices combined)? It does where they split the queries' sequence and every
    dim of every tensor into equal plain shards (each rank's query heads then meet their own key
    and value heads, and its queries start at its shard's offset)."""
    if not splits_sequence(node, ins):
        return False
    metas = [meta_of(v) for v in tensor_args(node)] + outputs_meta(node)
    placed = [*ins, *outs]
    shards = [(t, p) for t, p in zip(metas, placed) if t is not None and p is not None]
    return len(metas) == len(placed) and not any(isinstance(q, _compat.StridedShard) for _, p in shards for q in p) and all(splits_evenly(mesh, t, p) for t, p in shards)


def run(mesh: Mesh, node: torch.fx.Node, args: tuple, kwargs: dict[str, Any], ins: Sequence[Placements]) -> Any:
    """``node`` (a causal attention op whose inputs are laid out as ``ins``, :func:`runs`) on this
    rank's local tensors ``args``/``kwargs``, block by block (see the module docs). Returns the
    op's local results."""
    given = {**dict(zip([a.name for a in _compat.op_schema(node.target).arguments], args)), **kwargs}
    q_meta = meta_of(tensor_args(node)[_query_index(node)])
    queries = from_placements(mesh, ins[_query_index(node)], q_meta.ndim)
    block = given["query"].shape[2]
    chunks = q_meta.shape[2] // block
    split = next(a for a, p in zip(mesh.device_axes, ins[_query_index(node)]) if is_shard(p) and split_dim(p) == 2)
    me = backend.per_rank(torch.zeros((), dtype=torch.int64), backend.axis_group(mesh, split),
                          lambda _, __, rank: torch.tensor(queries.index(q_meta.shape, rank)[2].start // block), with_rank=True)
    steps = [_Step(torch.arange(block) + (me - s) % chunks * block, me >= s) for s in range(chunks)]
    return (_forward if node.target is ATTENTION_OPS[0] else _backward)(given, steps)


class _Step(NamedTuple):
    """Step ``s`` of a rank's walk over the key blocks: the positions of block ``me - s`` (mod the
    block count), and whether the rank's queries see it (``me >= s``: it is not a later block)."""

    keys: torch.Tensor
    seen: torch.Tensor


def _forward(given: dict[str, Any], steps: list[_Step]) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp of the rank's queries: each key block's, merged by the
    log-sum-exp rule (a block not seen weighs nothing)."""
    q, k, v, scale = given["query"], given["key"], given["value"], given.get("scale")
    outs, lses = [], []
    for s, step in enumerate(steps):
        out, lse = ATTENTION_OPS[0](q, k.index_select(2, step.keys), v.index_select(2, step.keys), 0.0, s == 0, scale=scale)
        outs.append(out)
        lses.append(lse.masked_fill(~step.seen, float("-inf")))
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part - lse).unsqueeze(-1) * o for o, part in zip(outs, lses))
    return out.to(q.dtype), lse


def _backward(given: dict[str, Any], steps: list[_Step]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query gradient and this rank's share of the key and value gradients: each seen key
    block's, from the kernel's backward with the merged output and log-sum-exp."""
    grad, q, k, v, out, lse = (given[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp"))
    scale = given.get("scale")
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, step in enumerate(steps):
        gq, gk, gv = ATTENTION_OPS[1](grad, q, k.index_select(2, step.keys), v.index_select(2, step.keys), out, lse, 0.0, s == 0, scale=scale)
        zero = torch.zeros((), dtype=q.dtype)
        dq = dq + torch.where(step.seen, gq, zero)  # (where, not a product: an unseen block's terms may overflow)
        dk = dk.index_add(2, step.keys, torch.where(step.seen, gk, zero))
        dv = dv.index_add(2, step.keys, torch.where(step.seen, gv, zero))
    return dq, dk, dv
