"""RaggedShard values inside vsf.jit: planned, moved with vsf's ragged collectives, equal to unsharded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vsf
from vsf import P, optim
from toy_models import adamw_gpt_case


def test_elementwise_sums_and_norms_stay_ragged(sim):
    w_full = torch.randn(10, 4)
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    w = vsf.device_put(w_full, vsf.NamedSharding(mesh, P(vsf.ragged("fsdp", units=(1, 2, 2, 0)))))

    def f(w):
        return (w * 2).sin().sum(), torch.linalg.vector_norm(w), (w * w).sum(1), w + 1

    jf = vsf.jit(f)
    cost = jf.lower(w).cost()
    # nothing is gathered: the two scalars are all-reduced (one bucket), rows stay on their ranks
    assert cost.count("all_gather") == 0 and cost.count("all_to_all") == 0
    assert all(c.shape == () or c.kind == "all_reduce" and c.shape == (2,) for c in cost.collectives)
    total, norm, rows, plus = jf(w)
    torch.testing.assert_close(vsf.device_get(total), (w_full * 2).sin().sum())
    torch.testing.assert_close(vsf.device_get(norm), torch.linalg.vector_norm(w_full))
    torch.testing.assert_close(vsf.device_get(rows), (w_full * w_full).sum(1))
    torch.testing.assert_close(vsf.device_get(plus), w_full + 1)
    assert vsf.typeof(plus) == "f32[10@fsdp~(1,2,2,0),4]" and vsf.typeof(rows) == "f32[10@fsdp~(1,2,2,0)]"


def test_fsdp_step_gathers_params_and_scatters_grads_ragged(sim):
    params = {"w1": torch.randn(16, 32), "w2": torch.randn(32, 16), "b": torch.randn(16)}
    x, y = torch.randn(64, 16), torch.randn(64, 16)

    def loss_fn(p, x, y):
        return ((F.gelu(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2).mean()

    def step(p, x, y):
        loss, g = vsf.value_and_grad(loss_fn)(p, x, y)
        return vsf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    want_params, want_loss = step(params, x, y)
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    specs = {
        "w1": P(vsf.ragged("fsdp", units=(1, 2, 1, 0))),
        "w2": P(vsf.ragged("fsdp", units=(3, 1, 2, 2))),
        "b": P(vsf.ragged("fsdp", units=(1, 1, 1, 1))),
    }
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    batch = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("fsdp")))
    jstep = vsf.jit(step)
    cost = jstep.lower(p, *batch).cost()
    assert cost.count("all_gather") == len(params) and cost.count("reduce_scatter") == len(params)
    got, loss = jstep(p, *batch)
    torch.testing.assert_close(vsf.device_get(loss), want_loss)
    for k in params:
        torch.testing.assert_close(vsf.device_get(got[k]), want_params[k], rtol=1e-5, atol=1e-6)
        assert vsf.sharding.sharding_of(got[k]) == vsf.NamedSharding(mesh, specs[k])


def test_gpt_with_ragged_fsdp_params_and_adamw_matches_unsharded(sim):
    params, batch, tx, train_step = adamw_gpt_case()

    want, state, want_losses = params, tx.init(params), []
    for _ in range(3):
        want, state, loss = train_step(want, state, *batch)
        want_losses.append(loss)
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    plan = vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh)
    assert any(0 in s.spec.ragged.units or len(set(s.spec.ragged.units)) > 1 for s in vsf.tree.leaves(plan))
    p = vsf.device_put(params, plan)
    s = optim.init_sharded(tx, p)
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, P("fsdp")))
    step = vsf.jit(train_step, donate_argnums=(0, 1))
    losses = []
    for _ in range(3):
        p, s, loss = step(p, s, *b)
        losses.append(vsf.device_get(loss))
    assert step.plan_count == 1
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=0)
    got = vsf.device_get(p)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert vsf.tree.map(vsf.sharding.sharding_of, p) == plan


def test_ragged_input_splitting_two_dims_is_refused(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("fsdp",))
    x = vsf.device_put(torch.randn(2, 3, 4), vsf.NamedSharding(mesh, P(vsf.ragged("fsdp", units=(1, 2), dims=2))))
    with pytest.raises(ValueError, match="split dim 0 only"):
        vsf.jit(lambda a: a * 2)(x)
