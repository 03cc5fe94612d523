"""Op coverage by construction (issue #14 part 1), each mechanism against one device: attention keeps
a strategy of its own (batch and heads), an op with no DTensor strategy is decomposed with PyTorch's
tables and the pieces are planned, constants and factory ops need no strategy, functional twins of
in-place ops take their strategy, a fake-tensor meta narrower than its kernel is widened, and an op
whose DTensor strategy is wrong (nll_loss's mean over a sharded batch) is decomposed too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import vsf
from vsf import P
from vsf.errors import PlanError
from vsf.jit.plan import Collective

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _jit_on(mesh, fun, args, specs):
    """``fun`` jitted on ``args`` laid out as ``specs``: the results (gathered) and the plan."""
    placed = [vsf.device_put(a, vsf.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    jitted = vsf.jit(fun)
    plan = jitted.lower(*placed).plan
    return vsf.device_get(jitted(*placed)), plan


def _ops(plan):
    return {n.target for n in plan.nodes}


def _plans_of(plan, op):
    return [p for n, p in plan.nodes.items() if n.target is op]


def _attention_loss(q, k, v, mask=None, gqa=False):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def _attention_step(q, k, v, *mask, gqa=False):
    return vsf.value_and_grad(lambda q, k, v: _attention_loss(q, k, v, *mask, gqa=gqa), argnums=(0, 1, 2))(q, k, v)


def _attention_reference(q, k, v, *mask, gqa=False):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    loss = _attention_loss(q, k, v, *mask, gqa=gqa)
    return loss.detach(), torch.autograd.grad(loss, (q, k, v))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize(
    "axis, spec, split", [("dp", P("dp"), 0), ("tp", P(None, "tp"), 1)], ids=["batch-on-dp", "heads-on-tp"]
)
def test_sdpa_runs_sharded_over_batch_or_heads_like_one_device(sim, heads, kv_heads, axis, spec, split):
    q = torch.randn(4, heads, 8, 16)
    k, v = torch.randn(2, 4, kv_heads, 8, 16).unbind(0)
    gqa = heads != kv_heads
    sim(2)
    mesh = vsf.make_mesh((2,), (axis,))
    (loss, grads), plan = _jit_on(mesh, lambda q, k, v: _attention_step(q, k, v, gqa=gqa), (q, k, v), [spec] * 3)
    want_loss, want_grads = _attention_reference(q, k, v, gqa=gqa)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # the kernels run on shards as they are: no T x T product, no gather of q, k or v
    assert {SDPA, SDPA_BACKWARD} <= _ops(plan) and aten.bmm.default not in _ops(plan)
    for p in _plans_of(plan, SDPA) + _plans_of(plan, SDPA_BACKWARD):
        assert all(pl == (torch.distributed.tensor.Shard(split),) for pl in p.ins)


def test_sdpa_with_a_padding_mask_splits_the_mask_by_batch_and_broadcasts_it_over_heads(sim):
    q, k, v = torch.randn(3, 4, 4, 8, 16).unbind(0)
    keep = torch.arange(8) < torch.tensor([8, 5, 3, 6])[:, None]  # [batch, key]: padding at the end
    mask = keep[:, None, None, :].expand(4, 1, 8, 8).contiguous()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    (loss, grads), plan = _jit_on(mesh, _attention_step, (q, k, v, mask), [P("dp", "tp")] * 3 + [P("dp")])
    want_loss, want_grads = _attention_reference(q, k, v, mask)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    shard = torch.distributed.tensor.Shard
    (forward,) = _plans_of(plan, SDPA)
    assert forward.ins == ((shard(0), shard(1)),) * 3 + ((shard(0), torch.distributed.tensor.Replicate()),)


def test_sdpa_grouped_heads_are_split_only_into_equal_parts(sim):
    """6 query heads over 3 key/value heads on 2 ranks: a head split would give rank 1 query heads
    2..5 (key/value heads 1 and 2) but key/value head 2 only; the planner must not offer it."""
    q = torch.randn(2, 6, 8, 16)
    k, v = torch.randn(2, 2, 3, 8, 16).unbind(0)
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    (loss, grads), plan = _jit_on(
        mesh, lambda q, k, v: _attention_step(q, k, v, gqa=True), (q, k, v), [P(None, "tp"), P(), P()]
    )
    want_loss, want_grads = _attention_reference(q, k, v, gqa=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for p in _plans_of(plan, SDPA):
        assert all(pl != (torch.distributed.tensor.Shard(1),) for pl in p.ins)


def test_ops_with_no_strategy_are_decomposed_and_planned_like_one_device(sim):
    """mse_loss, glu and hardswish (and their backward ops) have no DTensor strategy; PyTorch's
    decompositions of them do, recursively."""
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def step(x, y):
        return vsf.value_and_grad(lambda x: F.mse_loss(F.hardswish(F.glu(x, dim=1)), y))(x)

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    (loss, grad), plan = _jit_on(mesh, step, (x, y), [P("dp"), P("dp")])
    xr = x.clone().requires_grad_()
    want = F.mse_loss(F.hardswish(F.glu(xr, dim=1)), y)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, torch.autograd.grad(want, xr)[0], rtol=1e-6, atol=1e-7)
    assert not _ops(plan) & {aten.mse_loss.default, aten.glu.default, aten.hardswish.default}
    # the batch stays split: nothing is gathered, only the loss's partial sum is reduced
    assert {c.kind for c in plan.collectives()} == {"all_reduce"}


def test_an_op_with_neither_strategy_nor_decomposition_is_a_plan_error_naming_it_and_the_line(sim):
    m, a, b = torch.randn(3, 5), torch.randn(4, 3, 2), torch.randn(4, 2, 5)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    with pytest.raises(
        PlanError, match=r"aten\.addbmm\.default has no DTensor sharding strategy.*test_coverage\.py.*torch\.addbmm"
    ):
        _jit_on(mesh, lambda m, a, b: torch.addbmm(m, a, b), (m, a, b), [P(), P("dp"), P("dp")])


@torch.library.custom_op("vsf_test::halved", mutates_args=())
def _halved(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


@torch.library.custom_op("vsf_test::halved_backward", mutates_args=())
def _halved_backward(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


for _op in (_halved, _halved_backward):
    _op.register_fake(torch.empty_like)
_halved.register_autograd(lambda ctx, grad: _halved_backward(grad))


@register_sharding(torch.ops.vsf_test.halved.default)
def _halved_rules(x):
    """Elementwise: any placement in, the same out (its backward is given none)."""
    return [([Replicate()], [Replicate()])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim)]


def test_a_backward_op_without_a_strategy_names_the_line_of_its_forward(sim):
    """A backward op's own line is the gradient call; the error also names the forward op's line
    (a custom op with rules whose backward has none)."""
    w, x = torch.randn(3, 3), torch.randn(4, 3)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))

    def loss(w, x):
        return _halved(x @ w).square().mean()

    with pytest.raises(
        PlanError,
        match=r"vsf_test\.halved_backward\.default has no DTensor sharding strategy.*"
        r"\(the backward of vsf_test\.halved\.default at .*test_coverage\.py.*_halved\(x @ w\)",
    ):
        _jit_on(mesh, vsf.grad(loss), (w, x), [P(), P("dp")])


def test_constants_and_factory_ops_made_in_the_step_need_no_strategy(sim):
    """A tensor literal (``lift_fresh_copy``), ``arange``/``full``/``zeros`` and a mask built from
    them (``masked_fill`` of constants has no DTensor strategy) are made where they are used."""
    x = torch.randn(8, 6)

    def step(x):
        scale = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        causal = torch.arange(6)[:, None] >= torch.arange(6)[None, :]
        bias = torch.zeros(6, 6).masked_fill(~causal, float("-inf")) + torch.full((6, 6), 0.5)
        return torch.softmax(x[:, None, :] * scale + bias, dim=-1).sum(1)

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    got, plan = _jit_on(mesh, step, (x,), [P("dp")])
    torch.testing.assert_close(got, step(x), rtol=1e-6, atol=1e-7)
    assert aten.lift_fresh_copy.default in _ops(plan)
    assert not plan.collectives()


def test_a_functional_copy_takes_the_strategy_of_copy_(sim):
    """``shifted[:, 1:] = ids[:, :-1]`` (T5's ``_shift_right``) functionalizes to ``aten.copy``,
    which DTensor covers only as the in-place ``copy_``."""
    ids = torch.randint(0, 50, (8, 6))

    def shift(ids):
        shifted = torch.zeros_like(ids)
        shifted[:, 1:] = ids[:, :-1].clone()
        return shifted

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    got, plan = _jit_on(mesh, shift, (ids,), [P("dp")])
    torch.testing.assert_close(got, shift(ids))
    assert aten.copy.default in _ops(plan) and not plan.collectives()


def test_grouped_mm_traces_in_fp32_and_runs_sharded_like_one_device(sim):
    """Mixtral's experts: ``_grouped_mm``'s fake-tensor meta asks for bf16, its CPU kernel runs fp32."""
    x, w = torch.randn(12, 8), torch.randn(3, 8, 16)  # (the meta wants 16-byte strides of bf16)
    offs = torch.tensor([4, 9, 12], dtype=torch.int32)

    def step(x, w):
        return vsf.value_and_grad(lambda w: torch._grouped_mm(x, w, offs).square().sum())(w)

    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    (loss, grad), plan = _jit_on(mesh, step, (x, w), [P(), P(None, None, "tp")])
    wr = w.clone().requires_grad_()
    want = torch._grouped_mm(x, wr, offs).square().sum()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, torch.autograd.grad(want, wr)[0], rtol=1e-5, atol=1e-6)
    assert aten._grouped_mm.default in _ops(plan)


def test_a_mean_over_an_unevenly_ignored_batch_is_the_mean_of_all_targets(sim):
    """DTensor's nll_loss averages the shards' means (Partial("avg")): wrong when ignore_index leaves
    the shards different numbers of targets (here 4 and 1). It is decomposed instead."""
    logits = torch.randn(8, 5)
    targets = torch.tensor([1, 2, 3, 4, -100, -100, -100, 0])

    def step(logits, targets):
        return vsf.value_and_grad(lambda z: F.cross_entropy(z, targets, ignore_index=-100))(logits)

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    (loss, grad), plan = _jit_on(mesh, step, (logits, targets), [P("dp"), P("dp")])
    z = logits.clone().requires_grad_()
    want = F.cross_entropy(z, targets, ignore_index=-100)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, torch.autograd.grad(want, z)[0], rtol=1e-6, atol=1e-7)
    assert aten.nll_loss_forward.default not in _ops(plan)


@pytest.mark.parametrize(
    "reduction, image", [("sum", False), ("none", False), ("sum", True)], ids=["sum", "none", "sum-2d"]
)
def test_a_sum_of_losses_over_a_split_batch_reduces_only_the_loss(sim, reduction, image):
    """nll_loss's backward divides by the count of targets only for a mean: for a sum (or no
    reduction) the count is not computed, so the plan's one collective is the loss's all-reduce
    (a float32 scalar over 2 ranks: 2 * (2 - 1) / 2 * 4 bytes), the logits' gradient staying split.
    ``image``: per-pixel targets (``nll_loss2d``)."""
    logits = torch.randn(8, 5, 2, 1) if image else torch.randn(8, 5)
    targets = torch.tensor([1, 2, 3, 4, -100, -100, -100, 0])
    targets = torch.stack([targets, targets.flip(0)], 1)[..., None] if image else targets

    def loss(z, targets):
        return F.cross_entropy(z, targets, ignore_index=-100, reduction=reduction).sum()

    def step(logits, targets):
        return vsf.value_and_grad(lambda z: loss(z, targets))(logits)

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    (got, grad), plan = _jit_on(mesh, step, (logits, targets), [P("dp"), P("dp")])
    z = logits.clone().requires_grad_()
    want = loss(z, targets)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(want, z)[0], rtol=1e-6, atol=1e-7)
    assert plan.collectives() == [Collective("all_reduce", "dp", (), torch.float32, 4)]


def _views(x):
    return x.view(4, 16, 4, 8).sum(-1), x.view(64, 32) * 2


def _sums(x):
    return x.sum([0, 1]), x.sum(2)


@pytest.mark.parametrize("f, spec", [(_views, P(None, None, "tp")), (_sums, P("tp"))], ids=["view-shapes", "sum-dims"])
def test_dtensor_is_asked_with_the_arguments_that_decide_its_answer(sim, f, spec):
    """DTensor caches its answers by op schema; asked without the op's runtime schema info, the key
    leaves out the non-tensor arguments: ``x.view(4, 16, 4, 8)`` answered for ``x.view(64, 32)``,
    and ``x.sum([0, 1])`` (a partial sum) for ``x.sum(2)`` (split rows): the PlanMismatch of issue
    #14 on Llama, Mistral, Qwen2, Gemma and T5."""
    x = torch.randn(4, 16, 32)
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    got, _ = _jit_on(mesh, f, (x,), [spec])
    for g, w in zip(got, f(x)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_a_redistributed_value_keeps_its_traced_memory_order(sim):
    """A value stored transposed (as SDPA's CPU output is) and gathered comes back from the collective
    in row-major order; a later view that relied on the traced strides still works (the view's
    input is put in its traced memory order first)."""
    x = torch.randn(8, 4, 6)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))

    def f(x):
        t = x.transpose(0, 1) * 2  # a result [4, 8, 6] stored as [8, 4, 6] (mul keeps its input's order)
        t = vsf.with_sharding_constraint(t, vsf.NamedSharding(mesh, P()))
        return t.transpose(0, 1).view(8, 24)

    got, _ = _jit_on(mesh, f, (x,), [P("dp")])
    torch.testing.assert_close(got, 2 * x.reshape(8, 24))


def test_a_constraint_on_a_constant_lays_it_out_as_it_says(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    s = vsf.NamedSharding(mesh, P("dp"))
    out = vsf.jit(lambda x: x + vsf.with_sharding_constraint(torch.arange(8.0)[:, None].expand(8, 6).clone(), s))(
        vsf.device_put(torch.ones(8, 6), s)
    )
    assert vsf.sharding.sharding_of(out) == s
    torch.testing.assert_close(vsf.device_get(out), torch.arange(8.0)[:, None] + torch.ones(8, 6))
