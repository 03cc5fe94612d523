"""Custom ops (``torch.library.custom_op``) under ``vsf.jit``: an op whose sharding rules the user
registers with PyTorch's public ``torch.distributed.tensor.experimental.register_sharding`` is
planned sharded with no change to vsf (its backward, a second custom op with rules of its own,
included), and trains like one device; an op with no rule is a ``PlanError`` that names the
user's line that called it (not torch's autograd wrapper of custom ops)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import vsf
from vsf import P, optim


@torch.library.custom_op("vsf_test::gated_tanh", mutates_args=())
def gated_tanh(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``tanh(x) * gate``, ``gate`` one value per feature (``x``'s last dim)."""
    return torch.tanh(x) * gate


@gated_tanh.register_fake
def _(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("vsf_test::gated_tanh_backward", mutates_args=())
def gated_tanh_backward(grad: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`gated_tanh` for ``x`` and for ``gate`` (summed over every row)."""
    t = torch.tanh(x)
    return grad * gate * (1 - t * t), (grad * t).reshape(-1, gate.shape[0]).sum(0)


@gated_tanh_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(gate)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


gated_tanh.register_autograd(
    lambda ctx, grad: gated_tanh_backward(grad, *ctx.saved_tensors), setup_context=_save_inputs
)


@register_sharding(torch.ops.vsf_test.gated_tanh.default)
def _gated_tanh_rules(x, gate):
    """(output placements, input placements): replicated; split over features (the gate with
    them); split over any other dim of ``x`` (the gate whole)."""
    features = x.ndim - 1
    return [([Replicate()], [Replicate(), Replicate()]), ([Shard(features)], [Shard(features), Shard(0)])] + [
        ([Shard(d)], [Shard(d), Replicate()]) for d in range(features)
    ]


@register_sharding(torch.ops.vsf_test.gated_tanh_backward.default)
def _gated_tanh_backward_rules(grad, x, gate):
    """As the forward's; over rows, the gate's gradient is a partial sum."""
    features = x.ndim - 1
    return [
        ([Replicate(), Replicate()], [Replicate()] * 3),
        ([Shard(features), Shard(0)], [Shard(features), Shard(features), Shard(0)]),
    ] + [([Shard(d), Partial()], [Shard(d), Shard(d), Replicate()]) for d in range(features)]


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return gated_tanh(x @ p["w1"], p["gate"]) @ p["w2"]


def loss_fn(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(mlp(p, batch["x"]), batch["y"])


LR, STEPS = 1e-2, 3
# layout: (mesh shape, axis names, param specs, batch spec); on dp x tp the op's operand is split
# over its features (tp, after the column-parallel w1) and its rows (dp)
LAYOUTS = {
    "dp": ((2,), ("dp",), {"w1": P(), "gate": P(), "w2": P()}, P("dp")),
    "dp_tp": ((2, 2), ("dp", "tp"), {"w1": P(None, "tp"), "gate": P("tp"), "w2": P("tp")}, P("dp")),
}


def _case() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = {"w1": torch.randn(8, 16) / 3, "gate": torch.randn(16), "w2": torch.randn(16, 8) / 4}
    batches = [{"x": torch.randn(4, 6, 8), "y": torch.randn(4, 6, 8)} for _ in range(STEPS)]
    return params, batches


def _torch_trained(params: dict[str, torch.Tensor], batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(p.values(), lr=LR)
    for batch in batches:
        opt.zero_grad()
        loss_fn(p, batch).backward()
        opt.step()
    return {k: v.detach() for k, v in p.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_registered_rules_plan_it_sharded_and_it_trains_like_one_device(sim, layout):
    params, batches = _case()
    want = _torch_trained(params, batches)
    shape, axes, specs, batch_spec = LAYOUTS[layout]
    sim(len(axes) * 2)
    mesh = vsf.make_mesh(shape, axes)
    tx = optim.adamw(LR)

    @vsf.jit
    def step(p, s, batch):
        grads = vsf.grad(loss_fn)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s

    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    s = optim.init_sharded(tx, p)
    for batch in batches:
        batch = vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec))
        p, s = step(p, s, batch)
    plan = step.lower(p, s, batch).as_text()
    split = "4@dp,6,16@tp" if layout == "dp_tp" else "4@dp,6,16"
    for op in ("gated_tanh", "gated_tanh_backward"):  # the op and its backward ran on shards
        assert re.search(rf"= {op}\(%\w+:f32\[{split}\]", plan), plan
    got = vsf.device_get(p)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{layout} {k}: {m}")


@torch.library.custom_op("vsf_test::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


doubled.register_autograd(lambda ctx, grad: grad * 2)


def _unruled_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return doubled(x @ w).sum()


def test_an_op_without_rules_is_a_plan_error_naming_the_line_that_called_it(sim):
    lines, first = inspect.getsourcelines(_unruled_loss)
    line = first + next(i for i, text in enumerate(lines) if "doubled(x @ w)" in text)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    w, x = torch.randn(4, 4), vsf.device_put(torch.randn(8, 4), vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(vsf.PlanError, match="no DTensor sharding strategy") as e:
        vsf.jit(vsf.grad(_unruled_loss))(vsf.device_put(w, vsf.NamedSharding(mesh, P())), x)
    assert f'{__file__}", line {line}, in _unruled_loss' in str(e.value), str(e.value)
    assert "torch/_library" not in str(e.value)
