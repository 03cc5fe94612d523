"""A whole training step under vsf.jit: a small GPT, params FSDP x TP, Adam state ZeRO-sharded over dp,
clip + AdamW, against the same step run eagerly on one device."""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P, optim
from toy_models import adamw_gpt_case

STEPS = 10

# FSDP x TP (Megatron's column/row split over tp, the other dim over fsdp); the rest replicated.
FSDP_TP = [
    (r".*(qkv|fc1)\.weight", P("tp", "fsdp")),
    (r".*fc1\.bias", P("tp")),
    (r".*(proj|fc2)\.weight", P("fsdp", "tp")),
    (r".*", P()),
]

# What ZeRO over dp makes of each kind of leaf on this mesh (pp, dp, fsdp, cp, tp) = (1, 2, 2, 1, 2):
# a free dim that divides takes dp; where every dim is sharded (or the free one does not divide),
# dp goes minor on the first sharded dim whose local size divides.
ZERO_STATE = {
    "blocks.0.attn.qkv.weight": P(("tp", "dp"), "fsdp"),
    "blocks.0.fc1.weight": P(("tp", "dp"), "fsdp"),
    "blocks.0.fc1.bias": P(("tp", "dp")),
    "blocks.0.attn.proj.weight": P(("fsdp", "dp"), "tp"),
    "blocks.0.fc2.weight": P(("fsdp", "dp"), "tp"),
    "wte.weight": P("dp"),
    "lnf.bias": P("dp"),
}


def test_clip_adamw_step_fsdp_tp_zero_dp_matches_unsharded(sim):
    params, batch, tx, train_step = adamw_gpt_case()

    want_params, state = params, tx.init(params)
    want_losses = []
    for _ in range(STEPS):
        want_params, state, loss = train_step(want_params, state, *batch)
        want_losses.append(loss)

    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
    shardings = vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, FSDP_TP))
    p = vsf.device_put(params, shardings)
    s = optim.init_sharded(tx, p, zero_axes=("dp",))
    for name, spec in ZERO_STATE.items():
        assert vsf.sharding.sharding_of(s[1].mu[name]) == vsf.NamedSharding(mesh, spec), name
    state_shardings = vsf.tree.map(vsf.sharding.sharding_of, s)
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    step = vsf.jit(train_step, donate_argnums=(0, 1))
    losses = []
    for _ in range(STEPS):
        donated = p
        p, s, loss = step(p, s, *b)
        losses.append(vsf.device_get(loss))
    assert step.plan_count == 1
    with pytest.raises(RuntimeError, match="donated to"):
        donated["wte.weight"] + 1
    # the step keeps every layout: params FSDP x TP, state ZeRO over dp
    assert vsf.tree.map(vsf.sharding.sharding_of, p) == shardings
    assert vsf.tree.map(vsf.sharding.sharding_of, s) == state_shardings

    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=0)
    # Adam divides each element by its own gradient scale, so an element whose gradient is tiny
    # (here ln1.weight[15], 2.5e-5 of its leaf's median, whose fp32 value is off by 1e-3 relative
    # even on one device) takes a step whose last digits depend on the reduction order; the
    # param stays within rtol 1e-5 of the unsharded run.
    got = vsf.device_get(p)
    for name, value in want_params.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "clip+adamw"])
def test_zero_over_a_minor_axis_reduce_scatters_gradients_under_jit(sim, clip):
    """FSDP x TP params leave no free dim, so ZeRO puts dp minor (a strided layout): gradients must
    still be reduce-scattered into it (not all-reduced and sliced), and the updates all-gathered.
    With clipping, the norm reads the gradients first; they must still be reduced straight into
    the state's nesting (fsdp, then dp on the local shard), not dp-major and regathered: over dp
    the step then sends what the same step without ZeRO sends (a reduce-scatter and an all-gather
    move what one all-reduce does)."""
    params = {"w1": torch.randn(32, 128), "w2": torch.randn(128, 32)}
    x, y = torch.randn(256, 32), torch.randn(256, 32)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)) if clip else optim.adamw(1e-3)

    def step(p, s, x, y):
        loss, g = vsf.value_and_grad(lambda p: ((torch.nn.functional.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean())(p)
        u, s = tx.update(g, s, p)
        return optim.apply_updates(p, u), s, loss

    want_params, want_state, want_loss = step(params, tx.init(params), x, y)
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    p = vsf.device_put(
        params, {"w1": vsf.NamedSharding(mesh, P("fsdp", "tp")), "w2": vsf.NamedSharding(mesh, P("tp", "fsdp"))}
    )
    s = optim.init_sharded(tx, p, zero_axes=("dp",))
    assert vsf.typeof((s[1] if clip else s).mu["w1"]) == "f32[32@(fsdp,dp),128@tp]"
    b = vsf.device_put((x, y), vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    jstep = vsf.jit(step)
    cost = jstep.lower(p, s, *b).cost()
    plain = jstep.lower(p, optim.init_sharded(tx, p), *b).cost()
    assert cost.count("reduce_scatter", "dp") == 2 and cost.count("all_gather", "dp") == 2
    assert all(
        c.shape == () for c in cost.collectives if c.kind == "all_reduce" and c.axis == "dp"
    )  # the loss, the norm
    assert cost.comm_bytes["dp"] <= plain.comm_bytes["dp"] + 16
    assert (cost.comm_bytes["fsdp"], cost.comm_bytes["tp"]) == (plain.comm_bytes["fsdp"], plain.comm_bytes["tp"])
    got_p, got_s, loss = jstep(p, s, *b)
    torch.testing.assert_close(vsf.device_get(loss), want_loss)
    for k in params:
        torch.testing.assert_close(vsf.device_get(got_p[k]), want_params[k], rtol=1e-5, atol=1e-6)
    for got, want in zip(vsf.tree.leaves(got_s), vsf.tree.leaves(want_state)):
        torch.testing.assert_close(vsf.device_get(got), want, rtol=1e-5, atol=1e-6)
