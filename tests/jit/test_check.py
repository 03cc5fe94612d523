"""Checking mode (``vsf.config.check_plan``, ``f.check``): a wrong plan is stopped at its op.

The broken rules here are deliberate: a test-only op registered with DTensor as elementwise
although it is a running sum (so sharding it gives each shard its own running sum), and a plan
edited to claim that a partial sum is replicated. Both run without any error and give wrong
numbers; checking mode must name the op, its source line and its placements. A correct plan
must pass and give the one-device results.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate

import vsf
from vsf import P, optim
from vsf.jit.strategies import register_elementwise
from toy_models import GPT, GPTConfig


@torch.library.custom_op("vsftest::running_sum", mutates_args=())
def running_sum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0)


@running_sum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


register_elementwise(torch.ops.vsftest.running_sum.default, outputs=1)  # wrong on purpose


def doubled_running_total(x):
    y = x * 2
    z = torch.ops.vsftest.running_sum(y)  # the broken op
    return z.sum()


def _line_of(fn, marker):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def test_wrong_strategy_is_named_with_its_op_line_and_placements(sim):
    x = torch.arange(8.0)
    y = 2 * x
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    f = vsf.jit(doubled_running_total)
    assert vsf.device_get(f(xs)) != y.cumsum(0).sum()  # unchecked, the wrong rule is silent
    with pytest.raises(vsf.PlanCheckError) as info:
        f.check(xs)
    e = info.value
    assert e.op == "vsftest.running_sum.default"
    assert f'{__file__}", line {_line_of(doubled_running_total, "# the broken op")}' in e.line
    assert e.inputs == ("f32[8@dp]",) and e.outputs == ("f32[8@dp]",)
    per_shard = torch.cat([y[:4].cumsum(0), y[4:].cumsum(0)])
    assert e.max_error == (y.cumsum(0) - per_shard).abs().max().item()
    assert "vsftest.running_sum.default" in str(e) and e.line in str(e)


def test_config_switch_checks_every_call(sim, monkeypatch):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    xs = vsf.device_put(torch.arange(8.0), vsf.NamedSharding(mesh, P("dp")))
    monkeypatch.setattr(vsf.config, "check_plan", True)
    with pytest.raises(vsf.PlanCheckError, match="vsftest.running_sum"):
        vsf.jit(doubled_running_total)(xs)


def _mlp():
    params = {"w1": torch.randn(16, 64), "b1": torch.randn(64), "w2": torch.randn(64, 16)}
    batch = (torch.randn(32, 16), torch.randn(32, 16))

    def loss_fn(p, x, y):
        return ((F.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2).mean()

    return params, batch, loss_fn


def test_plan_claiming_a_partial_sum_is_replicated_is_caught(sim):
    params, batch, loss_fn = _mlp()
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp")}))
    f = vsf.jit(loss_fn)
    plan = f.lower(p, *batch).plan
    # h @ w2 contracts the tp-split dim: a partial sum. Claim it is whole on every rank.
    node = next(
        n
        for n, s in plan.nodes.items()
        if s.outs and isinstance(s.outs[0], tuple) and isinstance(s.outs[0][0], Partial)
    )
    plan.nodes[node] = dataclasses.replace(plan.nodes[node], outs=((Replicate(),),))
    with pytest.raises(vsf.PlanCheckError) as info:
        f.check(p, *batch)
    assert info.value.node == node.name and info.value.op == str(node.target)
    assert "rank 1's copy differs from the first copy's" in str(info.value)
    assert info.value.outputs == ("f32[32,16]",)


def test_skipped_reduction_is_charged_to_the_op_that_reads_it(sim, monkeypatch):
    # a redistribution that forgets to all-reduce a partial sum: the op using the value is named,
    # with the input as held (partial) and as used (whole)
    from vsf.jit import lower

    move = lower.move_local
    monkeypatch.setattr(
        lower,
        "move_local",
        lambda mesh, t, local, src, dst: (
            local if any(isinstance(p, Partial) for p in src) else move(mesh, t, local, src, dst)
        ),
    )
    params, batch, loss_fn = _mlp()
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp")}))
    with pytest.raises(vsf.PlanCheckError) as info:
        vsf.jit(loss_fn).check(p, *batch)
    assert info.value.op == "aten.sub.Tensor"
    assert info.value.inputs == ("f32[32,16]{U:tp} -> f32[32,16]", "f32[32,16]")
    assert 'return ((F.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2).mean()' in info.value.line


def test_correct_plan_passes_on_an_mlp_train_step(sim, monkeypatch):
    params, batch, loss_fn = _mlp()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))

    def step(p, s, x, y):
        loss, grads = vsf.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s, loss

    want_p, want_s, want = params, tx.init(params), []
    for _ in range(2):
        want_p, want_s, loss = step(want_p, want_s, *batch)
        want.append(loss)
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    p = vsf.device_put(
        params, vsf.NamedSharding.tree(mesh, {"w1": P("fsdp", "tp"), "b1": P("tp"), "w2": P("tp", "fsdp")})
    )
    s = optim.init_sharded(tx, p, zero_axes=("dp",))
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    monkeypatch.setattr(vsf.config, "check_plan", True)
    jitted, got = vsf.jit(step), []
    for _ in range(2):
        p, s, loss = jitted(p, s, *b)
        got.append(vsf.device_get(loss))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)
    for k, w in want_p.items():
        torch.testing.assert_close(vsf.device_get(p[k]), w, rtol=1e-5, atol=1e-5)


def test_correct_plan_passes_on_a_gpt_step_on_the_5d_mesh(sim):
    # every kind of value a real plan has: nested and strided splits, partial sums and norms, views
    model = GPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1))
    params = vsf.tree.from_module(model)
    batch = (torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8)))
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))

    def step(p, s, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda q: vsf.tree.apply(model, q, idx, tgt))(p)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s, loss

    want = step(params, tx.init(params), *batch)[2]
    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
    rules = [
        (r".*(qkv|fc1)\.weight", P("tp", "fsdp")),
        (r".*(qkv|fc1)\.bias", P("tp")),
        (r".*(proj|fc2)\.weight", P("fsdp", "tp")),
        (r".*", P()),
    ]
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    s = optim.init_sharded(tx, p, zero_axes=("dp",))
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    _, _, loss = vsf.jit(step).check(p, s, *b)
    torch.testing.assert_close(vsf.device_get(loss), want, rtol=1e-5, atol=1e-6)


def test_a_view_merging_a_dim_split_over_two_axes_passes_and_gives_one_devices_numbers(sim):
    """DeBERTa's attention views its [batch, heads, ...] scores as [batch * heads, ...]: with the heads
    split over fsdp and tp, DTensor's view rule lays the merged dim out as two strided shards, which
    the check gathered out of order (torch 2.13 read them as an order of mesh dims) and called the
    view wrong; the step itself computed one device's numbers, as now both do."""
    x, w = torch.randn(4, 4, 8, 8), torch.randn(16, 8, 8)

    def f(x, w):
        return torch.bmm(x.view(16, 8, 8), w).softmax(0).cumsum(0)

    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    args = (
        vsf.device_put(x, vsf.NamedSharding(mesh, P(None, ("fsdp", "tp")))),
        vsf.device_put(w, vsf.NamedSharding(mesh, P())),
    )
    torch.testing.assert_close(vsf.device_get(vsf.jit(f).check(*args)), f(x, w), rtol=1e-5, atol=1e-6)


def test_check_mode_off_adds_no_work(sim, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("checking mode ran with vsf.config.check_plan off")

    from vsf.jit import check

    monkeypatch.setattr(check.Checker, "__init__", refuse)
    monkeypatch.setattr(check.Checker, "__call__", refuse)
    params, batch, loss_fn = _mlp()
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    f = vsf.jit(loss_fn)
    p, b = vsf.device_put(params, vsf.NamedSharding(mesh, P())), vsf.device_put(batch, vsf.NamedSharding(mesh, P("dp")))
    torch.testing.assert_close(vsf.device_get(f(p, *b)), loss_fn(params, *batch), rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="checking mode ran"):
        f.check(p, *b)  # the same call checked does reach the checker


def test_check_needs_simulated_values(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    xs = vsf.device_put(torch.arange(8.0), vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(RuntimeError, match=r"vsf\.simulate\(n\) with real numbers"):
        vsf.jit(lambda x: x * 2).check(xs)


def test_pending_norm_is_assembled_as_a_norm(sim):
    # linalg_vector_norm of shards is a partial 2-norm: sqrt(sum of local norms ** 2), not a sum
    x = torch.randn(12)
    sim(4)
    mesh = vsf.make_mesh((4,), ("dp",))
    f = vsf.jit(lambda v: torch.linalg.vector_norm(v) * 1.0)
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    assert any(isinstance(p, Partial) for s in f.lower(xs).plan.nodes.values() for out in s.outs if out for p in out)
    torch.testing.assert_close(vsf.device_get(f.check(xs)), torch.linalg.vector_norm(x), rtol=1e-6, atol=1e-6)


def test_random_and_uninitialised_values_are_not_compared_but_feed_later_ops(sim, monkeypatch):
    # dropout traces to empty_like + bernoulli: neither has a value the unsharded op would repeat
    monkeypatch.setattr(vsf.config, "allow_replicated_fallback", True)  # bernoulli may lack a strategy
    monkeypatch.setattr(vsf.config, "allow_unkeyed_random", True)  # torch's own draw, not a vsf.random key
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.randn(8, 4), vsf.NamedSharding(mesh, P("dp")))
    w = vsf.device_put(torch.randn(4, 4), vsf.NamedSharding(mesh, P()))
    f = vsf.jit(lambda x, w: (F.dropout(x @ w, 0.5, training=True) * 3).sum())
    targets = {str(n.target) for n in f.lower(x, w).plan.nodes}
    assert {"aten.empty_like.default", "aten.bernoulli.p"} <= targets
    assert torch.isfinite(vsf.device_get(f.check(x, w)))


def _identity_view_ignoring_conj(node, base):
    """``simplify._same_view`` as it was before it read the conjugate bit (the bug that trained
    Mega wrong): a ``conj`` view of a complex tensor passes for its input, and is dropped."""
    val, other = node.meta.get("val"), base.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and isinstance(other, torch.Tensor)
        and (val.dtype, val.shape, val.stride(), val.storage_offset())
        == (other.dtype, other.shape, other.stride(), other.storage_offset())
    )


def _fft_correlation(x, k):
    spectrum = torch.fft.rfft(x, n=32, dim=1) * torch.fft.rfft(k, n=32).conj()
    return torch.fft.irfft(spectrum, 32, dim=1)[:, :16].square().mean()


def test_a_wrong_rewrite_of_the_trace_is_stopped_against_the_eager_step(sim, monkeypatch):
    """A rewrite of the traced graph that changes its values (a ``conj`` dropped as an identity
    view) passes the op-by-op check, whose reference is that same graph; the graph run whole and
    set against the step run eagerly stops it, and the plain call's wrong number shows why."""
    from vsf.jit import simplify

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    g = torch.Generator().manual_seed(0)
    xs, ks = torch.randn(4, 16, generator=g), torch.randn(16, generator=g)
    x, k = vsf.device_put(xs, vsf.NamedSharding(mesh, P("dp"))), vsf.device_put(ks, vsf.NamedSharding(mesh, P()))
    want = _fft_correlation(xs, ks)
    torch.testing.assert_close(vsf.device_get(vsf.jit(_fft_correlation).check(x, k)), want)

    monkeypatch.setattr(simplify, "_same_view", _identity_view_ignoring_conj)
    broken = vsf.jit(_fft_correlation)
    assert not torch.allclose(vsf.device_get(broken(x, k)), want, rtol=1e-3)  # silently wrong, unchecked
    with pytest.raises(vsf.PlanCheckError, match=r"differs from the step run eagerly on one device in 1 of 1") as info:
        broken.check(x, k)
    assert info.value.op == "trace" and info.value.max_error > 1e-3
    assert "in float64 too" in str(info.value)  # (not rounding: widened, the two still differ)


def _centred_cnn() -> torch.nn.Module:
    """A convolution whose bias BatchNorm takes away again: that bias's gradient is 0 in exact
    arithmetic, rounding noise in float32 (about 1e-8), which the traced graph and eager torch
    round apart."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=True), torch.nn.BatchNorm2d(4), torch.nn.Tanh())


def _sign_step(model: torch.nn.Module, scale: torch.Tensor | None = None):
    """One step of Adam's first update, ``lr * g / (|g| + eps)`` (about ``lr`` times the sign of
    ``g``), at ``eps = 1e-12``: a gradient that is rounding noise moves its param by a whole
    ``lr``, one way or the other. ``scale``: a float32 matrix the step closes over and multiplies
    the images by."""

    def step(p, s, x):
        def loss(p, s):
            y, updated = vsf.tree.apply(model, {**p, **s}, x if scale is None else x @ scale, mutable=True)
            return y.square().mean(), updated

        (_, _), g = vsf.value_and_grad(loss, has_aux=True)(p, s)
        return {k: p[k] - 1e-2 * g[k] / (g[k].abs() + 1e-12) for k in p}

    return step


def _sign_step_args(sim, model):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = torch.randn(8, 3, 10, 10, generator=torch.Generator().manual_seed(1))
    p, s = vsf.tree.from_module(model), vsf.tree.from_module(model, params=False, buffers=True)
    return (p, s, x), [vsf.device_put(v, vsf.NamedSharding(mesh, P())) for v in (p, s, x)]


def test_rounding_a_step_amplifies_is_told_from_a_wrong_trace_in_float64(sim, monkeypatch):
    """The traced graph and the eager step round a gradient that is noise apart, and the step
    amplifies that to a whole ``lr`` (a 3D ResNet with Adam did so, 1e-4 after one step): in float32
    the conv bias's results differ past the tolerance. Run again in float64 they agree (the noise is
    some nine digits smaller there), so it is rounding, not a wrong trace: the check passes, and
    the results it returns are the program's (every param but that bias as eager torch's)."""
    from vsf.jit import check_trace

    judged = []
    in_float64 = check_trace._in_float64
    monkeypatch.setattr(check_trace, "_in_float64", lambda *a: judged.append((a[-1], r := in_float64(*a))) or r)
    model = _centred_cnn()
    plain, args = _sign_step_args(sim, model)
    got = vsf.device_get(vsf.jit(_sign_step(model)).check(*args))
    assert judged == [([0], {})]  # (the outputs in key order: "0.bias" first; it differed in float32)
    want = _sign_step(model)(*plain)
    assert (got["0.bias"] - want["0.bias"]).abs().max() > 1e-3  # (the noise's sign, each its own)
    for k in ("0.weight", "1.weight", "1.bias"):
        torch.testing.assert_close(got[k], want[k])


def test_a_difference_the_float64_run_cannot_judge_is_still_stopped_and_says_why(sim):
    """Where the step does not run in float64 (here it closes over a float32 matrix, by which eager
    torch will not multiply float64 images), vsf cannot tell rounding from a wrong trace: it
    stops there, and says that it could not tell and why."""
    model, scale = _centred_cnn(), torch.eye(10) * 0.5
    _, args = _sign_step_args(sim, model)
    step = _sign_step(model, scale)
    with pytest.raises(vsf.PlanCheckError, match=r"not rounding\? vsf could not run them in float64 to tell") as info:
        vsf.jit(step).check(*args)
    assert info.value.op == "trace"


_PLACE = [0]  # the block running now, counted from 1 (a global the model resets at each call)


class _Counted(torch.nn.Module):
    """A block scaled by its place in the stack, which it counts in a global: no attribute of the
    blocks differs, so the key of a stamped block cannot tell them apart, and the third block is
    stamped from the second's trace, its scale included (the first takes an input that needs no
    gradient: a key of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        _PLACE[0] += 1
        return torch.tanh(self.lin(x)) * _PLACE[0]


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Counted(), _Counted(), _Counted()])

    def forward(self, x):
        _PLACE[0] = 0
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_stamped_from_a_trace_that_is_not_theirs_are_stopped_against_the_eager_step(sim, monkeypatch):
    torch.manual_seed(0)
    model = _Stack()
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    params = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, P()))
    x = vsf.device_put(torch.randn(4, 8), vsf.NamedSharding(mesh, P("dp")))
    loss = lambda p, x: vsf.tree.apply(model, p, x).square().mean()  # noqa: E731
    step = lambda p, x: vsf.value_and_grad(loss)(p, x)  # noqa: E731
    want = vsf.value_and_grad(loss)(vsf.device_get(params), vsf.device_get(x))
    with pytest.raises(vsf.PlanCheckError, match="stamp_blocks") as info:
        vsf.jit(step).check(params, x)
    assert info.value.op == "trace"
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    got = vsf.device_get(vsf.jit(step).check(params, x))
    torch.testing.assert_close(got, want)


def test_a_step_that_draws_from_torchs_generator_is_not_set_against_its_eager_run_and_says_so(sim, monkeypatch):
    monkeypatch.setattr(vsf.config, "allow_unkeyed_random", True)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.randn(8, 4), vsf.NamedSharding(mesh, P("dp")))
    f = vsf.jit(lambda x: (x + torch.rand(8, 4)).sum())
    with pytest.warns(
        UserWarning, match=r"did not compare the traced graph with the step run eagerly: it draws .*aten\.rand"
    ):
        f.check(x)
