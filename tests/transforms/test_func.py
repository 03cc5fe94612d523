"""vsf.grad / value_and_grad eagerly on DTensors and plain tensors, against torch.autograd on the full tensors."""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P
from toy_models import GPT, GPTConfig


def test_value_and_grad_on_dtensor_params_equals_unsharded(sim):
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    idx, tgt = torch.randint(0, cfg.vocab, (4, cfg.seq)), torch.randint(0, cfg.vocab, (4, cfg.seq))
    full = {k: v.clone().requires_grad_() for k, v in params.items()}
    want_loss = vsf.tree.apply(model, full, idx, tgt)
    want = dict(zip(full, torch.autograd.grad(want_loss, list(full.values()))))
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    rules = [(r".*(qkv|fc1)\.weight", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    b = vsf.device_put((idx, tgt), vsf.NamedSharding(mesh, P("dp")))
    loss, grads = vsf.value_and_grad(lambda p, i, t: vsf.tree.apply(model, p, i, t))(p, *b)
    assert vsf.typeof(loss) == "f32[]"  # the value comes back reduced
    torch.testing.assert_close(vsf.device_get(loss), want_loss.detach())
    for k, g in vsf.device_get(grads).items():
        torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_argnums_has_aux_and_non_float_leaves():
    w, x = torch.randn(3, 2), torch.randn(5, 3)

    def f(w, x, steps):
        y = (x @ w).tanh()
        return y.sum(), {"mean": y.mean(), "steps": steps}

    (value, aux), (gw, gx) = vsf.value_and_grad(f, argnums=(0, 1), has_aux=True)(w, x, 3)
    wr, xr = w.clone().requires_grad_(), x.clone().requires_grad_()
    ref = (xr @ wr).tanh().sum()
    rw, rx = torch.autograd.grad(ref, (wr, xr))
    torch.testing.assert_close(value, ref.detach())
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(gx, rx)
    assert aux["steps"] == 3
    grads = vsf.grad(lambda p: (p["w"] * p["n"]).sum())({"w": w, "n": torch.arange(2)})
    assert grads["n"] is None
    torch.testing.assert_close(grads["w"], torch.arange(2.0).expand(3, 2))


def test_unused_leaf_gets_zeros_said_by_its_key_path_and_second_derivative():
    with pytest.warns(UserWarning, match=r"does not depend on 1 differentiated leaf\(s\) \(args\[0\]\['b'\]\)"):
        g = vsf.grad(lambda p: (p["a"] ** 3).sum())({"a": torch.tensor([2.0]), "b": torch.ones(2)})
    torch.testing.assert_close(g["b"], torch.zeros(2))
    second = vsf.grad(lambda x: vsf.grad(lambda y: (y**3).sum())(x).sum())(torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(second, 6 * torch.tensor([2.0, 3.0]))


def test_non_scalar_value_is_a_clear_error():
    with pytest.raises(TypeError, match="scalar tensor, got \\(3,\\)"):
        vsf.grad(lambda x: x * 2)(torch.ones(3))


def test_op_without_strategy_errors_with_its_line_or_runs_replicated_when_asked(sim, monkeypatch):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x_full = torch.randn(4, 3)
    x = vsf.device_put(x_full, vsf.NamedSharding(mesh, P("dp")))

    # addbmm has neither a DTensor strategy nor a decomposition in PyTorch's tables (an op with a
    # decomposition, such as renorm, is planned through its pieces: tests/jit/test_coverage.py)
    def f(a):
        return torch.addbmm(a, a[None], torch.ones(1, 3, 3)) * 2

    with pytest.raises(ValueError, match=r"aten.addbmm.default has no DTensor sharding strategy.*test_func.py.*addbmm"):
        vsf.jit(f)(x)
    monkeypatch.setattr(vsf.config, "allow_replicated_fallback", True)
    jf = vsf.jit(f)
    assert "no sharding strategy: run replicated" in jf.lower(x).as_text()
    torch.testing.assert_close(vsf.device_get(jf(x)), f(x_full))
