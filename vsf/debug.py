"""Debugging helpers: what each rank holds, how many bytes, and pictures of layouts."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import tree
from vsf.sharding.mesh import held_only_by_its_ranks, mesh_of
from vsf.sharding.inspect import AddressableShard, shards, visualize_sharding

__all__ = ["AddressableShard", "memory_report", "shards", "visualize_sharding"]


def memory_report(x: Any) -> dict[int, int]:
    """Bytes of tensor data each rank holds for the pytree ``x``: ``{rank: bytes}``, rank order.

    Exact, from the local shards themselves (``numel * element_size`` of each, see :func:`shards`):
    every simulated rank under :func:`vsf.simulate`, this process's rank under ``torchrun``.
    A rank that holds nothing of a leaf counts 0 for it; ``max(report.values())`` is the peak.

    Example::

        >>> with vsf.simulate(4):
        ...     mesh = vsf.make_mesh((4,), ("dp",))
        ...     w = vsf.device_put(torch.zeros(8, 6), vsf.NamedSharding(mesh, P("dp")))
        ...     vsf.debug.memory_report({"w": w, "step": vsf.device_put(torch.tensor(0), vsf.NamedSharding(mesh, P()))})
        {0: 56, 1: 56, 2: 56, 3: 56}
    """
    report: dict[int, int] = {}
    for leaf in tree.leaves(x):
        if isinstance(leaf, torch.Tensor):
            # a pipeline stage's value under simulation has a copy on every pp coordinate (see
            # Mesh.at); only its own mesh's ranks hold it in a real run
            mesh = mesh_of(leaf.device_mesh) if isinstance(leaf, DTensor) else None
            ranks = set(mesh.devices) if mesh is not None and held_only_by_its_ranks(mesh) else None
            for s in shards(leaf):
                if ranks is None or s.rank in ranks:
                    report[s.rank] = report.get(s.rank, 0) + s.data.numel() * s.data.element_size()
    return dict(sorted(report.items()))
