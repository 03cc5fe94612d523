"""``vsf.jit(..., reduce_dtype=torch.float32)`` (FSDP2's ``reduce_dtype``): the bf16 gradients of
a bf16 model are reduced in fp32, each collective at the bytes of fp32 (hand-computed), and the
params after three SGD steps are closer to one device's, whose matmuls accumulate the whole
batch in fp32 before rounding once to bf16. (With fp32 master params cast to bf16 in the step,
the planner may reduce after the cast back to fp32 already; the option covers either.)"""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P, optim

BF16, LR, STEPS = torch.bfloat16, 0.1, 3


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x.to(BF16) @ params["w1"])
    return (h @ params["w2"]).float().square().mean()


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": (torch.randn(16, 32, generator=g) / 4).to(BF16),
        "w2": (torch.randn(32, 16, generator=g) / 6).to(BF16),
    }


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(256, 16, generator=g) for _ in range(STEPS)]


def _oracle() -> dict[str, torch.Tensor]:
    """Plain PyTorch on one device: autograd and torch.optim.SGD, all in bf16."""
    params = {k: v.clone().requires_grad_() for k, v in _params().items()}
    opt = torch.optim.SGD(params.values(), lr=LR)
    for x in _batches():
        opt.zero_grad()
        loss_fn(params, x).backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def _train(mesh, spec, reduce_dtype):
    tx = optim.sgd(LR)

    @vsf.jit(reduce_dtype=reduce_dtype)
    def step(params, opt_state, x):
        grads = vsf.grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state

    params = vsf.device_put(_params(), vsf.NamedSharding(mesh, spec))
    state = optim.init_sharded(tx, params)
    batches = [vsf.device_put(x, vsf.NamedSharding(mesh, P(mesh.axis_names[0]))) for x in _batches()]
    lowered = step.lower(params, state, batches[0])
    for x in batches:
        params, state = step(params, state, x)
    return vsf.device_get(params), lowered


def _error(got, want) -> float:
    return sum((got[k] - want[k]).norm().item() for k in want)


@pytest.mark.parametrize(
    "axis, n, kind, factor", [("dp", 8, "all_reduce", 2 * 7 / 8), ("fsdp", 2, "reduce_scatter", 1 / 2)]
)
def test_bf16_gradients_are_reduced_in_fp32_at_fp32_bytes_and_closer_to_one_device(sim, axis, n, kind, factor):
    want = _oracle()  # (before the simulated ranks start: torch's ops would run on every rank's values)
    sim(n)
    mesh = vsf.make_mesh((n,), (axis,))
    spec = P() if axis == "dp" else P(axis)
    in_bf16, plain = _train(mesh, spec, None)
    in_fp32, lowered = _train(mesh, spec, torch.float32)
    grads = 16 * 32 + 32 * 16  # both weights' gradients, one bucket
    reductions = [c for c in lowered.cost().collectives if c.kind in ("all_reduce", "reduce_scatter")]
    assert [(c.kind, c.dtype, c.bytes) for c in reductions] == [(kind, torch.float32, round(factor * grads * 4))]
    assert [(c.kind, c.dtype, c.bytes) for c in plain.cost().collectives if c.kind == kind] == [
        (kind, BF16, round(factor * grads * 2))
    ]
    assert "sent in float32 (reduce_dtype; bfloat16 before and after)" in lowered.as_text()
    for got in (in_bf16, in_fp32):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=2e-2, atol=2e-3)
    if n > 2:  # two ranks' bf16 sum rounds once, as fp32's then rounded does: the same values
        assert _error(in_fp32, want) < _error(in_bf16, want)


def test_reduce_dtype_must_be_a_floating_dtype():
    with pytest.raises(ValueError, match=r"reduce_dtype must be a floating-point torch.dtype .* got torch.int32"):
        vsf.jit(lambda x: x, reduce_dtype=torch.int32)
