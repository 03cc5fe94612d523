"""A jitted step's outputs: their fake values, their names (key paths) and the shardings they are
planned to (``out_shardings``, or by default a result shaped like an argument kept as it).

Example::

    >>> metas = output_metas(traced)
    >>> output_targets(traced, call, metas, mesh, None)   # each output's sharding, None: free
    >>> output_names(traced)
    ['[0]', "[1]['mu']", '[2]']
"""

from __future__ import annotations

from typing import Any

import torch

from vsf import _compat, tree
from vsf.jit.call import Call, layouts
from vsf.jit.graph import output_node
from vsf.jit.trace import Traced
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding, resolve
from vsf.sharding.put import is_sharding_leaf

__all__ = ["output_metas", "output_names", "output_targets"]


def output_metas(traced: Traced) -> list[torch.Tensor]:
    """The fake value of each tensor output of the traced step, in order."""
    return [n.meta["val"] for n in _compat.torch_tree_leaves(output_node(traced.graph).args)]


def output_names(traced: Traced) -> list[str]:
    """The key paths of the step's tensor outputs (``[1]['mu']``), as its plan's text names them:
    worked out when a text first needs them, not in every plan (a 96-layer GPT's AdamW step has
    3468)."""
    pairs = tree.leaves_with_path(_skeleton(traced))
    return [tree.keystr(p) for (p, _), c in zip(pairs, traced.out_consts) if c is None]


def output_targets(
    traced: Traced, call: Call, metas: list[torch.Tensor], mesh: Mesh, out_shardings: Any
) -> list[NamedSharding | None]:
    """Each tensor output's required sharding (``None``: the planner chooses): ``out_shardings``
    (a prefix of the result's tree) resolved and checked against the output's shape, naming its
    key path where it does not fit; without it, a top-level result shaped exactly like an argument
    keeps that argument's shardings (:func:`_carried`)."""
    skeleton = _skeleton(traced)
    if out_shardings is None:
        return _carried(skeleton, traced, call, metas, mesh)
    full = tree.broadcast_prefix(out_shardings, skeleton, is_leaf=is_sharding_leaf, what="out_shardings")
    pairs = tree.leaves_with_path(skeleton)
    kept = [(s, tree.keystr(p)) for s, c, (p, _) in zip(full, traced.out_consts, pairs) if c is None]
    targets = [resolve(s, name) if s is not None else None for s, name in kept]
    for s, m, (_, name) in zip(targets, metas, kept):
        if s is not None:
            s.check(tuple(m.shape), f"output {name}")
    return targets


def _skeleton(traced: Traced) -> Any:
    """The step's result with a distinct placeholder object in each tensor's place."""
    return tree.unflatten(traced.out_tree, [object() if c is None else c for c in traced.out_consts])


def _carried(
    skeleton: Any, traced: Traced, call: Call, out_metas: list[torch.Tensor], mesh: Mesh
) -> list[NamedSharding | None]:
    """Default output shardings: a top-level result shaped exactly like an argument keeps its shardings."""
    parts = list(skeleton) if isinstance(skeleton, (tuple, list)) else [skeleton]
    consts = iter(traced.out_consts)
    metas = iter(out_metas)
    targets: list[NamedSharding | None] = []
    used: set[int] = set()
    arg_trees = call.arg_trees
    for part in parts:
        leaves = tree.leaves(part)
        is_tensor = [next(consts) is None for _ in leaves]
        avals = [
            (tuple(m.shape), m.dtype) for m, t in zip([next(metas) if t else None for t in is_tensor], is_tensor) if t
        ]
        structure = tree.structure(part) if all(is_tensor) else None  # (None: like no argument)
        match = next(
            (
                j
                for j, (struct, arg_avals) in enumerate(arg_trees)
                if j not in used and struct == structure and [a[:2] for a in arg_avals] == avals
            ),
            None,
        )
        if match is None:
            targets.extend(None for t in is_tensor if t)
            continue
        used.add(match)
        targets.extend(layouts([(mesh, tuple(pl), len(shape)) for shape, _, pl in arg_trees[match][1]]))
    return targets
