"""Tied params between pipeline stages, Megatron's way: the stage that holds a tied leaf (the first
naming it, :func:`vsf.pipeline.split.assign`) lends its value to every later stage naming it each
step, and their gradients are summed into the holder's before the update, so the tree, the
optimizer state and checkpoints hold one value. Between processes the copies and the gradients go
over ``pp``, each rank to the rank at its other coordinates in the other stage (``peer``).

Example::

    >>> lent = lend(layout, ("wte.weight",), values, pipe.local_stages(), pipe._peer)
    >>> lent[("wte.weight", 1)].placements == layout.where("wte.weight", 1)[0].placements
    True
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vsf.pipeline.split import Layout
from vsf.pipeline.stage import as_global
from vsf.sharding.named import sharding_of

__all__ = ["lend", "sum_lent"]


def lend(
    layout: Layout, tied: Sequence[str], values: dict[str, Any], mine: Collection[int], peer: Callable[[int], int]
) -> dict[tuple[str, int], DTensor]:
    """Each borrowed tied leaf's copy on its borrower's mesh, keyed ``(name, borrower)``: the
    owner's shard at the same coordinates of the other axes (sent to ``peer(stage)`` between
    processes; ``mine``: the stages this process computes)."""
    out = {}
    for k in tied:
        owner = layout.split.owner[k]
        for b in layout.split.users[k][1:]:
            if owner in mine and b in mine:  # (one process, or both stages on this rank)
                out[(k, b)] = as_global(values[k].to_local(), layout.where(k, b))
            elif owner in mine:
                dist.send(values[k].to_local().contiguous(), dst=peer(b))
            elif b in mine:
                sharding, shape = layout.where(k, b)
                buf = torch.empty(sharding.shard_shape(shape), dtype=layout.shapes[k].dtype)
                dist.recv(buf, src=peer(owner))
                out[(k, b)] = as_global(buf, layout.where(k, b))
    return out


def sum_lent(
    layout: Layout,
    tied: Sequence[str],
    grads: dict[str, DTensor],
    lent: dict[tuple[str, int], DTensor],
    mine: Collection[int],
    peer: Callable[[int], int],
) -> None:
    """Sum the borrowers' gradients ``lent`` (keyed ``(name, borrower)``) into their owners' in
    ``grads``, in place (sent to ``peer(stage)`` between processes; ``mine``: the stages this
    process computes)."""
    for k in tied:
        owner = layout.split.owner[k]
        for b in layout.split.users[k][1:]:
            if (k, b) in lent and owner in mine:
                grads[k] = grads[k] + as_global(lent[(k, b)].to_local(), (sharding_of(grads[k]), tuple(grads[k].shape)))
            elif (k, b) in lent:
                dist.send(lent[(k, b)].to_local().contiguous(), dst=peer(owner))
            elif owner in mine:
                buf = torch.empty_like(grads[k].to_local())
                dist.recv(buf, src=peer(b))
                grads[k] = grads[k] + as_global(buf, (sharding_of(grads[k]), tuple(grads[k].shape)))
