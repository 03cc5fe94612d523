"""Attention's sharding rules, which vsf registers with DTensor for the CPU attention kernels SDPA
traces to (DTensor registers them for its CUDA flash kernel only).

On a mesh dim the op splits over the batch (dim 0) or the heads (dim 1) of every tensor alike, or
is replicated. A mask argument (``attn_mask``/``attn_bias``, broadcast from the right) is split
where it has that dim at full size and replicated where it broadcasts; grouped-query heads (fewer
key/value heads than query heads) split only into equal parts (each rank's query heads must meet
their own key/value head); with dropout the op is only replicated (its random draw is not
sharding-invariant).

Without a causal mask it also splits over the queries' sequence (dim 2: context parallelism with
whole keys and values): the queries, the output, its log-sum-exp, the mask's query rows and their
cotangents are split, keys and values are replicated, and the backward's key and value gradients
are partial sums (each rank's queries' share). The kernel's causal mask starts at the first query
of the shard it is given, so a causal op is never split so here (its context parallelism is
:mod:`vsf.jit.context_parallel`'s, which uses :func:`sequence_rule`).

Example::

    >>> register(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from vsf import _compat

__all__ = ["register", "sequence_rule"]

_MASKS = ("attn_mask", "attn_bias")
_KEYS_VALUES = ("key", "value", "grad_key", "grad_value")


def register(op: Any) -> None:
    """Tell DTensor's sharding propagation how the attention op ``op`` splits (the module docs).

    Example::

        >>> register(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    """
    schema = _compat.op_schema(op)
    names = [a.name for a in schema.arguments]
    n_out = sum(isinstance(r.type, torch.TensorType) for r in schema.returns)

    def rules(given: dict[str, Any]) -> list[list[Placement]]:
        tensors = [(n, given[n]) for n in names if isinstance(given.get(n), torch.Size)]
        rank = len(given["query"])
        out = [[Replicate()] * (n_out + len(tensors))]
        if given.get("dropout_p", 0.0) == 0.0:
            for d in (0, 1):
                out.append([Shard(d)] * n_out + [_split(name, shape, d, rank) for name, shape in tensors])
            if not given.get("is_causal", False):
                out.append(sequence_rule(op, tensors))
        return out

    _compat.register_mesh_dim_rules(op, rules, static_from="dropout_p", valid=_equal_head_splits)


def _split(name: str, shape: Sequence[int], d: int, rank: int) -> Placement:
    if name not in _MASKS:
        return Shard(d)
    m = len(shape) - rank + d  # masks broadcast from the right
    return Shard(m) if m >= 0 and shape[m] > 1 else Replicate()


def sequence_rule(op: Any, tensors: Sequence[tuple[str, Sequence[int]]]) -> list[Placement]:
    """The placements, on one mesh dim, of the attention op ``op``'s results then tensor arguments
    (``tensors``: their names and shapes) for a split of the queries' sequence (dim 2): the
    forward's results (output, log-sum-exp) split with the queries, as does the backward's query
    gradient; keys and values are whole, their gradients partial sums; a mask's query rows split.

    Example::

        >>> sequence_rule(aten._scaled_dot_product_flash_attention_for_cpu.default, [("query", q.shape), ("key", k.shape), ("value", v.shape)])
        [Shard(dim=2), Shard(dim=2), Shard(dim=2), Replicate(), Replicate()]
    """
    rank = len(dict(tensors)["query"])
    results = [r.name for r in _compat.op_schema(op).returns if isinstance(r.type, torch.TensorType)]
    outs: list[Placement] = [Partial() if name in _KEYS_VALUES else Shard(2) for name in results]
    return outs + [Replicate() if name in _KEYS_VALUES else _split(name, shape, 2, rank) for name, shape in tensors]


def _equal_head_splits(
    given: dict[str, Any], layouts: list[tuple[torch.Size, tuple[Placement, ...]]], mesh_shape: tuple[int, ...]
) -> bool:
    """With grouped-query heads, does every tensor's heads dim split into equal parts?"""
    if given["query"][1] == given["key"][1]:
        return True
    for shape, placements in layouts:
        parts = 1
        for k, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim == 1:
                parts *= mesh_shape[k]
        if shape[1] % parts:
            return False
    return True
