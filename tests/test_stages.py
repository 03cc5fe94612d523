"""``vsf.stages`` names what ``vsf.jit`` hands back at each stage (JAX's ``jax.stages``)."""

from __future__ import annotations

import torch

import vsf
from vsf import P


def test_each_stage_is_the_public_type(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    w = vsf.device_put(torch.randn(4, 4), vsf.NamedSharding(mesh, P()))
    x = vsf.device_put(torch.randn(8, 4), vsf.NamedSharding(mesh, P("dp")))
    step = vsf.jit(lambda w, x: (x @ w).sum())
    lowered = step.lower(w, x)
    cost = lowered.cost()
    assert isinstance(step, vsf.stages.Jitted)
    assert isinstance(lowered, vsf.stages.Lowered)
    assert isinstance(lowered.compile(), vsf.stages.Compiled)
    assert isinstance(cost, vsf.stages.Cost)
    # the sum over the batch is reduced once over dp: one scalar all-reduce, 2(n-1)/n of 4 bytes
    assert cost.comm_bytes == {"dp": 4.0}
    torch.testing.assert_close(vsf.device_get(lowered.compile()(w, x)), (vsf.device_get(x) @ vsf.device_get(w)).sum())
