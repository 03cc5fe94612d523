"""with_sharding_constraint inside a differentiated function under vsf.jit: the gradient flows
through it, and the cotangent is pinned to the same sharding (JAX's transpose rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import vsf
from vsf import P


def test_grad_through_a_constraint_matches_unsharded_and_pins_the_cotangent(sim):
    params = {"w1": torch.randn(16, 64), "w2": torch.randn(64, 16)}
    x, y = torch.randn(64, 16), torch.randn(64, 16)

    def loss_fn(p, x, y, pin):
        out = F.gelu(x @ p["w1"]) @ p["w2"]
        if pin:  # Megatron's sequence parallelism: keep the row-parallel output split over tp
            out = vsf.with_sharding_constraint(out, P(("dp", "tp")))
        return ((out - y) ** 2).mean()

    def step(p, x, y, pin):
        return vsf.value_and_grad(loss_fn)(p, x, y, pin)

    want_loss, want_grads = step(params, x, y, False)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {"w1": P(None, "tp"), "w2": P("tp")}))
    b = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("dp")))
    f = vsf.jit(step, static_argnums=3)
    with vsf.use_mesh(mesh):
        free, pinned = f.lower(p, *b, False).cost(), f.lower(p, *b, True).cost()
        loss, grads = f(p, *b, True)
    # unpinned: the output's partial sum over tp is all-reduced; pinned: reduce-scattered, and its
    # cotangent (pinned the same way) all-gathered back before the backward matmuls
    assert free.count("all_reduce", "tp") == 1 and free.count("reduce_scatter", "tp") == 0
    assert pinned.count("all_reduce", "tp") == 1  # only the loss: its mean over the tp-split rows
    assert pinned.count("reduce_scatter", "tp") == 1 and pinned.count("all_gather", "tp") == 1
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=1e-6)
    got = vsf.device_get(grads)
    for k in params:
        torch.testing.assert_close(got[k], want_grads[k], rtol=1e-5, atol=1e-5)
