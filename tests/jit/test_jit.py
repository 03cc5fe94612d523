"""vsf.jit on simulated ranks and on 4 real gloo processes (tier 3, ``multiprocess``): every sharded
run must equal the same step run unsharded."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from toy_models import Attention, GPT, GPTConfig
from torch.distributed.tensor.debug import CommDebugMode

import vsf
from vsf import P
from torch.distributed.tensor import Replicate, Shard
from vsf.errors import TraceError

STEPS = 2
LR = 0.1


def sgd(params, grads):
    return vsf.tree.map(lambda p, g: p - LR * g, params, grads)


def make_step(loss_fn):
    def step(params, *batch):
        loss, grads = vsf.value_and_grad(loss_fn)(params, *batch)
        return sgd(params, grads), loss

    return step


def reference(step, params, batch, steps=STEPS):
    losses = []
    for _ in range(steps):
        params, loss = step(params, *batch)
        losses.append(loss)
    return params, losses


def run_sharded(step, params, batch, mesh, param_specs, batch_specs, steps=STEPS):
    jitted = vsf.jit(step)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, param_specs))
    b = vsf.device_put(batch, vsf.NamedSharding.tree(mesh, batch_specs))
    losses = []
    for _ in range(steps):
        p, loss = jitted(p, *b)
        losses.append(vsf.device_get(loss))
    return jitted, vsf.device_get(p), losses


def assert_close_trees(got, want, rtol=1e-5, atol=1e-5):
    for (path, g), w in zip(vsf.tree.leaves_with_path(got), vsf.tree.leaves(want)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{vsf.tree.keystr(path)}: {m}")


# -- models -------------------------------------------------------------------------------------


def mlp_case():
    params = {"w1": torch.randn(16, 64), "w2": torch.randn(64, 16)}
    batch = (torch.randn(32, 16), torch.randn(32, 16))

    def loss_fn(p, x, y):
        return ((F.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    return params, batch, loss_fn


def attention_case():
    cfg = GPTConfig(dim=32, heads=4, seq=8)
    module = Attention(cfg)
    params = vsf.tree.from_module(module)
    batch = (torch.randn(4, cfg.seq, cfg.dim), torch.randn(4, cfg.seq, cfg.dim))

    def loss_fn(p, x, y):
        return ((vsf.tree.apply(module, p, x) - y) ** 2).mean()

    return params, batch, loss_fn


def gpt_case(tied=True):
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1, tied=tied)
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    batch = (torch.randint(0, cfg.vocab, (8, cfg.seq)), torch.randint(0, cfg.vocab, (8, cfg.seq)))

    def loss_fn(p, idx, tgt):
        return vsf.tree.apply(model, p, idx, tgt)

    return params, batch, loss_fn


MEGATRON = [
    (r".*(qkv|fc1)\.weight", P("tp")),
    (r".*(qkv|fc1)\.bias", P("tp")),
    (r".*(proj|fc2)\.weight", P(None, "tp")),
    (r".*", P()),
]
FSDP = [(r".*weight", P("fsdp")), (r".*", P())]
FSDP_TP = [
    (r".*(qkv|fc1)\.weight", P("tp", "fsdp")),
    (r".*(qkv|fc1)\.bias", P("tp")),
    (r".*(proj|fc2)\.weight", P("fsdp", "tp")),
    (r".*", P()),
]
REPLICATED = [(r".*", P())]

LAYOUTS = {
    "dp": ((4,), ("dp",), REPLICATED, P("dp")),
    "fsdp": ((4,), ("fsdp",), FSDP, P("fsdp")),
    "tp": ((2,), ("tp",), MEGATRON, P()),
    "dp_tp": ((2, 2), ("dp", "tp"), MEGATRON, P("dp")),
    "dp_cp": ((2, 2), ("dp", "cp"), REPLICATED, P("dp", "cp")),
    "5d": ((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"), FSDP_TP, P(("dp", "fsdp"))),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpt_matches_unsharded(sim, layout):
    params, batch, loss_fn = gpt_case(tied=layout != "tp")
    step = make_step(loss_fn)
    want_params, want_losses = reference(step, params, batch)
    shape, names, rules, batch_spec = LAYOUTS[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    jitted, got, losses = run_sharded(step, params, batch, mesh, vsf.sharding.match(params, rules), batch_spec)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-5)
    assert_close_trees(got, want_params)
    assert jitted.plan_count == 1


@pytest.mark.parametrize(
    "case,layout", [("mlp", "dp_tp"), ("mlp", "fsdp"), ("attention", "dp_tp"), ("attention", "dp_cp")]
)
def test_blocks_match_unsharded(sim, case, layout):
    params, batch, loss_fn = {"mlp": mlp_case, "attention": attention_case}[case]()
    step = make_step(loss_fn)
    want_params, want_losses = reference(step, params, batch)
    shape, names, rules, batch_spec = LAYOUTS[layout]
    if case == "mlp" and layout == "dp_tp":
        rules = [("w1", P(None, "tp")), ("w2", P("tp", None))]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    _, got, losses = run_sharded(step, params, batch, mesh, vsf.sharding.match(params, rules), batch_spec)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-5)
    assert_close_trees(got, want_params)


def test_a_detached_or_twice_transposed_weight_is_planned_as_the_weight_and_keeps_its_gradient(sim):
    # the plan reads a view that gives back its tensor (detach, t of t) as the tensor itself; the
    # gradient the detach stops was stopped while tracing, so the parameters still follow one device
    params, batch, _ = mlp_case()

    def loss_fn(p, x, y):
        h = F.gelu(x @ p["w1"]) @ p["w2"].t().t()
        return ((h - y) ** 2).mean() + (x @ p["w1"].detach()).square().mean()

    step = make_step(loss_fn)
    want_params, want_losses = reference(step, params, batch, steps=3)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    rules = vsf.sharding.match(params, [("w1", P(None, "tp")), ("w2", P("tp", None))])
    jitted, got, losses = run_sharded(step, params, batch, mesh, rules, P("dp"), steps=3)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-5)
    assert_close_trees(got, want_params)
    text = jitted.lower(
        *vsf.device_put((params, *batch), vsf.NamedSharding.tree(mesh, (rules, P("dp"), P("dp"))))
    ).as_text()
    assert not re.search(r"= detach\(%arg|= t\(%t(_\d+)?:", text), text  # (the loss returned keeps its detach)


def test_uneven_batch_matches_unsharded(sim):
    params, batch, loss_fn = mlp_case()
    batch = (batch[0][:6], batch[1][:6])  # 6 rows over 4 ranks: 2, 2, 2, 0
    step = make_step(loss_fn)
    want_params, want_losses = reference(step, params, batch)
    sim(4)
    mesh = vsf.make_mesh((4,), ("dp",))
    _, got, losses = run_sharded(step, params, batch, mesh, vsf.tree.map(lambda _: P(), params), P("dp"))
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-5)
    assert_close_trees(got, want_params)


def test_rows_split_unevenly_by_two_nested_axes_are_reduced_apart_over_a_third(sim):
    """6 rows over dp=2 and fsdp=2 nested are 2, 2, 1, 1 rows a rank: two row-parallel products'
    partial sums over tp hold shards of different shapes on different ranks, so they are not copied
    into one bucket's flat buffer (each rank's buffer would differ; a simulated run raised
    ``unhashable type: non-nested SymInt`` building it). Each is reduced alone and equals one device."""
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    x1, x2, w1, w2 = (torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 4), torch.randn(8, 4))
    rows = vsf.NamedSharding(mesh, P(("dp", "fsdp"), "tp"))
    jf = vsf.jit(lambda a, b, c, d: (a @ c, b @ d), out_shardings=vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    args = (*vsf.device_put((x1, x2), rows), *vsf.device_put((w1, w2), vsf.NamedSharding(mesh, P("tp"))))
    plan = jf.lower(*args).plan
    assert plan.buckets == () and [r.dst for r in plan.redistributions] == [(Shard(0), Shard(0), Replicate())] * 2
    got = jf(*args)
    torch.testing.assert_close(vsf.device_get(got[0]), x1 @ w1)
    torch.testing.assert_close(vsf.device_get(got[1]), x2 @ w2)


def test_a_convolution_net_with_one_image_a_rank_over_dp_and_fsdp_trains_like_unsharded(sim):
    """A UNet's pieces: a convolution, an attention-style mix of its channels over the pixels, read
    back as an image (a view of a transposed value: channels-last), a group norm and another
    convolution, with 4 images over dp=2 and fsdp=2. Each convolution runs on its local images
    (DTensor's convolution handler refused a batch split over two mesh dims), and the group norm
    gets its one-image shard laid out channels-last (CPU group norm refused the view's batch stride)."""
    g = torch.Generator().manual_seed(0)
    params = {
        "conv1": torch.randn(8, 3, 3, 3, generator=g) * 0.3,
        "mix": torch.randn(8, 8, generator=g) * 0.3,
        "norm": torch.ones(8),
        "conv2": torch.randn(4, 8, 3, 3, generator=g) * 0.3,
    }
    batch = (torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 4, 4, 4, generator=g))

    def loss_fn(p, x, y):
        h = F.conv2d(x, p["conv1"], padding=1)
        n, c, hh, ww = h.shape
        mixed = (h.flatten(2).transpose(1, 2) @ p["mix"]).transpose(1, 2).view(n, c, hh, ww)
        out = F.conv2d(F.group_norm(mixed, 2, p["norm"]), p["conv2"], padding=1)
        return ((out - y) ** 2).mean()

    step = make_step(loss_fn)
    want_params, want_losses = reference(step, params, batch)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    _, got, losses = run_sharded(step, params, batch, mesh, vsf.tree.map(lambda _: P(), params), P(("dp", "fsdp")))
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-5)
    assert_close_trees(got, want_params)


# -- plan quality against the analytic optimum ---------------------------------------------------


def megatron_mlp(sim, input_grad: bool):
    params, (x, y), loss_fn = mlp_case()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = vsf.device_put(
        params, {"w1": vsf.NamedSharding(mesh, P(None, "tp")), "w2": vsf.NamedSharding(mesh, P("tp", None))}
    )
    xb, yb = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("dp")))

    def step(params, x, y):
        argnums = (0, 1) if input_grad else 0
        loss, grads = vsf.value_and_grad(loss_fn, argnums=argnums)(params, x, y)
        g = grads[0] if input_grad else grads
        out = (sgd(params, g), loss)
        return out + (grads[1],) if input_grad else out

    return vsf.jit(step).lower(p, xb, yb), x, params


def test_megatron_mlp_one_tp_all_reduce_forward(sim):
    lowered, x, params = megatron_mlp(sim, input_grad=False)
    c = lowered.cost()
    assert c.count("all_reduce", "tp") == 1
    assert c.count("all_gather") == c.count("reduce_scatter") == c.count("all_to_all") == 0
    # one all-reduce of the [batch/dp, hidden] activations: 2(n-1)/n of its bytes
    act_bytes = (x.shape[0] // 2) * params["w2"].shape[1] * 4
    assert c.comm_bytes["tp"] == 2 * (2 - 1) / 2 * act_bytes
    # dp: the loss and every gradient reduced exactly once, all in one bucket (one collective)
    reduced = [r.value for r in lowered.plan.redistributions if r.collectives and r.collectives[0].axis == "dp"]
    assert len(reduced) == len(set(reduced)) == 1 + len(params)
    assert c.count("all_reduce", "dp") == 1 and len(lowered.plan.buckets) == 1
    grads_bytes = sum(v.numel() // 2 * 4 for v in params.values())  # each grad is tp-sharded
    assert c.comm_bytes["dp"] == round(2 * (2 - 1) / 2 * 4) + 2 * (2 - 1) / 2 * grads_bytes


def test_megatron_mlp_backward_all_reduce_when_input_grad_needed(sim):
    lowered, _, _ = megatron_mlp(sim, input_grad=True)
    assert lowered.cost().count("all_reduce", "tp") == 2


def test_fsdp_gathers_each_param_once_and_scatters_each_grad(sim):
    params, (x, y), loss_fn = mlp_case()
    x, y = x.repeat(8, 1), y.repeat(8, 1)  # enough tokens that gathering weights beats moving activations
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P("fsdp")))
    b = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("fsdp")))
    lowered = vsf.jit(make_step(loss_fn)).lower(p, *b)
    c = lowered.cost()
    # both weights gathered by one collective on a flat buffer (FSDP's per-layer group), both
    # gradients reduce-scattered by one; each param once, in one bucket
    assert c.count("all_gather", "fsdp") == 1 and c.count("reduce_scatter", "fsdp") == 1
    kinds = sorted((b.kind, sorted(r.value[0].name for r in b.members)) for b in lowered.plan.buckets)
    assert [k for k, _ in kinds] == ["all_gather", "reduce_scatter"] and all(len(m) == len(params) for _, m in kinds)
    assert c.count("all_reduce", "fsdp") == 1  # the loss
    weights = sum(v.numel() * 4 for v in params.values())
    assert c.comm_bytes["fsdp"] == round(2 * 3 / 4 * 4) + 2 * 3 / 4 * weights


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axes", [("fsdp",), ("dp", "fsdp")])
def test_bucketed_gathers_and_scatters_equal_one_device(sim, axes, dim):
    """Weights split on dim 0 or 1 over fsdp (next to dp, whose reduction is not a reduce-scatter):
    one bucketed all-gather of both weights, one bucketed reduce-scatter of both gradients over
    fsdp (flat buffers cut and reassembled along the split dim), on dp x fsdp that bucket's
    scattered buffer then all-reduced over dp (HSDP's reduction: the dp all-reduce moves the fsdp
    shards), and the numbers of one device."""
    params, (x, y), loss_fn = mlp_case()
    x, y = x.repeat(8, 1), y.repeat(8, 1)
    step = make_step(loss_fn)
    want_params, want_losses = reference(step, params, (x, y), steps=3)
    sim(4)
    mesh = vsf.make_mesh((4,) if len(axes) == 1 else (2, 2), axes)
    spec, data = (P("fsdp") if dim == 0 else P(None, "fsdp")), P(axes)
    jitted, got_params, got_losses = run_sharded(step, params, (x, y), mesh, {"w1": spec, "w2": spec}, data, steps=3)
    placed = (
        vsf.device_put(params, vsf.NamedSharding(mesh, spec)),
        *vsf.device_put((x, y), vsf.NamedSharding(mesh, data)),
    )
    buckets = sorted(jitted.lower(*placed).plan.buckets, key=lambda b: b.kind)
    assert [[(c.kind, c.axis) for c in b.collectives] for b in buckets] == [
        [("all_gather", "fsdp")],
        [("reduce_scatter", "fsdp"), *([("all_reduce", "dp")] if len(axes) == 2 else [])],
    ]
    assert_close_trees(got_params, want_params)
    torch.testing.assert_close(torch.stack(got_losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)


def test_data_parallel_gpt_sends_only_the_loss_and_each_gradient_once(sim):
    # the analytic optimum for DP: the cross-entropy stays on each rank's rows (forward and
    # backward), then one all-reduce of every gradient and of the loss's sum and count
    params, batch, loss_fn = gpt_case()
    sim(4)
    mesh = vsf.make_mesh((4,), ("dp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, P("dp")))
    c = vsf.jit(make_step(loss_fn)).lower(p, *b).cost()
    assert {x.kind for x in c.collectives} == {"all_reduce"}
    weights = sum(v.numel() * 4 for v in params.values())
    assert c.comm_bytes["dp"] == pytest.approx(2 * 3 / 4 * (weights + 2 * 4), abs=2)


def test_cost_counts_the_collectives_that_run(sim):
    params, batch, loss_fn = gpt_case()
    shape, names, rules, batch_spec = LAYOUTS["5d"]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    step = vsf.jit(make_step(loss_fn))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec))
    planned = step.lower(p, *b).cost()
    with CommDebugMode() as comm:
        step(p, *b)
    ran = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    kinds = {
        "all_reduce": ("all_reduce",),
        "all_gather": ("all_gather_into_tensor",),
        "reduce_scatter": ("reduce_scatter_tensor",),
        "all_to_all": ("all_to_all_single", "shard_dim_alltoall"),
    }
    for kind, ops in kinds.items():
        assert planned.count(kind) == sum(ran.get(op, 0) for op in ops), (kind, planned.count(kind), ran)
    assert set(ran) <= {op for ops in kinds.values() for op in ops}, ran


# -- caching and re-planning ----------------------------------------------------------------------


def test_replans_only_on_shape_dtype_sharding_or_static_change(sim, caplog):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))

    def f(x, w, scale):
        return (x @ w * scale).sum(), x.shape[0]

    jf = vsf.jit(f, static_argnums=(2,))
    x = vsf.device_put(torch.randn(8, 4), vsf.NamedSharding(mesh, P("dp")))
    w = vsf.device_put(torch.randn(4, 3), vsf.NamedSharding(mesh, P()))
    with caplog.at_level(logging.INFO, logger="vsf.jit"):
        for _ in range(3):
            jf(x, w, 2.0)
        assert jf.plan_count == 1
        jf(vsf.device_put(torch.randn(8, 4), vsf.NamedSharding(mesh, P("dp"))), w, 2.0)  # new values only
        assert jf.plan_count == 1
        jf(vsf.device_put(torch.randn(6, 4), vsf.NamedSharding(mesh, P("dp"))), w, 2.0)
        assert jf.plan_count == 2 and "shape" in jf.replans[-1]
        jf(x.to(torch.float64), w.to(torch.float64), 2.0)
        assert jf.plan_count == 3 and "dtype" in jf.replans[-1]
        jf(vsf.device_put(x, vsf.NamedSharding(mesh, P())), w, 2.0)
        assert jf.plan_count == 4 and "sharding" in jf.replans[-1] and jf.replans[-1].endswith("-> f32[8,4]")
        jf(x, w, 3.0)
        assert jf.plan_count == 5 and "static" in jf.replans[-1]
        jf(x, w, 3.0)
        assert jf.plan_count == 5
    assert sum(r.message.startswith("planning") for r in caplog.records) == 5


def test_calls_alternating_between_two_signatures_run_each_ones_program(sim):
    # a call whose key equals the last call's reuses its program without a lookup; one whose key
    # differs must not: each call's result is its own signature's
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    jf = vsf.jit(lambda x, w: (x @ w).sum(0))
    w = vsf.device_put(torch.randn(4, 3), vsf.NamedSharding(mesh, P()))
    xs = [vsf.device_put(torch.randn(n, 4), vsf.NamedSharding(mesh, P(spec))) for n, spec in ((8, "dp"), (6, None))]
    for _ in range(2):
        for x in xs + xs[::-1]:
            torch.testing.assert_close(vsf.device_get(jf(x, w)), (vsf.device_get(x) @ vsf.device_get(w)).sum(0))
    assert jf.plan_count == 2


def test_a_later_call_flattens_its_arguments_once_and_looks_no_program_up(sim, monkeypatch):
    """Work a call did outside its program for every leaf: flattening the donated arguments again
    to release them, and hashing and comparing every leaf's layout to look the program up (a
    207-leaf GPT AdamW step, its program stubbed out, 1 gloo rank: 0.05 ms each of 0.78 ms a call)."""
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    f = vsf.jit(lambda p, x: (vsf.tree.map(lambda t: t * x, p), x.sum()), donate_argnums=0)
    p = vsf.device_put({f"w{i}": torch.ones(4) for i in range(20)}, vsf.NamedSharding(mesh, P("dp")))
    x = vsf.device_put(torch.full((4,), 2.0), vsf.NamedSharding(mesh, P()))
    for _ in range(2):
        p, _ = f(p, x)
    flattened, looked_up = [], []
    flatten = vsf.tree.flatten
    monkeypatch.setattr(vsf.tree, "flatten", lambda *a, **k: flattened.append(a) or flatten(*a, **k))

    class Lookups(dict):
        def get(self, key, default=None):
            looked_up.append(key)
            return super().get(key, default)

    monkeypatch.setattr(f, "_cache", Lookups(f._cache))
    p, total = f(p, x)
    assert len(flattened) == 1 and looked_up == []
    torch.testing.assert_close(vsf.device_get(p["w7"]), torch.full((4,), 8.0))
    torch.testing.assert_close(vsf.device_get(total), torch.tensor(8.0))


def test_a_plan_switch_changed_between_calls_plans_again_with_its_value(sim, monkeypatch):
    # two partial sums of 4 x 4 fp32 (64 B each), reduced at the end: one bucket of both at the
    # default cap, each alone at a cap of 64 B; the switch is part of the cache key
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    split = lambda t, d: vsf.device_put(t, vsf.NamedSharding(mesh, P(*[None] * d, "dp")))  # noqa: E731
    x1, x2, w1, w2 = (
        split(torch.randn(4, 6), 1),
        split(torch.randn(4, 6), 1),
        split(torch.randn(6, 4), 0),
        split(torch.randn(6, 4), 0),
    )
    jf = vsf.jit(lambda a, b, c, d: (a @ c, b @ d), out_shardings=vsf.NamedSharding(mesh, P()))
    members = lambda: [len(b.members) for b in jf.lower(x1, x2, w1, w2).plan.buckets]  # noqa: E731
    assert members() == [2] and jf.plan_count == 1
    monkeypatch.setattr(vsf.config, "bucket_bytes", 64)
    assert members() == [] and jf.plan_count == 2
    assert jf.replans[-1] == f"options changed: vsf.config.bucket_bytes {4 * 2**20} -> 64"
    out = jf(x1, x2, w1, w2)
    torch.testing.assert_close(vsf.device_get(out[0]), vsf.device_get(x1) @ vsf.device_get(w1))
    assert jf.plan_count == 2
    monkeypatch.setattr(vsf.config, "bucket_bytes", 4 * 2**20)
    assert members() == [2] and jf.plan_count == 2  # the first plan, from the cache
    monkeypatch.setattr(vsf.config, "context_parallel", "rings")
    with pytest.raises(
        ValueError, match=r"vsf.config.context_parallel must be one of \('auto', 'all_gather', 'ring'\), got 'rings'"
    ):
        jf(x1, x2, w1, w2)


def test_python_numbers_are_traced_not_static(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    jf = vsf.jit(lambda x, lr: x * lr)
    x = vsf.device_put(torch.arange(4.0), vsf.NamedSharding(mesh, P("dp")))
    for lr in (0.5, 0.25, 2.0):
        torch.testing.assert_close(vsf.device_get(jf(x, lr)), torch.arange(4.0) * lr)
    assert jf.plan_count == 1


# -- shardings given by the user -----------------------------------------------------------------


def test_in_and_out_shardings(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    x = torch.randn(8, 6)
    f = vsf.jit(
        lambda a: a * 2 + 1,
        in_shardings=vsf.NamedSharding(mesh, P("dp")),
        out_shardings=vsf.NamedSharding(mesh, P(None, "tp")),
    )
    out = f(x)
    assert vsf.typeof(out) == "f32[8,6@tp]"
    torch.testing.assert_close(vsf.device_get(out), x * 2 + 1)


def test_committed_input_with_other_sharding_is_resharded_with_warning_or_refused(sim, caplog, monkeypatch):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.randn(4, 4), vsf.NamedSharding(mesh, P(None, "dp")))
    f = vsf.jit(lambda a: a + 1, in_shardings=vsf.NamedSharding(mesh, P("dp")))
    with caplog.at_level(logging.WARNING, logger="vsf.jit"):
        out = f(x)
    assert any("resharding" in r.message for r in caplog.records)
    torch.testing.assert_close(vsf.device_get(out), vsf.device_get(x) + 1)
    monkeypatch.setattr(vsf.config, "strict", True)
    with pytest.raises(ValueError, match="strict"):
        f(x)


def test_with_sharding_constraint_pins_an_intermediate(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    w1 = vsf.device_put(torch.randn(8, 16), vsf.NamedSharding(mesh, P(None, "tp")))
    x = vsf.device_put(torch.randn(4, 8), vsf.NamedSharding(mesh, P()))

    def f(x, w1, pin):
        h = x @ w1
        if pin:
            h = vsf.with_sharding_constraint(h, P())
        return h.sum(0)

    with vsf.use_mesh(mesh):
        free = vsf.jit(f, static_argnums=2).lower(x, w1, False).cost()
        pinned_fn = vsf.jit(f, static_argnums=2)
        pinned = pinned_fn.lower(x, w1, True).cost()
        out = pinned_fn(x, w1, True)
    assert free.count("all_gather") == 0 and pinned.count("all_gather", "tp") == 1
    torch.testing.assert_close(vsf.device_get(out), (vsf.device_get(x) @ vsf.device_get(w1)).sum(0))


def test_a_constant_of_a_program_on_part_of_the_ranks_is_on_every_simulated_rank(sim):
    """A tensor the function closes over (a module buffer, such as Llama's rotary frequencies) is a
    constant of its program; under vsf.simulate every simulated rank runs every op, a program on
    a sub-mesh (a pipeline stage's) too, so the constant must be there on each: made for the
    sub-mesh's ranks alone, the first op that read it failed."""
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("pp", "dp"))
    freqs = torch.tensor([1.0, 0.1, 0.01])
    x = torch.randn(4, 3)
    xs = vsf.device_put(x, vsf.NamedSharding(mesh.at("pp", 1), P("dp")))
    out = vsf.jit(lambda x: torch.sin(x * freqs))(xs)
    torch.testing.assert_close(vsf.device_get(out), torch.sin(x * freqs))


def test_plan_text_lists_ops_shardings_and_collectives(sim):
    lowered, _, _ = megatron_mlp(sim, input_grad=False)
    text = lowered.as_text()
    assert "all_reduce over tp" in text
    assert "args[0]['w1']" in text and "f32[16,64@tp]" in text
    assert "mm(" in text and "cost per rank" in text


# -- donation -------------------------------------------------------------------------------------


def test_donated_arguments_are_released_and_refused_afterwards(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    f = vsf.jit(lambda p: vsf.tree.map(lambda t: t + 1, p), donate_argnums=0)
    p = vsf.device_put({"b": torch.zeros(2), "w": torch.zeros(4)}, vsf.NamedSharding(mesh, P("dp")))
    new = f(p)
    torch.testing.assert_close(vsf.device_get(new["w"]), torch.ones(4))
    with pytest.raises(RuntimeError, match=r"donated to .*args\[0\]\['b'\]"):
        f(p)
    with pytest.raises(RuntimeError, match=r"donated to .*args\[0\]\['w'\]"):
        p["w"] + 1
    newer = f(new)  # a later call's leaves get the program's stand-ins, made on the first call
    torch.testing.assert_close(vsf.device_get(newer["b"]), torch.full((2,), 2.0))
    with pytest.raises(RuntimeError, match=r"donated to .*args\[0\]\['w'\]"):
        new["w"] * 2
    with pytest.raises(RuntimeError, match=r"donated to .*args\[0\]\['b'\]"):
        f(new)


def test_a_donated_argument_after_a_static_one_is_named_by_its_position(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    f = vsf.jit(lambda scale, p: vsf.tree.map(lambda t: t * scale, p), static_argnums=0, donate_argnums=1)
    p = vsf.device_put({"b": torch.ones(2), "w": torch.ones(4)}, vsf.NamedSharding(mesh, P("dp")))
    new = f(3.0, p)
    for _ in range(2):  # the first call makes the stand-ins, later calls reuse them
        with pytest.raises(RuntimeError, match=r"donated to .*args\[1\]\['w'\]"):
            p["w"] + 1
        p, new = new, f(3.0, new)
    torch.testing.assert_close(vsf.device_get(new["b"]), torch.full((2,), 27.0))


def test_a_call_names_no_argument_unless_a_message_needs_one(sim, monkeypatch):
    """Naming a leaf walks the whole argument tree; doing it for every leaf of every call made
    each call quadratic in the number of leaves (a 207-leaf GPT train step spent most of its
    time there). A call whose inputs are all DTensors names none."""
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    f = vsf.jit(lambda p: vsf.tree.map(lambda t: t * 2, p))
    p = vsf.device_put({f"w{i}": torch.ones(4) for i in range(50)}, vsf.NamedSharding(mesh, P("dp")))
    f(p)
    from vsf.jit import call

    named = []
    arg_name = call.arg_name
    monkeypatch.setattr(call, "arg_name", lambda path: named.append(path) or arg_name(path))
    torch.testing.assert_close(vsf.device_get(f(p)["w7"]), torch.full((4,), 2.0))
    assert named == []


def _reused(fn, *args):
    """``fn`` traced and rewritten by the lowering's buffer-reuse pass with every input donated:
    (its results on clones of ``args``, which clones its result buffers took over, the in-place ops)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from vsf.jit.donation import _reuse

    gm = make_fx(fn)(*args)
    _reuse(gm, {n for n in gm.graph.nodes if n.op == "placeholder"})
    gm.recompile()
    mine = [a.clone() for a in args]
    ptrs = [a.data_ptr() for a in mine]
    outs = gm(*mine)
    taken = [ptrs.index(o.data_ptr()) if o.data_ptr() in ptrs else None for o in outs]
    return (
        outs,
        taken,
        [
            str(n.target)
            for n in gm.graph.nodes
            if n.op == "call_function"
            and getattr(n.target, "_schema", None) is not None
            and n.target._schema.is_mutable
        ],
    )


def test_donated_buffer_takes_a_result_at_its_last_use():
    # p is read by the decay term first; p + u is its last use, so the new param goes into p's buffer
    def step(p, m, g):
        m = m.lerp(g, 0.1)
        u = m * -0.01 + p * -0.001
        return p + u, m

    p, m, g = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    outs, taken, inplace = _reused(step, p, m, g)
    for got, want in zip(outs, step(p, m, g)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert taken == [0, 1]
    assert "aten.add_.Tensor" in inplace and "aten.lerp_.Scalar" in inplace


@pytest.mark.parametrize("moment_read_later", [False, True])
def test_donated_moments_take_the_fused_adam_step_in_place(moment_read_later):
    # vsf::adam_step overwrites both moments in its in-place twin: only when both are free to take
    count, lr, decay = (
        torch.tensor(3.0),
        torch.tensor(1e-2, dtype=torch.float64),
        torch.tensor(-1e-3, dtype=torch.float64),
    )

    def step(g, m, v, p):
        u, m2, v2 = torch.ops.vsf.adam_step(g, m, v, p, count, lr, decay, 0.9, 0.999, 1e-8)
        return (p + u, m2, v2, m * 2) if moment_read_later else (p + u, m2, v2)

    g, m, v, p = torch.randn(8, 4), torch.randn(8, 4), torch.rand(8, 4), torch.randn(8, 4)
    outs, taken, inplace = _reused(step, g, m, v, p)
    for got, want in zip(outs, step(g, m, v, p)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (taken[1:3], "vsf.adam_step_.default" in inplace) == (
        ([None, None], False) if moment_read_later else ([1, 2], True)
    )
    assert taken[0] == 3  # the op only read p (for the decay): p + u still takes p's buffer


def test_donated_buffer_takes_a_result_after_its_split_views_are_read():
    # a local slice of a replicated param (ZeRO's decay term) is a split view of it; once that has
    # been read, p + u may still overwrite p
    def step(p, u):
        decay = p.split(2)[1] * 0.5
        return p + u, decay

    p, u = torch.randn(4, 4), torch.randn(4, 4)
    outs, taken, _ = _reused(step, p, u)
    for got, want in zip(outs, step(p, u)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert taken[0] == 0


@pytest.mark.parametrize("case", ["view_read_later", "view_read_by_the_op", "split_view_read_later"])
def test_donated_buffer_is_not_overwritten_while_a_view_of_it_is_read(case):
    def view_read_later(p):
        t = p.t()
        return p + 1, t * 2  # t is read after p + 1: p + 1 may not overwrite p

    def view_read_by_the_op(p):
        return [p + p.t()]  # an in-place add would read the transposed p while writing it

    def split_view_read_later(p):
        half = p.split(2)[1]
        return p + 1, half * 2

    fn = {
        "view_read_later": view_read_later,
        "view_read_by_the_op": view_read_by_the_op,
        "split_view_read_later": split_view_read_later,
    }[case]
    p = torch.randn(4, 4)
    outs, taken, _ = _reused(fn, p)
    for got, want in zip(outs, fn(p)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert taken[0] is None


# -- bad input ------------------------------------------------------------------------------------


def test_in_shardings_not_a_prefix_names_the_path(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    f = vsf.jit(lambda p: p["a"] + 1, in_shardings=({"b": vsf.NamedSharding(mesh, P())},))
    with pytest.raises(ValueError, match=r"in_shardings is not a prefix .* at \[0\]"):
        f({"a": torch.ones(2)})


def test_sharding_on_another_mesh_is_refused(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    other = vsf.make_mesh((4,), ("x",))
    x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P("dp")))
    with vsf.use_mesh(other), pytest.raises(ValueError, match="current mesh"):
        vsf.jit(lambda a: a + 1)(x)


def test_inputs_on_two_meshes_are_refused_naming_each(sim):
    sim(4)
    a = vsf.device_put(torch.ones(4), vsf.NamedSharding(vsf.make_mesh((2, 2), ("dp", "tp")), P("dp")))
    b = vsf.device_put(torch.ones(4), vsf.NamedSharding(vsf.make_mesh((4,), ("x",)), P("x")))
    with pytest.raises(ValueError, match=r"live on different meshes: args\[0\] is on .*; args\[1\] is on "):
        vsf.jit(lambda a, b: a + b)(a, b)


def test_out_sharding_that_cannot_hold_is_refused(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P("dp")))
    f = vsf.jit(lambda a: a.sum(), out_shardings=vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(ValueError, match=r"output .*rank 0"):
        f(x)


def test_constraint_with_unknown_axis_is_refused(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4, 2), vsf.NamedSharding(mesh, P("dp")))

    def f(a):
        return vsf.with_sharding_constraint(a * 2, vsf.NamedSharding(mesh, P("tp")))

    with pytest.raises(ValueError, match="'tp'"):
        vsf.jit(f)(x)


def test_data_dependent_control_flow_is_a_clear_error(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P("dp")))

    def f(a):
        if a.sum() > 0:
            return a
        return -a

    with pytest.raises(ValueError, match=r'test_jit\.py", line \d+, in f: `if a.sum\(\) > 0:`: .*data-dependent'):
        vsf.jit(f)(x)


class _RoutedByMask(torch.nn.Module):
    """Each token through the expert its mask picks, by ``torch.where`` of the mask alone (litgpt's
    ``LLaMAMoE`` routes so): the tokens' indices, as many as the mask holds."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            (rows,) = torch.where(x[:, 0].floor().remainder(2) == i)
            y[rows] += expert(x[rows])
        return y


def test_a_shape_read_off_tensor_values_is_a_clear_error(sim):
    """An op whose output's shape depends on its input's values (``torch.where`` of a mask alone,
    ``nonzero``) cannot be planned ahead: a ``TraceError`` naming the line, in a plain step and in a
    module's block (before: fake tensors' ``DynamicOutputShapeException`` from inside the trace)."""
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4, 4), vsf.NamedSharding(mesh, P("dp")))

    def f(a):
        return a[a > 0].sum()

    with pytest.raises(
        TraceError, match=r'test_jit\.py", line \d+, in f: `return a\[a > 0\]\.sum\(\)` \(aten\.nonzero'
    ):
        vsf.jit(f)(x)
    model = _RoutedByMask()
    params = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, P()))
    with pytest.raises(TraceError, match=r"in forward: `\(rows,\) = torch\.where\(.*\)` \(aten\.nonzero.*fixed"):
        vsf.jit(lambda p, a: vsf.tree.apply(model, p, a).sum())(params, x)


# a write to the step's input: its values, or its shape (before: a PlanError for as_strided_, the
# decomposition of t_ and unsqueeze_, which has no DTensor strategy)
INPUT_WRITES = {"add_": lambda a: a.add_(1), "t_": lambda a: a.t_(), "unsqueeze_": lambda a: a.unsqueeze_(0)}


@pytest.mark.parametrize("write", list(INPUT_WRITES))
def test_input_mutation_is_refused(sim, write):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4, 2), vsf.NamedSharding(mesh, P("dp")))

    def f(a):
        INPUT_WRITES[write](a)
        return a * 2

    with pytest.raises(ValueError, match=r"mutates its input tensor #0 in place"):
        vsf.jit(f)(x)
    assert x.shape == (4, 2) and (vsf.device_get(x) == 1).all()


# a collective the step calls itself, on each rank's shard of a value the step computes whole (before:
# a KeyError deep in the planner for torch.distributed.all_reduce, a PlanError offering sharding rules
# for the functional one)
OWN_COLLECTIVES = {
    "dist.all_reduce": lambda y: (torch.distributed.all_reduce(y), y)[1],
    "functional all_reduce": lambda y: torch.distributed._functional_collectives.all_reduce(
        y, "sum", torch.distributed.group.WORLD
    ),
}


@pytest.mark.parametrize("collective", list(OWN_COLLECTIVES))
def test_a_collective_the_step_calls_itself_is_refused_naming_its_line(sim, collective):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.arange(8.0), vsf.NamedSharding(mesh, P("dp")))

    def f(a):
        return OWN_COLLECTIVES[collective](a * 2).sum()

    with pytest.raises(
        vsf.TraceError,
        match=r"f calls a torch.distributed collective \((c10d|_c10d_functional)\.\w+.* in (f|<lambda>): ",
    ):
        vsf.jit(f)(x)


# -- on 4 real gloo processes ------------------------------------------------------------------
# vsf.jit on 4 real gloo processes (tier 3): each rank runs the traced program over its local shards.


@pytest.fixture(scope="module")
def ranks(world):
    return world("jit_step.py")


@pytest.mark.world("jit_step.py")
@pytest.mark.multiprocess
def test_traced_step_matches_unsharded_on_every_rank(ranks):
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-5, atol=0)
        assert r["max_param_err"] < 1e-5
        assert r["plan_count"] == 1


@pytest.mark.world("jit_step.py")
@pytest.mark.multiprocess
def test_traced_program_runs_the_planned_collectives(ranks):
    for r in ranks:
        assert r["traced_ops"] > 0
        assert r["collectives_in_program"] == r["planned_collectives"]


@pytest.mark.world("jit_step.py")
@pytest.mark.multiprocess
def test_donated_state_buffers_are_updated_in_place(ranks):
    # the optimizer state and the params are donated: the traced program writes every new leaf
    # (the count, the moments, each param after its last read) into the buffer of the leaf it replaces
    for r in ranks:
        assert r["state_buffers_reused"] == [r["state_leaves"]] * 3
        assert r["param_buffers_reused"] == [r["param_leaves"]] * 3


@pytest.mark.world("jit_step.py")
@pytest.mark.multiprocess
def test_a_manual_region_runs_on_real_processes(ranks):
    # the Megatron MLP in a shard_map region of a jitted SGD step, and a ppermute ring's value and
    # gradient, equal the unsharded math; the program runs every planned collective, the region's too
    for r in ranks:
        assert r["region_max_param_err"] < 1e-5
        assert r["ring_loss_err"] < 1e-4 and r["ring_grad_err"] < 1e-5
        assert r["region_collectives_in_program"] == r["region_planned_collectives"]


@pytest.mark.world("jit_step.py")
@pytest.mark.multiprocess
def test_a_partial_manual_region_and_a_ragged_all_to_all_run_on_real_processes(ranks):
    # manual over tp, dp left to the planner: the same SGD steps as unsharded; a balanced
    # all_to_all_v's value and gradient equal the rows it moves, by hand; each program runs the
    # collectives its plan lists
    for r in ranks:
        assert r["partial_max_param_err"] < 1e-5
        assert r["partial_collectives_in_program"] == r["partial_planned_collectives"]
        assert r["dispatch_loss_err"] < 1e-4 and r["dispatch_grad_err"] < 1e-6
        assert r["dispatch_collectives_in_program"] == r["dispatch_planned_collectives"]


@pytest.mark.world("jit_step.py")
@pytest.mark.multiprocess
def test_a_constant_the_function_closes_over_runs_on_real_processes(ranks):
    # the traced program keeps it as a constant (tracing the local program met it as a real
    # tensor among fake ones and stopped); value and gradient equal the unsharded math
    for r in ranks:
        assert r["constant_err"] < 1e-5 and r["constant_grad_err"] < 1e-6


def test_step_input_names_the_input_a_traced_tensor_is_and_its_sharding(sim):
    """While a step's code is traced, ``vsf.jit.trace.step_input`` finds the input behind a tensor
    (itself, detached, cast) with its name and sharding; a computed value has none."""
    from vsf.jit.trace import step_input

    seen = {}

    def f(p, x):
        w = vsf.grad(lambda w: (w * 2).sum())(p["w"])  # (a detached copy is what grad differentiates)
        seen.update(
            w=step_input(p["w"]),
            cast=step_input(p["w"].detach().to(torch.bfloat16)),
            x=step_input(x),
            computed=step_input(x + 1),
        )
        return w + x

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = {"w": vsf.device_put(torch.ones(4, 2), vsf.NamedSharding(mesh, P("dp")))}
    vsf.jit(f).lower(p, vsf.device_put(torch.ones(4, 2), vsf.NamedSharding(mesh, P())))
    assert (seen["w"].name, seen["w"].sharding.spec) == ("args[0]['w']", P("dp"))
    assert seen["cast"] == seen["w"]
    assert (seen["x"].name, seen["x"].sharding.spec) == ("args[1]", P())
    assert seen["computed"] is None
    assert step_input(torch.ones(1)) is None  # outside a trace


# A write into a tensor the step closes over (its op, the user's line): directly, run for real while
# tracing, and through a view, traced on a fake of the tensor (before: an internal assert of torch's
# functionalization for setitem, out= and a view written from traced values; a view written from
# constants was written by the program once a call, as torch in one process writes it).
CLOSED_OVER_WRITES = {
    "add_": ("aten.add_.Tensor", "buf.add_(1.0)"),
    "copy_": ("aten.copy_.default", "buf.copy_(torch.ones(3))"),
    "setitem": ("aten.copy_.default", "buf[1] = 5.0"),
    "slice_add_": ("aten.add_.Tensor", "buf[:2].add_(1.0)"),
    "unbind_add_": ("aten.add_.Tensor", "buf.unbind(0)[2].add_(1.0)"),
    "slice_add_traced": ("aten.add_.Tensor", "buf[:2].add_(x[:2])"),
    "out_view": ("aten.add.out", "torch.add(x[:1], 1.0, out=buf[:1])"),
}


def writing_step(write, buf):
    """A step that writes ``buf``, which it closes over, as ``CLOSED_OVER_WRITES[write]`` says."""

    def step(x):
        if write == "add_":
            buf.add_(1.0)
        elif write == "copy_":
            buf.copy_(torch.ones(3))
        elif write == "setitem":
            buf[1] = 5.0
        elif write == "slice_add_":
            buf[:2].add_(1.0)
        elif write == "unbind_add_":
            buf.unbind(0)[2].add_(1.0)
        elif write == "slice_add_traced":
            buf[:2].add_(x[:2])
        else:
            torch.add(x[:1], 1.0, out=buf[:1])
        return x * 2

    return step


def assert_refused_write(message, write):
    """``message`` is the TraceError of :func:`writing_step`'s ``write``: its op, the user's line."""
    op, line = CLOSED_OVER_WRITES[write]
    assert re.fullmatch(
        r"writing_step\.<locals>\.step writes a tensor it does not take as an argument at "
        rf"File \".*test_jit\.py\", line \d+, in step: `{re.escape(line)}` \({re.escape(op)} into its argument '(self|out)', .*",
        message,
    ), message


@pytest.mark.parametrize("write", list(CLOSED_OVER_WRITES))
def test_a_step_writing_a_tensor_it_closes_over_is_refused_before_the_write(sim, write):
    """A tensor the step does not take as an argument (a global, a module buffer it reads from the
    module) written in place, itself or through a view, would be written by vsf.jit itself, and the
    step's result would depend on the calls before (the first call added 3 where one process adds
    1): a TraceError naming the op and the user's line, and the tensor is left as it was."""
    buf = torch.arange(3.0)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(vsf.TraceError) as e:
        vsf.jit(writing_step(write, buf))(x)
    assert_refused_write(str(e.value), write)
    assert buf.tolist() == [0.0, 1.0, 2.0]


EAGER_WRITES = """
import json, sys
sys.path[:0] = sys.argv[1:]
import torch, vsf
from test_jit import CLOSED_OVER_WRITES, writing_step
x = vsf.device_put(torch.ones(4), vsf.NamedSharding(vsf.make_mesh((1,), ("dp",)), vsf.P("dp")))
found = {}
for write in CLOSED_OVER_WRITES:
    buf = torch.arange(3.0)
    try:
        vsf.jit(writing_step(write, buf))(x)
        found[write] = [None, buf.tolist()]
    except vsf.TraceError as e:
        found[write] = [str(e), buf.tolist()]
print(json.dumps(found))
"""


def test_a_step_writing_a_tensor_it_closes_over_is_refused_in_one_real_process():
    """The same writes, with no simulation: a plain process's one-rank mesh (its own gloo group,
    so a process of its own)."""
    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", EAGER_WRITES, here, os.path.dirname(here)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
        check=True,
    )
    found = json.loads(out.stdout.splitlines()[-1])
    assert list(found) == list(CLOSED_OVER_WRITES)
    for write, (message, buf) in found.items():
        assert message is not None, f"{write}: no error, the tensor became {buf}"
        assert_refused_write(message, write)
        assert buf == [0.0, 1.0, 2.0], write


# A write into a new tensor computed from closed-over tensors alone (no argument of the step reaches
# it): the step's own value, written as torch in one process writes it (before: torch's
# functionalization asserted, "mutating a non-functional tensor with a functional tensor").
FRESH_WRITES = {
    "setitem": lambda buf, x: _set(buf + 0, 1, 4.0),
    "add_": lambda buf, x: (buf * 2).add_(1.0),
    "slice_add_": lambda buf, x: _sliced_add(buf.clone(), x),
    "index_put_": lambda buf, x: (buf - 1).index_put_((torch.tensor([0, 2]),), torch.tensor(7.0)),
}


def _set(t, i, v):
    t[i] = v
    return t


def _sliced_add(t, x):
    t[:2].add_(x[:2])
    return t


@pytest.mark.parametrize("write", list(FRESH_WRITES))
def test_a_step_writing_a_tensor_it_made_from_closed_over_ones_equals_torch(sim, write):
    """The written tensor is the step's own: the result equals the same step run by torch, and the
    closed-over tensor is left as it was (twice called, so a write carried from one call to the next
    would show)."""
    buf = torch.arange(4.0)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = torch.arange(8.0).reshape(2, 4)

    def step(x):
        return x * FRESH_WRITES[write](buf, x[0])

    jitted = vsf.jit(step)
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    for _ in range(2):
        torch.testing.assert_close(vsf.device_get(jitted(xs)), step(x))
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
