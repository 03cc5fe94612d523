"""Debugging helpers: what each rank holds, how many bytes, and pictures of layouts."""

from __future__ import annotations

from typing import Any

import torch

from vsf import tree
from vsf.sharding.inspect import AddressableShard, shards, visualize_sharding

__all__ = ["AddressableShard", "memory_report", "shards", "visualize_sharding"]


def memory_report(x: Any) -> dict[int, int]:
    """Bytes of tensor data each rank holds for the pytree ``x``: ``{rank: bytes}``, rank order.

    Exact, from the local shards themselves (``numel * element_size`` of each, see :func:`shards`):
    every simulated rank under :func:`vsf.simulate`, this process's rank under ``torchrun``.
    A rank that holds nothing of a leaf counts 0 for it; ``max(report.values())`` is the peak.

    Example::

        >>> vsf.debug.memory_report({"params": params, "opt": opt_state})
        {0: 1605636, 1: 1605636, 2: 1605636, 3: 1605636}
    """
    report: dict[int, int] = {}
    for leaf in tree.leaves(x):
        if isinstance(leaf, torch.Tensor):
            for s in shards(leaf):
                report[s.rank] = report.get(s.rank, 0) + s.data.numel() * s.data.element_size()
    return dict(sorted(report.items()))
