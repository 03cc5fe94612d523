"""vsf.optim on one process: numerics against torch.optim and hand formulas, composition, errors."""

from __future__ import annotations

import math

import pytest
import torch

from vsf import optim

STEPS = 20
TOL = dict(rtol=1e-6, atol=1e-6)  # ulp-level; Adam and coupled decay are torch's fused Adam bit for bit
MASK = {"w": True, "b": False, "e": True}


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(16, 8), "b": torch.randn(8), "e": torch.randn(4, 8)}


def _grads(params: dict[str, torch.Tensor], n: int = STEPS) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(n)]


def run_torch(
    cls: type,
    kwargs: dict,
    params: dict,
    grads: list[dict],
    *,
    mask: dict | None = None,
    clip: float | None = None,
    impl: str = "foreach",
) -> dict[str, torch.Tensor]:
    """Reference: a torch.optim optimizer over the same tensors; a mask is a param group with
    weight_decay=0; ``clip`` runs ``clip_grad_norm_`` before each step; ``impl`` is torch's
    ``foreach`` or ``fused`` implementation."""
    tp = {k: v.clone().requires_grad_() for k, v in params.items()}
    groups = [{"params": list(tp.values())}]
    if mask is not None:
        groups = [
            {"params": [tp[k] for k in tp if mask[k]]},
            {"params": [tp[k] for k in tp if not mask[k]], "weight_decay": 0.0},
        ]
    opt = cls(groups, **{impl: True}, **kwargs)
    for g in grads:
        for k in tp:
            tp[k].grad = g[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(tp.values()), clip)
        opt.step()
    return {k: v.detach() for k, v in tp.items()}


def run_vsf(tx: optim.GradientTransformation, params: dict, grads: list[dict]) -> dict[str, torch.Tensor]:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params


TORCH_CASES = [
    ("sgd", torch.optim.SGD, dict(lr=0.1), lambda: optim.sgd(0.1), None),
    ("sgd-momentum", torch.optim.SGD, dict(lr=0.1, momentum=0.9), lambda: optim.sgd(0.1, momentum=0.9), None),
    (
        "sgd-nesterov-wd",
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        None,
    ),
    ("adam", torch.optim.Adam, dict(lr=1e-2), lambda: optim.adam(1e-2), None),
    ("adam-wd", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), lambda: optim.adam(1e-2, weight_decay=0.1), None),
    (
        "adam-wd-mask",
        torch.optim.Adam,
        dict(lr=1e-2, weight_decay=0.1),
        lambda: optim.adam(1e-2, weight_decay=0.1, mask=MASK),
        MASK,
    ),
    (
        "adamw-no-wd",
        torch.optim.AdamW,
        dict(lr=1e-2, weight_decay=0.0),
        lambda: optim.adamw(1e-2, weight_decay=0.0),
        None,
    ),
    (
        "adamw",
        torch.optim.AdamW,
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda: optim.adamw(1e-2, 0.8, 0.99, 1e-6, 0.1),
        None,
    ),
    (
        "adamw-mask-fn",
        torch.optim.AdamW,
        dict(lr=1e-2, weight_decay=0.1),
        lambda: optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: MASK[k] for k in p}),
        MASK,
    ),
]


@pytest.mark.parametrize("name,cls,kwargs,make,mask", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_matches_torch_optim(name, cls, kwargs, make, mask):
    params = _params()
    grads = _grads(params)
    want = run_torch(cls, kwargs, params, grads, mask=mask)
    got = run_vsf(make(), params, grads)
    for k in params:
        torch.testing.assert_close(got[k], want[k], **TOL)


ADAM_CASES = [c for c in TORCH_CASES if c[1] is not torch.optim.SGD]


@pytest.mark.parametrize("name,cls,kwargs,make,mask", ADAM_CASES, ids=[c[0] for c in ADAM_CASES])
def test_adam_matches_torch_fused_adam(name, cls, kwargs, make, mask):
    """Adam's step is torch's fused kernel applied to a zero param, so without decoupled decay the
    params are torch's fused Adam's bit for bit; with it, equal up to rounding."""
    params = _params()
    grads = _grads(params)
    want = run_torch(cls, kwargs, params, grads, mask=mask, impl="fused")
    got = run_vsf(make(), params, grads)
    exact = cls is torch.optim.Adam or not kwargs["weight_decay"]
    for k in params:
        torch.testing.assert_close(got[k], want[k], **(dict(rtol=0, atol=0) if exact else TOL))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_updates_a_0d_param_as_torch_does(weight_decay):
    """A 0-d param (CLIP's ``logit_scale``): its decay times the param, two 0-d tensors, was promoted
    to the float64 of the decay factor, and the fused kernel refused the float64 update beside the
    float32 moments ("expected scalar type Double but found Float")."""
    params = {"scale": torch.tensor(2.0), "w": torch.randn(4)}
    grads = _grads(params)
    want = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=weight_decay), params, grads)
    got = run_vsf(optim.adamw(1e-2, weight_decay=weight_decay), params, grads)
    for k in params:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], **TOL)


@pytest.mark.parametrize("inplace", [False, True], ids=["adam_step", "adam_step_"])
def test_adam_as_inductor_compiles_it_matches_torch_fused_adamw(inplace):
    """Under ``backend="inductor"`` the Adam ops run as their math in torch ops
    (``vsf.jit.runner.as_inductor_math``; the in-place op, which the lowering calls on donated
    moments, writes them with ``copy_``): the program calls no fused kernel, and its param after
    20 AdamW steps is torch's fused AdamW's up to rounding."""
    from vsf import _compat
    from vsf.jit.runner import as_inductor_math

    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.999, 1e-8
    p = torch.randn(16, 8)
    grads = [{"w": torch.randn_like(p)} for _ in range(STEPS)]
    (want,) = run_torch(torch.optim.AdamW, dict(lr=lr, weight_decay=wd), {"w": p}, grads, impl="fused").values()
    rate = _compat.fused_adam_lr(lr, p.device)
    decay = torch.tensor(1 - lr * wd, dtype=torch.float32).double() - 1  # torch's factor, rounded, minus one

    def step(g, m, v, p, count):
        if inplace:
            return p + torch.ops.vsf.adam_step_(g, m, v, p, count, rate, decay, b1, b2, eps), m, v
        u, m, v = torch.ops.vsf.adam_step(g, m, v, p, count, rate, decay, b1, b2, eps)
        return p + u, m, v

    m, v, count = torch.zeros_like(p), torch.zeros_like(p), torch.tensor(1.0)
    inputs = [grads[0]["w"], m, v, p, count]
    program = as_inductor_math(_compat.trace_fake(step, inputs), inputs)
    assert not any("vsf" in str(n.target) for n in program.graph.nodes)
    for g in grads:
        p, m_next, v_next = program(g["w"], m, v, p, count)
        assert (m_next is m and v_next is v) == inplace  # the moments written where they are
        m, v, count = m_next, v_next, count + 1
    torch.testing.assert_close(p, want, **TOL)


def test_adam_on_strided_leaves_and_low_precision_grads():
    """The fused kernel walks memory in order: transposed params/state and transposed or bf16
    gradients must give the numbers contiguous fp32 ones give."""
    params = _params()
    grads = _grads(params, 5)
    want = run_vsf(optim.adamw(1e-2, weight_decay=0.1), params, grads)
    strided = {k: v.t().contiguous().t() if v.ndim == 2 else v for k, v in params.items()}
    assert not strided["w"].is_contiguous()
    bf16 = [{k: v.to(torch.bfloat16) for k, v in g.items()} for g in grads]
    transposed = [{k: v.t().contiguous().t() if v.ndim == 2 else v for k, v in g.items()} for g in grads]
    for ps, gs in ((strided, grads), (params, transposed), (strided, transposed)):
        got = run_vsf(optim.adamw(1e-2, weight_decay=0.1), ps, gs)
        for k in params:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    rounded = run_vsf(optim.adamw(1e-2, weight_decay=0.1), params, [{k: v.float() for k, v in g.items()} for g in bf16])
    got = run_vsf(optim.adamw(1e-2, weight_decay=0.1), params, bf16)
    for k in params:
        torch.testing.assert_close(got[k], rounded[k], rtol=0, atol=0)


def test_adam_lr_schedule_matches_torch_lr_scheduler():
    params = _params()
    grads = _grads(params)
    tp = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.Adam(list(tp.values()), lr=1e-2, foreach=True)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=10)
    for g in grads:
        for k in tp:
            tp[k].grad = g[k]
        opt.step()
        sched.step()
    got = run_vsf(optim.adam(optim.linear(1e-3, 1e-2, transition_steps=10)), params, grads)
    for k in params:
        torch.testing.assert_close(got[k], tp[k].detach(), **TOL)


def test_lion_matches_hand_formula():
    params = _params()
    grads = _grads(params)
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.1
    want = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        for k in want:  # Lion (Chen et al. 2023), decay on w and e only
            direction = torch.sign(b1 * mu[k] + (1 - b1) * g[k]) + (wd * want[k] if MASK[k] else 0)
            want[k] = want[k] - lr * direction
            mu[k] = b2 * mu[k] + (1 - b2) * g[k]
    got = run_vsf(optim.lion(lr, b1, b2, weight_decay=wd, mask=MASK), params, grads)
    for k in params:
        torch.testing.assert_close(got[k], want[k], **TOL)


def test_scale_by_adam_chain_equals_adam():
    params = _params()
    grads = _grads(params, 5)
    composed = optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-2))
    want = run_torch(torch.optim.Adam, dict(lr=1e-2), params, grads)
    got = run_vsf(composed, params, grads)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_by_global_norm_matches_torch(max_norm):
    grads = {k: torch.randn_like(v) for k, v in _params().items()}
    want = {k: v.clone() for k, v in grads.items()}
    _clip_grad_norm_(list(want.values()), max_norm)
    got, _ = optim.clip_by_global_norm(max_norm).update(grads, optim.EmptyState())
    for k in grads:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0)


def _clip_grad_norm_(tensors, max_norm):
    holders = [torch.zeros_like(t, requires_grad=True) for t in tensors]
    for h, t in zip(holders, tensors):
        h.grad = t
    return torch.nn.utils.clip_grad_norm_(holders, max_norm)


def test_masked_applies_inner_only_where_selected():
    params = _params()
    g = {k: torch.randn_like(v) for k, v in params.items()}
    tx = optim.masked(optim.chain(optim.trace(0.5), optim.scale(-2.0)), MASK)
    state = tx.init(params)
    for _ in range(2):
        out, state = tx.update(g, state, params)
    for k in params:  # two momentum steps: t = g, then 0.5 g + g
        torch.testing.assert_close(out[k], -2.0 * 1.5 * g[k] if MASK[k] else g[k])
    assert state.inner_state[0].trace["b"] is None


def test_multi_steps_equals_hand_accumulation():
    params = _params()
    grads = _grads(params, 6)
    k = 3
    tx = optim.multi_steps(optim.adam(1e-2), every_k=k)
    state = tx.init(params)
    got, zero_steps = params, 0
    for g in grads:
        updates, state = tx.update(g, state, got)
        zero_steps += all(torch.count_nonzero(u) == 0 for u in updates.values())
        got = optim.apply_updates(got, updates)
    means = [{n: sum(grads[i + j][n] for j in range(k)) / k for n in params} for i in range(0, len(grads), k)]
    want = run_torch(torch.optim.Adam, dict(lr=1e-2), params, means)
    assert zero_steps == len(grads) - len(grads) // k
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    for n in params:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


# -- schedules ------------------------------------------------------------------------------


def test_schedules_match_hand_formulas():
    lin = optim.linear(1.0, 0.2, transition_steps=8, transition_begin=2)
    cos = optim.cosine_decay(2.0, decay_steps=10, alpha=0.1)
    warm = optim.warmup_cosine_decay(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.1)
    for t in range(20):
        frac = min(max(t - 2, 0), 8) / 8
        assert float(lin(t)) == pytest.approx(1.0 + (0.2 - 1.0) * frac, rel=1e-12)
        c = 0.5 * (1 + math.cos(math.pi * min(t, 10) / 10))
        assert float(cos(t)) == pytest.approx(2.0 * (0.9 * c + 0.1), rel=1e-12)
        if t < 4:
            w = t / 4
        else:
            c = 0.5 * (1 + math.cos(math.pi * min(t - 4, 10) / 10))
            w = 0.1 + (1.0 - 0.1) * c
        assert float(warm(t)) == pytest.approx(w, rel=1e-12, abs=1e-15)
    assert float(optim.constant(0.3)(torch.tensor(7, dtype=torch.int32))) == 0.3


def test_schedules_match_torch_lr_schedulers():
    def torch_lrs(make_sched, n=15):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        sched = make_sched(opt)
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    cos = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.05))
    lin = torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, end_factor=1.0, total_iters=6))
    for t in range(11):  # CosineAnnealingLR climbs back after T_max; optax's decay holds
        assert float(optim.cosine_decay(0.5, 10, alpha=0.1)(t)) == pytest.approx(cos[t], rel=1e-9)
    for t in range(15):
        assert float(optim.linear(0.1, 0.5, transition_steps=6)(t)) == pytest.approx(lin[t], rel=1e-9)


def test_scale_by_schedule_uses_count_before_update():
    tx = optim.scale_by_schedule(lambda count: 10.0 + count)
    g = {"w": torch.ones(2)}
    state = tx.init(g)
    seen = []
    for _ in range(3):
        out, state = tx.update(g, state)
        seen.append(float(out["w"][0]))
    assert seen == [10.0, 11.0, 12.0]
    assert state.count.dtype == torch.int32 and int(state.count) == 3


# -- tracing --------------------------------------------------------------------------------


def test_update_traces_under_make_fx_on_fake_tensors():
    from torch.fx.experimental.proxy_tensor import make_fx

    params = _params()
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine_decay(0.0, 1e-2, 2, 10), weight_decay=0.1, mask=MASK),
    )
    state = tx.init(params)

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    graph = make_fx(step, tracing_mode="fake")(params, grads, state)
    for _ in range(3):
        want_p, want_s = step(params, grads, state)
        got_p, got_s = graph(params, grads, state)
        for k in params:
            torch.testing.assert_close(got_p[k], want_p[k], rtol=0, atol=0)
        params, state = want_p, want_s
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert any("vsf.adam_step" in o for o in ops) and not any("_local_scalar_dense" in o for o in ops)


# -- bad input ------------------------------------------------------------------------------


def test_grads_tree_mismatch_names_first_differing_key_path():
    params = {"blocks": [{"w": torch.ones(2), "v": torch.ones(2)}], "head": torch.ones(3)}
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    missing = {"blocks": [{"w": torch.ones(2)}], "head": torch.ones(3)}
    with pytest.raises(ValueError, match=r"no leaf at \['blocks'\]\[0\]\['v'\]"):
        tx.update(missing, state, params)
    extra = {"blocks": [{"w": torch.ones(2), "v": torch.ones(2), "z": torch.ones(2)}], "head": torch.ones(3)}
    with pytest.raises(ValueError, match=r"a leaf at \['blocks'\]\[0\]\['z'\]"):
        optim.apply_updates(params, extra)
    wrong_shape = {"blocks": [{"w": torch.ones(2), "v": torch.ones(5)}], "head": torch.ones(3)}
    with pytest.raises(
        ValueError, match=r"updates leaf \['blocks'\]\[0\]\['v'\] has shape \(5,\), but params have shape \(2,\)"
    ):
        optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9)).update(
            wrong_shape, optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9)).init(params), params
        )


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match=r"params leaf step has dtype torch.int64"):
        optim.adam().init({"w": torch.ones(2), "step": torch.tensor(3)})
    tx = optim.sgd(0.1)
    with pytest.raises(TypeError, match=r"updates leaf w has dtype torch.complex64"):
        tx.update({"w": torch.ones(2, dtype=torch.complex64)}, tx.init({"w": torch.ones(2)}))


def test_weight_decay_without_params_is_an_error():
    params = {"w": torch.ones(2)}
    tx = optim.adamw(1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(params, tx.init(params))


def test_bad_mask_names_key_path():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    tx = optim.adamw(1e-3, mask={"w": True})
    with pytest.raises(ValueError, match="mask is not a prefix"):
        tx.update(params, tx.init(params), params)
