"""Which ops of a traced graph compute a value again (rematerialisation): an op that applies the
same op to the same values as an earlier one, found by numbering the graph's values (each op's
key: its target and its arguments, read through ``detach``). A step traced through
:func:`vsf.remat` or torch's non-reentrant activation checkpointing holds, after the forward, the
recomputed forward ops that its backward reads instead of values kept from the forward: the
plan runs them there (right before their first backward use, where autograd traced them), so
the values they recompute are freed after their last forward use.

Example::

    >>> again = recomputed(vsf.jit(step).lower(params, batch).plan.graph)
    >>> {n.name: first.name for n, first in again.items()}
    {'addmm_5': 'addmm_1', 'gelu_2': 'gelu_1'}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx

from vsf.jit.cost import op_flops
from vsf.jit.graph import GETITEM, is_view
from vsf.jit.memory import peak_bytes
from vsf.jit.plan import Plan
from vsf.jit.classify import draws_random

__all__ = ["recomputed", "recompute_blocks", "within_budget", "without_recompute"]

_SAME_VALUE = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def recomputed(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each op of ``gm`` that computes a value an earlier op computed (neither a view nor a
    constant, nor a draw from torch's generator), mapped to the first op that computed it."""
    same: dict[torch.fx.Node, torch.fx.Node] = {}
    first: dict[Hashable, torch.fx.Node] = {}
    on_inputs: set[torch.fx.Node] = set()
    again: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        same[node] = node
        if node.op == "placeholder" or not on_inputs.isdisjoint(node.all_input_nodes):
            on_inputs.add(node)
        if node.op != "call_function" or draws_random(node.target, node.args, node.kwargs):
            continue
        if node.target in _SAME_VALUE:
            same[node] = same[node.args[0]]
            continue
        try:
            earlier = first.setdefault(_key(node, same), node)
        except TypeError:  # (an argument that cannot be compared)
            continue
        same[node] = earlier
        if earlier is not node and node in on_inputs and node.target is not GETITEM and not is_view(node):
            again[node] = earlier
    return again


def recompute_blocks(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Each node of ``gm`` numbered by the runs of recomputed ops (:func:`recomputed`) that start
    at or before it: 0 before the first, ``k`` from the ``k``-th run on. A run is a block's forward
    computed again where its backward starts (torch recomputes a checkpointed block whole at
    its first saved-value use), so ``k`` counts the blocks whose backward has begun; views and
    tuple indexing neither start nor end a run, and only a run that recomputes a matmul (or
    other work :func:`vsf.jit.cost.op_flops` counts) is a block's (autograd's own recompute of
    a comparison in a cross-entropy's backward is not). Empty when no block is recomputed.

    Example::

        >>> blocks = recompute_blocks(gm)   # a 2-block checkpointed model
        >>> sorted(set(blocks.values()))
        [0, 1, 2]
    """
    again = recomputed(gm)
    runs: list[list[torch.fx.Node]] = []
    running = False
    for node in gm.graph.nodes:
        # (an op outside every run, and not recomputed, leaves things as they are: whether it is a view matters not)
        if (
            (running or node in again)
            and node.op == "call_function"
            and node.target is not GETITEM
            and not is_view(node)
        ):
            if node in again and not running:
                runs.append([])
            running = node in again
            if running:
                runs[-1].append(node)
    starts = {run[0] for run in runs if any(op_flops(n) for n in run)}
    if not starts:
        return {}
    out: dict[torch.fx.Node, int] = {}
    k = 0
    for node in gm.graph.nodes:
        k += node in starts
        out[node] = k
    return out


def without_recompute(gm: torch.fx.GraphModule, keep: frozenset[int] = frozenset()) -> torch.fx.GraphModule:
    """``gm`` with each recomputed op (:func:`recomputed`) read as the value its first op computed
    (the forward keeps it for the backward), except in the blocks numbered in ``keep``
    (:func:`recompute_blocks`' numbers), which still recompute: the same values, less recompute.

    Example::

        >>> kept = without_recompute(traced.graph)   # what memory_budget compares against
        >>> last_two = without_recompute(traced.graph, keep=frozenset({3, 4}))   # of 4 blocks: recomputes the first two forward blocks
    """
    again = recomputed(gm)
    block = recompute_blocks(gm) if keep else {}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        dropped = node in again and block.get(node, 0) not in keep
        env[node] = env[again[node]] if dropped else graph.node_copy(node, env.__getitem__)
    out = torch.fx.GraphModule(gm, graph)
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def within_budget(
    plan_of: Callable[[torch.fx.GraphModule], Plan], gm: torch.fx.GraphModule, memory_budget: int | None
) -> Plan:
    """``gm``'s plan (``plan_of``), where ``memory_budget`` decides, block by block, the recompute
    the step asked for (``vsf.remat``, activation checkpointing): the plan recomputes the first
    ``m`` blocks of the forward (whose values live longest) for the least ``m`` whose estimated
    peak fits the budget, and keeps the other blocks' values from the forward (then also, as
    ``propagate`` decides, with params gathered again). Found by bisection over ``m`` (the peak
    falls as ``m`` grows): about ``log2`` of the blocks plans besides the two ends. If even every
    block's recompute does not fit, the plan recomputes every block and says it does not fit.
    The plan's notes state the budget, the estimates and the choice.

    Example::

        >>> plan = within_budget(plan_of, traced.graph, 12 * 2**20)   # 8 checkpointed blocks
        >>> plan.notes[-1]
        'memory_budget 12,582,912 B: recomputes blocks 0-2 of 8 in the backward, 33 ops (estimated peak ~11,953,152 B, fits; ...)'
    """
    plan = plan_of(gm)
    if memory_budget is None or not recomputed(gm):
        return plan
    runs = max(
        recompute_blocks(gm).values(), default=0
    )  # blocks, numbered in the backward's order: the forward's first is the last
    blocks = max(runs, 1)  # (a recompute that no block's matmul starts counts as one block)
    plans = {blocks: plan}

    def recomputing(m: int) -> Plan:  # the plan recomputing the forward's first m blocks
        if m not in plans:
            plans[m] = plan_of(without_recompute(gm, keep=frozenset(range(runs - m + 1, runs + 1))))
        return plans[m]

    def fits(m: int) -> bool:
        return peak_bytes(recomputing(m)) <= memory_budget

    lo, hi = 0, blocks
    if fits(0):
        hi = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    chosen = recomputing(hi)
    none, every, peak = peak_bytes(recomputing(0)), peak_bytes(plan), peak_bytes(chosen)
    which = "no block" if hi == 0 else "every block" if hi == blocks else f"blocks 0-{hi - 1}" if hi > 1 else "block 0"
    fit = "fits" if peak <= memory_budget else "does NOT fit the budget"
    note = (
        f"memory_budget {memory_budget:,} B: recomputes {which} of {blocks} in the backward, {len(recomputed(chosen.graph))} ops "
        f"(estimated peak ~{peak:,} B, {fit}; ~{every:,} B with every block, ~{none:,} B with none; {len(plans)} plans weighed)"
    )
    return dataclasses.replace(chosen, notes=chosen.notes + (note,))


def _key(node: torch.fx.Node, same: dict[torch.fx.Node, torch.fx.Node]) -> Hashable:
    """``node``'s op and arguments, each argument node read as the first node of its value
    (unhashable, a ``TypeError`` to hash, when an argument cannot be compared)."""
    return (node.target, _frozen(node.args, same), _frozen(node.kwargs, same) if node.kwargs else ())


def _frozen(x: Any, same: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    if isinstance(x, torch.fx.Node):
        return ("node", same[x])
    if isinstance(x, (list, tuple)):  # (its nodes and plain values read here: most arguments are)
        return tuple(
            [
                ("node", same[a])
                if isinstance(a, torch.fx.Node)
                else _frozen(a, same)
                if isinstance(a, (list, tuple, dict))
                else a
                for a in x
            ]
        )
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v, same)) for k, v in x.items()))
    return x
