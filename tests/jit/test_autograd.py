"""A ``vsf.jit``-ted function differentiated by torch autograd (``loss.backward()``, ``torch.optim``),
on simulated ranks and on 2 real gloo processes (tier 3, ``multiprocess``). The oracle everywhere:
the same function run by plain torch autograd on one device, unsharded."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate
from toy_models import Block, GPTConfig

import vsf
from vsf import P
from vsf.jit import Compiled, report

CFG = GPTConfig(dim=16, heads=2, seq=8)
MEGATRON = {
    "attn.qkv.weight": P("tp"),
    "attn.qkv.bias": P("tp"),
    "attn.proj.weight": P(None, "tp"),
    "fc1.weight": P("tp"),
    "fc1.bias": P("tp"),
    "fc2.weight": P(None, "tp"),
}


def block_case():
    block = Block(CFG)
    return block, vsf.tree.from_module(block), torch.randn(4, CFG.seq, CFG.dim)


def two_calls_case():
    """The block's params, its function, two inputs, and plain torch's gradients on one device of
    both calls' summed outputs: the params' (summed over the calls) and each input's."""
    block, params, x = block_case()
    fn = lambda p, x: vsf.tree.apply(block, p, x)  # noqa: E731
    xs = (x, torch.randn_like(x))
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref_xs = [v.clone().requires_grad_(True) for v in xs]
    (fn(ref, ref_xs[0]).sum() + fn(ref, ref_xs[1]).sum()).backward()
    return params, fn, xs, {k: v.grad for k, v in ref.items()}, [v.grad for v in ref_xs]


def fsdp_specs(params):
    return {k: P("fsdp") if v.ndim == 2 else P() for k, v in params.items()}


def megatron_specs(params):
    return {k: MEGATRON.get(k, P()) for k in params}


def eager_grads(fn, params, *inputs):
    """``fn(params, *inputs).sum().backward()`` by plain torch on one device: the gradients of params and inputs."""
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    xs = [x.clone().requires_grad_(True) for x in inputs]
    fn(p, *xs).sum().backward()
    return {k: v.grad for k, v in p.items()}, [x.grad for x in xs]


def sharded_params(mesh, params, specs):
    return vsf.tree.map(lambda t: t.requires_grad_(True), vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)))


def assert_grads(params, want):
    for k, w in want.items():
        assert params[k].grad is not None, k
        assert params[k].grad.placements == params[k].placements, (k, params[k].grad.placements, params[k].placements)
        torch.testing.assert_close(vsf.device_get(params[k].grad), w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("layout", ["megatron", "fsdp"])
def test_block_backward_equals_one_device(sim, layout):
    block, params, x = block_case()
    fn = lambda p, x: vsf.tree.apply(block, p, x)  # noqa: E731
    want_p, (want_x,) = eager_grads(fn, params, x)
    sim(4)
    axes = ("dp", "tp") if layout == "megatron" else ("dp", "fsdp")
    mesh = vsf.make_mesh((2, 2), axes)
    specs = megatron_specs(params) if layout == "megatron" else fsdp_specs(params)
    p = sharded_params(mesh, params, specs)
    xs = vsf.device_put(
        x, vsf.NamedSharding(mesh, P("dp") if layout == "megatron" else P(("dp", "fsdp")))
    ).requires_grad_(True)
    out = vsf.jit(fn)(p, xs)
    assert out.requires_grad
    out.sum().backward()
    assert_grads(p, want_p)
    assert xs.grad.placements == xs.placements
    torch.testing.assert_close(vsf.device_get(xs.grad), want_x, rtol=1e-5, atol=1e-6)


def test_plain_activation_leaf_and_non_leaf(sim):
    block, params, x = block_case()
    fn = lambda p, x: vsf.tree.apply(block, p, x) * 2  # noqa: E731
    want_p, (want_x,) = eager_grads(lambda p, x: fn(p, x * 3), params, x)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = sharded_params(mesh, params, megatron_specs(params))
    leaf = x.clone().requires_grad_(True)
    out = vsf.jit(fn)(p, leaf * 3)  # a plain non-leaf activation
    out.sum().backward()
    assert_grads(p, want_p)
    assert not isinstance(leaf.grad, torch.distributed.tensor.DTensor)
    torch.testing.assert_close(leaf.grad, want_x, rtol=1e-5, atol=1e-6)


def test_a_shard_that_requires_grad_runs_without_warnings_and_gets_its_gradient(sim):
    """An activation made by ``DTensor.from_local`` of a shard that requires grad (as a pipeline
    stage's input is): the shard reaches an op that runs through DTensor (a sum over the split
    dim), wrapped without autograd (the program's backward is its own), and torch warns nothing
    (before: "it's recommended to use local_tensor.detach()" at every call); the gradient reaching
    the shard is plain torch's on one device."""
    x = torch.randn(6, 8)
    fn = lambda x: x.sum(0).square().sum()  # noqa: E731
    leaf = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(fn(leaf), leaf)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    placed = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    shard = placed.to_local().clone().requires_grad_(True)
    as_dtensor = lambda local: DTensor.from_local(local, mesh.device_mesh, placed.placements, run_check=False)  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        vsf.jit(fn)(as_dtensor(shard)).backward()
    assert [str(w.message) for w in seen] == []
    torch.testing.assert_close(vsf.device_get(as_dtensor(shard.grad)), want)


def mlp(p, x):
    return F.gelu(x @ p["w1"]) @ p["w2"]


def mlp_params():
    return {"w1": torch.randn(8, 16) / 3, "w2": torch.randn(16, 8) / 3}


@pytest.mark.parametrize(
    "make_opt",
    [lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)],
    ids=["sgd", "adamw"],
)
def test_two_jitted_functions_in_a_torch_training_loop(sim, make_opt):
    a, b = mlp_params(), mlp_params()
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def loop(pa, pb, first, second, put_x):
        opt = make_opt(list(pa.values()) + list(pb.values()))
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = ((second(pb, first(pa, put_x(x))) - put_x(y)) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(vsf.device_get(loss) if isinstance(loss, torch.distributed.tensor.DTensor) else loss.detach())
        return losses

    ref_a, ref_b = ({k: v.clone().requires_grad_(True) for k, v in t.items()} for t in (a, b))
    want = loop(ref_a, ref_b, mlp, mlp, lambda t: t)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    pa = sharded_params(mesh, a, {"w1": P(None, "tp"), "w2": P("tp")})
    pb = sharded_params(mesh, b, {"w1": P("tp"), "w2": P()})
    got = loop(pa, pb, vsf.jit(mlp), vsf.jit(mlp), lambda t: vsf.device_put(t, vsf.NamedSharding(mesh, P("dp"))))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    for got_p, want_p in ((pa, ref_a), (pb, ref_b)):
        for k in got_p:
            torch.testing.assert_close(vsf.device_get(got_p[k].detach()), want_p[k].detach(), rtol=1e-5, atol=1e-6)


def test_accumulation_retain_graph_and_outputs_without_grad(sim):
    params, x1, x2 = mlp_params(), torch.randn(8, 8), torch.randn(8, 8)

    def fn(p, x):
        h = mlp(p, x)
        return h, h.argmax(-1), x.sum(), 3  # an integer output, one that needs no grad, a Python number

    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    h1, h2 = fn(ref, x1)[0], fn(ref, x2)[0]
    ((h1**2).sum() + h2.sum()).backward(retain_graph=True)
    h1.sum().backward()
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    p = sharded_params(mesh, params, {"w1": P(None, "tp"), "w2": P("tp")})
    g = vsf.jit(fn)
    (o1, idx, s, three), (o2, *_) = g(p, x1), g(p, x2)
    assert not idx.requires_grad and not s.requires_grad and three == 3 and not idx.is_floating_point()
    ((o1**2).sum() + o2.sum()).backward(retain_graph=True)  # two calls accumulate before one backward
    o1.sum().backward()  # the same output used again
    assert_grads(p, {k: v.grad for k, v in ref.items()})
    assert g.plan_count == 1


def test_unreduced_gradients_accumulate_over_calls_and_reduce_once(sim):
    # DDP's no_sync: with the batch over dp, a replicated param's gradient comes back a partial sum
    # over dp (no all-reduce in the backward), torch sums two calls' into .grad, and reducing it
    # once gives the one-device gradient of both calls; the activation's gradient is reduced as usual
    params, fn, inputs, want, (want_x, _) = two_calls_case()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = sharded_params(mesh, params, megatron_specs(params))
    g = vsf.jit(fn, unreduced_grad_argnums=(0,))
    xs = [vsf.device_put(v, vsf.NamedSharding(mesh, P("dp"))).requires_grad_(True) for v in inputs]
    for v in xs:
        g(p, v).sum().backward()
    lowered = g.lower(p, xs[0])
    assert lowered.cost().comm_bytes["dp"] == 0 < vsf.jit(fn).lower(p, xs[0]).cost().comm_bytes["dp"]
    shown = lowered.grad_shardings[0][0]
    for k, w in p.items():
        dp_, tp_ = w.grad.placements
        assert dp_ == Partial() and (tp_ == w.placements[1] or (w.placements[1] == Replicate() and tp_ == Partial())), (
            k,
            w.grad.placements,
        )
        assert vsf.sharding.named.sharding_of(w.grad) == shown[k] and "dp" in shown[k].spec.unreduced, k
        torch.testing.assert_close(
            vsf.device_get(w.grad.redistribute(placements=w.placements)),
            want[k],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, k=k: f"{k}: {m}",
        )
    assert xs[0].grad.placements == xs[0].placements and lowered.grad_shardings[0][1] == vsf.NamedSharding(
        mesh, P("dp")
    )
    torch.testing.assert_close(vsf.device_get(xs[0].grad), want_x, rtol=1e-5, atol=1e-6)
    assert g.plan_count == 1


def test_unsharded_gradients_accumulate_whole_over_calls_and_reduce_scatter_once(sim):
    # FSDP2's set_requires_gradient_sync(False): with params and the batch over fsdp, each param's
    # gradient comes back whole and a partial sum over fsdp (no reduce-scatter in the backward),
    # torch sums two calls' into .grad, and reduce-scattering it once gives the one-device gradient
    params, fn, inputs, want, _ = two_calls_case()
    sim(2)
    mesh = vsf.make_mesh((2,), ("fsdp",))
    specs = {k: P("fsdp") if v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    p = sharded_params(mesh, params, specs)
    g = vsf.jit(fn, unreduced_grad_argnums=(0,), unsharded_grad_axes=("fsdp",))
    xs = [vsf.device_put(v, vsf.NamedSharding(mesh, P("fsdp"))).requires_grad_(True) for v in inputs]
    for v in xs:
        g(p, v).sum().backward()
    assert not any(c.kind == "reduce_scatter" for c in g.lower(p, xs[0]).cost().collectives)
    assert any(
        c.kind == "reduce_scatter" for c in vsf.jit(fn, unreduced_grad_argnums=(0,)).lower(p, xs[0]).cost().collectives
    )
    for k, w in p.items():
        assert w.grad.placements == (Partial(),) and w.grad.to_local().shape == params[k].shape, (k, w.grad.placements)
        torch.testing.assert_close(
            vsf.device_get(w.grad.redistribute(placements=w.placements)),
            want[k],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, k=k: f"{k}: {m}",
        )
    assert g.plan_count == 1


@pytest.mark.parametrize("layout", ["megatron", "fsdp"])
def test_deferred_gradients_split_the_backward_into_its_input_and_weight_parts(sim, layout):
    # a zero-bubble schedule's split: backward computes the input's gradient only and hands over
    # the params' part, which adds theirs into .grad when it runs (two calls, run in reverse order:
    # their sum in another order than one device's, so to rounding, 1e-5)
    params, fn, inputs, want, want_xs = two_calls_case()
    sim(4)
    axes = ("dp", "tp") if layout == "megatron" else ("dp", "fsdp")
    mesh = vsf.make_mesh((2, 2), axes)
    p = sharded_params(mesh, params, megatron_specs(params) if layout == "megatron" else fsdp_specs(params))
    pending = []
    g = vsf.jit(fn, deferred_grad_argnums=(0,), on_deferred_grads=pending.append)
    xs = [vsf.device_put(v, vsf.NamedSharding(mesh, P("dp"))).requires_grad_(True) for v in inputs]
    for v, want_x in zip(xs, want_xs):
        g(p, v).sum().backward()
        torch.testing.assert_close(vsf.device_get(v.grad), want_x, rtol=1e-5, atol=1e-6)
    assert len(pending) == 2 and all(w.grad is None for w in p.values())
    for weights in reversed(pending):
        weights()
    for k, w in p.items():
        assert w.grad.placements == w.placements, k
        torch.testing.assert_close(
            vsf.device_get(w.grad), want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}"
        )
    # the parts: every op of the backward in exactly one; the weights' four matmuls (qkv, proj, fc1,
    # fc2) in the second, and with them the gradients' all-reduce over dp (the params are replicated there)
    compiled = next(iter(g._cache.values()))
    split, backward = compiled._program.split, compiled.parts.backward
    ops = lambda plan, name=None: sum(
        1 for n in plan.graph.graph.nodes if n.op == "call_function" and name in (None, str(n.target))
    )  # noqa: E731
    assert ops(split.inputs) + ops(split.weights) == ops(backward)
    assert (
        ops(split.weights, "aten.mm.default") == 4
        and ops(split.inputs, "aten.mm.default") == ops(backward, "aten.mm.default") - 4
    )
    bytes_dp = [report.cost(plan).comm_bytes["dp"] for plan in (backward, split.inputs, split.weights)]
    assert bytes_dp[0] > 0 and bytes_dp[1:] == [0, bytes_dp[0]]
    assert re.search(
        r"backward is cut in two \(deferred_grad_argnums\): the part run in backward has \d+ ops",
        g.lower(p, xs[0]).as_text(),
    )
    with pytest.raises(ValueError, match="needs on_deferred_grads"):
        vsf.jit(fn, deferred_grad_argnums=(0,))
    computed = {**p, "fc1.weight": p["fc1.weight"] * 1.0}
    with pytest.raises(
        ValueError,
        match=r"args\[0\]\['fc1\.weight'\] has its gradient deferred .* must be an autograd leaf .*grad_fn MulBackward0",
    ):
        g(computed, xs[0])


def test_a_loss_an_input_returned_as_is_and_a_view_of_a_param(sim):
    params, x = mlp_params(), torch.randn(8, 8)

    def fn(p, x, scale):
        return (mlp(p, x) ** 2).mean() * scale, x, p["w1"].t()

    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref_x = x.clone().requires_grad_(True)
    loss, same, view = fn(ref, ref_x, 3.0)
    (loss + same.sum() + view.sum()).backward()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = sharded_params(mesh, params, {"w1": P(None, "tp"), "w2": P("tp")})
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))).requires_grad_(True)
    g = vsf.jit(fn, static_argnums=(2,))
    loss, same, view = g(p, xs, 3.0)
    (loss + same.sum() + view.sum()).backward()
    assert_grads(p, {k: v.grad for k, v in ref.items()})
    torch.testing.assert_close(vsf.device_get(xs.grad), ref_x.grad, rtol=1e-5, atol=1e-6)
    grads = vsf.grad(lambda p: g(p, xs, 3.0)[0])(p)  # eager vsf.grad through a jitted function
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    fn(ref, x, 3.0)[0].backward()
    for k in grads:
        torch.testing.assert_close(vsf.device_get(grads[k]), ref[k].grad, rtol=1e-5, atol=1e-6)


def test_backward_program_does_not_rerun_the_forward(sim):
    params, x = mlp_params(), torch.randn(8, 8)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = sharded_params(mesh, params, {"w1": P(), "w2": P()})
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    parts = vsf.jit(mlp).lower(p, xs).compile().parts
    ops = lambda plan: [n for n in plan.graph.graph.nodes if n in plan.nodes]  # noqa: E731
    forward_names = {n.name for n in ops(parts.forward)}
    assert [n.target for n in ops(parts.forward) if "mm" in str(n.target)] == [torch.ops.aten.mm.default] * 2
    # the backward recomputes views only (a transpose of a saved value), nothing that computes
    assert forward_names.isdisjoint(n.name for n in ops(parts.backward) if not n.target.is_view)
    # the backward's matmuls are the vjp's: x^T g, g w2^T, h^T g (x's gradient is not asked for)
    assert sum("mm" in str(n.target) for n in ops(parts.backward)) == 3
    assert not any(n.target is torch.ops.aten.gelu.default for n in ops(parts.backward))
    assert any(s.value[0].target is torch.ops.aten.mm.default for s in parts.saved)  # gelu's input, saved


def test_cache_and_requires_grad_mask(sim):
    params, x = mlp_params(), torch.randn(8, 8)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = sharded_params(mesh, params, {"w1": P(), "w2": P()})
    g = vsf.jit(mlp)
    g(p, x).sum().backward()
    g(p, x).sum().backward()
    assert g.plan_count == 1
    with torch.no_grad():
        out = g(p, x)
        assert not out.requires_grad and type(g.lower(p, x).compile()) is Compiled  # no joint graph
    assert g.plan_count == 2
    g(p, x.requires_grad_(True)).sum().backward()
    assert g.plan_count == 3 and "differentiated by torch autograd changed" in g.replans[-1]


def test_lowered_text_and_cost_show_both_programs(sim):
    params, x = mlp_params(), torch.randn(8, 8)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = sharded_params(mesh, params, {"w1": P(), "w2": P()})
    lowered = vsf.jit(mlp).lower(p, vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))))
    text = lowered.as_text()
    assert "mlp (forward)" in text and "mlp (backward)" in text and "saved for the backward" in text
    assert "grad of args[0]['w1']" in text and "cotangent of" in text
    parts = lowered.compile().parts
    cost = lowered.cost()
    assert len(cost.collectives) == len(report.cost(parts.forward).collectives) + len(
        report.cost(parts.backward).collectives
    )
    assert cost.count("all_reduce", "dp") == 1  # the two weight gradients, one bucket


def test_higher_order_gradients_are_refused(sim):
    params, x = mlp_params(), torch.randn(8, 8)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = sharded_params(mesh, params, {"w1": P(), "w2": P()})
    out = vsf.jit(mlp)(p, x).sum()
    with pytest.raises(vsf.HigherOrderGradError, match="higher-order gradients through a jitted function"):
        torch.autograd.grad(out, [p["w1"]], create_graph=True)


def test_a_traced_step_is_not_differentiated_again(sim):
    params, x = mlp_params(), torch.randn(8, 8)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = sharded_params(mesh, params, {"w1": P(), "w2": P()})

    def step(p, x):
        loss, grads = vsf.value_and_grad(lambda p: mlp(p, x).sum())(p)
        return vsf.tree.map(lambda a, b: a - 0.1 * b, p, grads), loss

    new, loss = vsf.jit(step)(p, x)
    assert not loss.requires_grad and not new["w1"].requires_grad


def test_cotangents_in_other_layouts_or_missing(sim):
    """A cotangent arriving replicated or partial (not in the planned layout) is redistributed
    once; an output whose cotangent never arrives contributes nothing (as torch does)."""
    params, x, ct = mlp_params(), torch.randn(8, 8), torch.randn(8, 8)

    def fn(p, x):
        h = mlp(p, x)
        return h, (h * 2).sum(0)

    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    torch.autograd.backward([fn(ref, x)[0]], [ct])
    want = {k: 2 * v.grad for k, v in ref.items()}
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = sharded_params(mesh, params, {"w1": P(None, "tp"), "w2": P("tp")})
    g = vsf.jit(fn)
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    out, _ = g(p, xs)
    assert out.placements == xs.placements  # planned: it comes back like the argument it is shaped like
    replicated = vsf.device_put(ct, vsf.NamedSharding(mesh, P()))
    torch.autograd.backward([out], [replicated])
    out, _ = g(p, xs)
    partial = torch.distributed.tensor.DTensor.from_local(
        replicated.to_local() / 4, mesh.device_mesh, [torch.distributed.tensor.Partial()] * 2
    )
    torch.autograd.backward([out], [partial])
    assert_grads(p, want)
    assert g.plan_count == 1 and "redistributed once" in g.lower(p, xs).as_text()


def test_checking_mode_checks_both_programs(sim):
    params, x = mlp_params(), torch.randn(8, 8)
    want, _ = eager_grads(mlp, params, x)
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    p = sharded_params(mesh, params, {"w1": P(None, "tp"), "w2": P("tp")})
    vsf.jit(mlp).check(p, x.clone().requires_grad_(True)).sum().backward()
    assert_grads(p, want)


# -- on 2 real gloo processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(world):
    return world("jit_autograd.py", nproc=2)


@pytest.mark.world("jit_autograd.py", nproc=2)
@pytest.mark.multiprocess
def test_block_backward_on_gloo_equals_one_device(ranks):
    for got in ranks:
        assert got["max_grad_err"] <= 1e-5 * got["max_scale"], got
        assert got["x_grad_err"] <= 1e-5 * got["max_scale"], got
        assert got["grad_placements_match"] and got["plan_count"] == 1 and got["x_grad_plain"]
        assert got["traced_programs"] == [True, True]  # each program traced once into local ops and collectives


@pytest.mark.world("jit_autograd.py", nproc=2)
@pytest.mark.multiprocess
def test_jitted_stages_under_torch_pipeline_schedule_equal_one_device(ranks):
    for got in ranks:
        assert got["pipeline_max_grad_err"] <= 1e-6 * got["pipeline_max_scale"], got
        assert got["pipeline_plan_count"] == 1  # 4 microbatches, one plan
