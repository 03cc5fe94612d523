"""Simulated jitted steps replayed as plain tensor code (vsf.jit.replay): every rank's shards equal,
bit for bit, what the same step computes under LocalTensorMode (``jit_mode = "interpret"``, the
reference: the simulation equals real gloo runs), and the gathered results equal the step run on
one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from toy_models import GPT, GPTConfig

import vsf
from vsf import P, _compat, config, optim

STEPS = 3


def _shards(tree):
    """Every rank's local shard of every leaf (plain copies)."""
    return [
        {r: t.clone() for r, t in _compat.local_shards(_compat.dtensor_local(x), 0).items()}
        for x in vsf.tree.leaves(tree)
    ]


def _run(jitted, args, mode, steps=STEPS):
    """``steps`` calls of ``jitted`` in ``jit_mode`` ``mode``, each on the previous call's carried
    state; returns each call's results."""
    config.jit_mode = mode
    try:
        outs = []
        for _ in range(steps):
            out = jitted(*args)
            args = _carry(out, args)
            outs.append(out)
        return outs
    finally:
        config.jit_mode = "auto"


def _carry(out, args):
    """The next call's arguments: the results that replace arguments (the state), then the rest."""
    state = out[:-1]
    return (*state, *args[len(state) :])


def _assert_replayed_equals_interpreted(step, args, steps=STEPS):
    """Run ``step`` both ways from the same arguments (``steps`` >= 3: run, recorded, replayed);
    return the replayed run's jitted function and results after checking that the replay ran and
    every rank's shards are equal bit for bit."""
    jitted = vsf.jit(step)  # one plan: the mode is read at each call
    want = _run(jitted, args, "interpret", steps)
    program = jitted.lower(*args).compile()._runner.replayed
    assert program.program is None  # (nothing recorded yet)
    got = _run(jitted, args, "auto", steps)
    assert program.why_not is None and program.program is not None
    for k, (g, w) in enumerate(zip(got, want)):
        for i, (gs, ws) in enumerate(zip(_shards(g), _shards(w))):
            assert gs.keys() == ws.keys()
            for r in gs:
                assert gs[r].shape == ws[r].shape and gs[r].stride() == ws[r].stride(), f"call {k}, leaf {i}, rank {r}"
                assert torch.equal(gs[r], ws[r]), f"call {k}, leaf {i}, rank {r}: {(gs[r] - ws[r]).abs().max()}"
    return jitted, got


def _adamw_gpt(cfg):
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    tx = optim.adamw(3e-3, weight_decay=0.1)

    def train_step(params, opt_state, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return params, tx, train_step


FSDP_TP = [
    (r".*(qkv|fc1)\.weight", P("tp", "fsdp")),
    (r".*(qkv|fc1)\.bias", P("tp")),
    (r".*(proj|fc2)\.weight", P("fsdp", "tp")),
    (r".*", P()),
]


def test_gpt_adamw_step_on_a_5d_layout(sim):
    cfg = GPTConfig(
        vocab=32, seq=8, dim=16, heads=2, layers=1, qkv_bias=False
    )  # (a key bias gets a zero gradient: Adam turns it into noise)
    params, tx, train_step = _adamw_gpt(cfg)
    g = torch.Generator().manual_seed(0)
    idx, tgt = (
        torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g),
        torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g),
    )
    steps = 3  # run, recorded, replayed
    want_p, want_o, want_losses = params, tx.init(params), []
    for _ in range(steps):
        want_p, want_o, loss = train_step(want_p, want_o, idx, tgt)
        want_losses.append(loss)
    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, FSDP_TP)))
    batch = vsf.device_put((idx, tgt), vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    o = optim.init_sharded(tx, p)
    _, got = _assert_replayed_equals_interpreted(train_step, (p, o, *batch), steps)
    torch.testing.assert_close(
        torch.stack([vsf.device_get(out[2]) for out in got]), torch.stack(want_losses), rtol=1e-5, atol=1e-5
    )
    for a, b in zip(vsf.tree.leaves(vsf.device_get(got[-1][0])), vsf.tree.leaves(want_p)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_attention_without_dropout_replays(sim, layout):
    """SDPA's kernels are tagged random for their dropout; without it they draw nothing and the
    program replays (it ran under LocalTensorMode on every call before), bit for bit."""
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1, qkv_bias=False, sdpa=True)
    params, tx, train_step = _adamw_gpt(cfg)
    g = torch.Generator().manual_seed(0)
    idx, tgt = (
        torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g),
        torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g),
    )
    want_p, want_o = params, tx.init(params)
    for _ in range(STEPS):
        want_p, want_o, _ = train_step(want_p, want_o, idx, tgt)
    shape, axes = ((2,), ("dp",)) if layout == "dp" else ((2, 2), ("dp", "tp"))
    sim(len(axes) * 2)
    mesh = vsf.make_mesh(shape, axes)
    rules = (
        [(r".*qkv\.weight", P("tp")), (r".*proj\.weight", P(None, "tp")), (r".*", P())]
        if layout == "dp_tp"
        else [(r".*", P())]
    )
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    batch = vsf.device_put((idx, tgt), vsf.NamedSharding(mesh, P("dp")))
    jitted, got = _assert_replayed_equals_interpreted(train_step, (p, optim.init_sharded(tx, p), *batch))
    assert any(
        "scaled_dot_product" in str(n.target)
        for n in jitted.lower(p, optim.init_sharded(tx, p), *batch).plan.graph.graph.nodes
    )
    for a, b in zip(vsf.tree.leaves(vsf.device_get(got[-1][0])), vsf.tree.leaves(want_p)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _sgd_mlp():
    def loss_fn(p, x, y):
        return ((F.gelu(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2).mean()

    def step(p, x, y):
        loss, g = vsf.value_and_grad(loss_fn)(p, x, y)
        return vsf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    return step


def _reference(step, params, batch):
    losses = []
    for _ in range(STEPS):
        params, loss = step(params, *batch)
        losses.append(loss)
    return params, torch.stack(losses)


@pytest.mark.parametrize("kind", ["uneven", "ragged"])
def test_uneven_and_ragged_shards(sim, kind):
    d = 10 if kind == "uneven" else 16
    params = {"w1": torch.randn(d, 24), "w2": torch.randn(24, d), "b": torch.randn(d)}
    x, y = torch.randn(6, d), torch.randn(6, d)  # 6 rows over 4 ranks: 2, 2, 2, 0
    step = _sgd_mlp()
    want_p, want_losses = _reference(step, params, (x, y))
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    if kind == "uneven":  # 10 rows: 3, 3, 3, 1; w2's 24 rows whole
        specs = {"w1": P("fsdp"), "w2": P(None, "fsdp"), "b": P("fsdp")}
    else:
        specs = {
            "w1": P(vsf.ragged("fsdp", units=(1, 2, 1, 0))),
            "w2": P(vsf.ragged("fsdp", units=(3, 1, 2, 2))),
            "b": P(vsf.ragged("fsdp", units=(1, 1, 1, 1))),
        }
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    batch = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("fsdp")))
    _, got = _assert_replayed_equals_interpreted(step, (p, *batch))
    torch.testing.assert_close(torch.stack([vsf.device_get(out[1]) for out in got]), want_losses, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(vsf.device_get(got[-1][0][k]), want_p[k], rtol=1e-5, atol=1e-6)
        assert vsf.sharding.sharding_of(got[-1][0][k]) == vsf.NamedSharding(mesh, specs[k])


def test_inputs_laid_out_otherwise_are_recorded_again(sim):
    step = _sgd_mlp()
    params = {"w1": torch.randn(10, 24), "w2": torch.randn(24, 10), "b": torch.randn(10)}
    x, y = torch.randn(8, 10), torch.randn(8, 10)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    batch = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("dp")))
    jitted = vsf.jit(step)
    jitted(p, *batch)
    jitted(p, *batch)
    program = jitted.lower(p, *batch).compile()._runner.replayed
    first = program.program
    assert first is not None
    # the same values, each rank's shard of x stored column-major: the record assumed row-major
    local = _compat.dtensor_local(batch[0])
    shards = {r: t.t().contiguous().t() for r, t in _compat.local_shards(local, 0).items()}
    x_cm = _compat.dtensor_like(_compat.make_local(shards), batch[0])
    jitted(p, x_cm, batch[1])
    got_p, got_loss = jitted(p, x_cm, batch[1])
    assert program.program is not None and program.program is not first
    config.jit_mode = "interpret"
    try:
        want_p, want_loss = vsf.jit(step)(p, x_cm, batch[1])
    finally:
        config.jit_mode = "auto"
    assert torch.equal(vsf.device_get(got_loss), vsf.device_get(want_loss))
    for k in params:
        assert torch.equal(vsf.device_get(got_p[k]), vsf.device_get(want_p[k]))


def test_random_draws_keep_running_under_local_tensor_mode(sim, monkeypatch):
    monkeypatch.setattr(config, "allow_unkeyed_random", True)
    monkeypatch.setattr(config, "allow_replicated_fallback", True)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(8, 4), vsf.NamedSharding(mesh, P("dp")))
    jitted = vsf.jit(lambda x: x + torch.rand(x.shape))
    jitted(x)
    jitted(x)
    program = jitted.lower(x).compile()._runner.replayed
    assert program.program is None and "random" in program.why_not


def test_checking_mode_checks_a_replayed_program(sim):
    step = _sgd_mlp()
    params = {"w1": torch.randn(10, 24), "w2": torch.randn(24, 10), "b": torch.randn(10)}
    x, y = torch.randn(8, 10), torch.randn(8, 10)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {"w1": P(None, "tp"), "w2": P("tp"), "b": P()}))
    batch = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("dp")))
    jitted = vsf.jit(step)
    jitted(p, *batch)
    replayed = jitted(p, *batch)
    assert jitted.lower(p, *batch).compile()._runner.replayed.program is not None
    checked = jitted.check(p, *batch)
    for a, b in zip(vsf.tree.leaves(replayed), vsf.tree.leaves(checked)):
        assert torch.equal(vsf.device_get(a), vsf.device_get(b))


def _region_step(body, in_spec, out_spec, mesh):
    region = vsf.shard_map(body, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec)

    def step(w, x):
        loss, g = vsf.value_and_grad(lambda w: (region(x * w) ** 2).sum())(w)
        return w - 0.1 * g, loss

    return step


@pytest.mark.parametrize("name", ["psum", "all_gather", "psum_scatter", "all_to_all", "ppermute"])
def test_manual_region_forward_and_backward(sim, name):
    """A ``shard_map`` region's collectives (vsf.ops under simulation) and the backward node that
    runs their transposes on the forward's autograd graph, replayed."""
    bodies = {
        "psum": (lambda x: vsf.ops.psum(x, "i"), P("i"), P()),
        "all_gather": (lambda x: vsf.ops.all_gather(x, "i", dim=1), P("i"), P("i")),
        "psum_scatter": (lambda x: vsf.ops.psum_scatter(x, "i", dim=0), P("i"), P("i")),
        "all_to_all": (lambda x: vsf.ops.all_to_all(x, "i", 0, 1), P("i"), P("i")),
        "ppermute": (lambda x: vsf.ops.ppermute(x, "i", [(j, (j + 1) % 4) for j in range(4)]), P("i"), P("i")),
    }
    sim(4)
    mesh = vsf.make_mesh((4,), ("i",))
    step = _region_step(*bodies[name], mesh)
    w = vsf.device_put(torch.randn(16, 4), vsf.NamedSharding(mesh, P("i")))
    x = vsf.device_put(torch.randn(16, 4), vsf.NamedSharding(mesh, P("i")))
    _assert_replayed_equals_interpreted(step, (w, x))
