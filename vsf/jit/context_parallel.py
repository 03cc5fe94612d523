"""Context parallelism for causal attention: the queries' sequence split over a mesh axis (``cp``),
keys and values whole, each rank attending with its own queries' positions.

Full (non-causal) attention splits over the queries as it is (DTensor runs the kernel on each
rank's rows: :func:`vsf._compat.attention_sequence_rule`). A causal kernel's mask starts at the
first query it is given, which is position 0 only on the first shard, so DTensor is never told
that rule for a causal op; the planner offers it here instead (:func:`sequence_rule`), and the
program runs the op on each rank as full attention under a mask of the rank's own offset (query
``i`` of the shard starting at ``o`` sees keys ``0 .. o + i``: :func:`run`). The backward runs the
same way; its key and value gradients are partial sums over the split (each rank's queries'
share), reduced where the plan says.

The mask is a ``(local queries, keys)`` additive tensor per rank (the kernel takes no offset);
the score matrix itself is never materialised (the CPU kernel is a flash kernel).

Example::

    >>> sequence_rule(causal_sdpa_node)          # one mesh dim: results, then q, k, v
    [Shard(dim=2), Shard(dim=2), Shard(dim=2), Replicate(), Replicate()]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
    rank's local tensors ``args``/``kwargs``: full attention under the mask of the rank's queries'
    offset. Returns the op's local results."""
    given = {**dict(zip([a.name for a in _compat.op_schema(node.target).arguments], args)), **kwargs}
    query = given["query"]
    q_meta = meta_of(tensor_args(node)[_query_index(node)])
    queries = from_placements(mesh, ins[_query_index(node)], q_meta.ndim)
    keys = given["key"].shape[2]
    split = next(a for a, p in zip(mesh.device_axes, ins[_query_index(node)]) if is_shard(p) and split_dim(p) == 2)

    def mask(_: torch.Tensor, __: int, rank: int) -> torch.Tensor:
        start = queries.index(q_meta.shape, rank)[2].start
        rows = torch.arange(start, start + query.shape[2], device=query.device)[:, None]
        cols = torch.arange(keys, device=query.device)[None, :]
        return torch.zeros(query.shape[2], keys, dtype=query.dtype, device=query.device).masked_fill(cols > rows, float("-inf"))

    given["attn_mask"] = backend.per_rank(torch.zeros(()), backend.axis_group(mesh, split), mask, with_rank=True)
    given["is_causal"] = False
    return node.target(**given)
