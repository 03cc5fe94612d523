"""vsf.shard_map on simulated ranks: per-rank code with explicit collectives equals the unsharded math."""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P

MEGATRON = (P("dp"), P(None, "tp"), P("tp"))


def mlp(x, w1, w2):
    return vsf.ops.psum(torch.relu(x @ w1) @ w2, "tp")


def _case():
    torch.manual_seed(0)
    return torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 4)


def test_megatron_mlp_equals_the_unsharded_mlp(sim):
    x, w1, w2 = _case()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    y = vsf.shard_map(mlp, mesh=mesh, in_specs=MEGATRON, out_specs=P("dp"))(x, w1, w2)
    assert vsf.typeof(y) == "f32[8@dp,4]"
    torch.testing.assert_close(vsf.device_get(y), torch.relu(x @ w1) @ w2)


def test_gradients_through_it_equal_torch_autograd_on_one_device(sim):
    # each weight is replicated over dp (its gradient is summed over dp) and the output over tp
    # (each tp rank sends back a share, psum's backward adds them)
    x, w1, w2 = _case()
    full = [t.clone().requires_grad_() for t in (x, w1, w2)]
    (torch.relu(full[0] @ full[1]) @ full[2]).pow(2).sum().backward()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    params = vsf.device_put((x, w1, w2), tuple(vsf.NamedSharding(mesh, s) for s in MEGATRON))
    step = vsf.shard_map(mlp, mesh=mesh, in_specs=MEGATRON, out_specs=P("dp"))
    grads = vsf.grad(lambda p: step(*p).pow(2).sum())(params)
    for g, t in zip(grads, full):
        torch.testing.assert_close(vsf.device_get(g), t.grad)


def test_inputs_are_laid_out_as_in_specs_and_results_assembled_as_out_specs(sim):
    seen = []

    def f(x, scale):
        seen.append((tuple(x.shape), tuple(scale.shape)))
        return vsf.ops.all_gather(x * scale, "fsdp", dim=1)  # (rows of dp, all columns)

    x, scale = torch.arange(48.0).reshape(4, 12), torch.tensor(3.0)
    sim(8)
    mesh = vsf.make_mesh((2, 4), ("dp", "fsdp"))
    with vsf.use_mesh(mesh):
        y = vsf.shard_map(f, in_specs=(P("dp", "fsdp"), P()), out_specs=P("dp"))(x, scale)
    assert seen == [((2, 3), ())]  # one call, on every rank's local shard at once
    assert vsf.typeof(y) == "f32[4@dp,12]"
    torch.testing.assert_close(vsf.device_get(y), x * 3)


def test_bad_calls_are_refused_saying_where(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"args\[0\] has 5 in dim 0, which P\('dp'\) splits 2 ways"):
        vsf.shard_map(lambda x: x, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))(torch.ones(5))
    with pytest.raises(ValueError, match=r"in_specs is not a prefix"):
        vsf.shard_map(lambda x, y: x, mesh=mesh, in_specs=(P(),), out_specs=P())(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match=r"the result is a DTensor"):
        vsf.shard_map(
            lambda x: vsf.device_put(x, vsf.NamedSharding(mesh, P())), mesh=mesh, in_specs=P(), out_specs=P()
        )(torch.ones(2))
    with pytest.raises(ValueError, match="shard_map needs a mesh"):
        vsf.shard_map(lambda x: x, in_specs=P(), out_specs=P())(torch.ones(2))
    with pytest.raises(
        ValueError,
        match=r"psum over unknown mesh axis 'pp' inside shard_map\(<lambda>\): the mesh has axes \('dp', 'tp'\)",
    ):
        vsf.shard_map(lambda x: vsf.ops.psum(x, "pp"), mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(2))
