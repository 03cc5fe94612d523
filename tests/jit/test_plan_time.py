"""Planning time without loss of plan: the shortcuts the planner takes give exactly the answers
of the long way round.

* DTensor's decision for an op with per-mesh-dim rules, asked on the mesh dims some input is not
  replicated on (:func:`vsf._compat.dtensor_decision`), against the question asked of the whole
  mesh (DTensor expanding its rules over every mesh dim): equal on every layout tried.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import _compat

aten = torch.ops.aten
R = Replicate()


def _layouts(n_inputs: int, ndim: int, choices: list, count: int) -> list[tuple[tuple, ...]]:
    """``count`` layouts of ``n_inputs`` inputs over a mesh of ``ndim`` dims: on some mesh dims
    (at least one) every input replicated, on the others each input one of ``choices``."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        replicated = set(rng.sample(range(ndim), rng.randint(1, ndim)))
        out.append(tuple(tuple(R if k in replicated else rng.choice(choices) for k in range(ndim)) for _ in range(n_inputs)))
    return out


CASES = [
    # op, input shapes, placements each input may take on a mesh dim
    (aten.bmm.default, [(8, 4, 6), (8, 6, 4)], [R, Shard(0), Shard(1), Shard(2), Partial()]),
    (aten.mm.default, [(8, 6), (6, 4)], [R, Shard(0), Shard(1), Partial()]),
    (aten.add.Tensor, [(8, 6), (6,)], [R, Shard(0), Shard(1), Partial()]),
    (aten.mul.Tensor, [(4, 8, 6), (4, 8, 6)], [R, Shard(0), Shard(2), Partial()]),
]


@pytest.mark.parametrize("op, shapes, choices", CASES, ids=[str(c[0]) for c in CASES])
def test_decision_on_split_dims_is_the_whole_mesh_decision(op, shapes, choices):
    mesh = _compat._abstract_grid((2, 2, 2))
    values = [torch.empty(s, device="meta") for s in shapes]
    fast_ones = 0
    for layouts in _layouts(len(values), 3, choices, 24):
        args = tuple(_compat.Placed(v, p) for v, p in zip(values, layouts))

        def ask(fn):
            try:
                return fn(op, args, {}, mesh)
            except Exception as e:  # noqa: BLE001 - a refusal must be the same refusal
                return type(e)

        full = ask(_compat._full_decision)
        assert ask(_compat.dtensor_decision) == full, layouts
        fast_ones += _compat._on_split_dims(op, args, {}, mesh) is not None
    assert fast_ones > 5  # the shortcut was taken, not only the long way
