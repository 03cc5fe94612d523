"""Context parallelism inside vsf.jit: with the tokens' sequence dim sharded over ``cp``, attention
runs on sequence shards (keys and values gathered over ``cp``, queries and the output left split)
and the result's sequence dim stays on ``cp``. Oracle: the same step run unsharded on one device
(fp32); the plan is read from ``step.lower(...)``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import vsf
from vsf import P

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

MESHES = {
    "cp2": ((2,), ("cp",), P(None, "cp")),
    "cp4": ((4,), ("cp",), P(None, "cp")),
    "cp2_tp2": ((2, 2), ("cp", "tp"), P(None, "cp")),
    "dp2_cp2": ((2, 2), ("dp", "cp"), P("dp", "cp")),
}
MEGATRON = [(r"(q|k|v)\.weight", P("tp")), (r"proj\.weight", P(None, "tp")), (r".*", P())]


class SDPABlock(nn.Module):
    """A GPT-like attention block on SDPA, with ``kv_heads`` key/value heads (grouped-query when fewer than ``heads``)."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 4, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.causal = heads, kv_heads, dim // heads, causal
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _block_case(causal: bool, kv_heads: int, seq: int = 16, batch: int = 4):
    module = SDPABlock(kv_heads=kv_heads, causal=causal)
    params = vsf.tree.from_module(module)
    x, y = torch.randn(batch, seq, 32), torch.randn(batch, seq, 32)

    def loss_fn(p, x, y):
        return ((vsf.tree.apply(module, p, x) - y) ** 2).mean()

    return params, (x, y), loss_fn


def _step(loss_fn):
    def step(params, *batch):
        return vsf.value_and_grad(loss_fn)(params, *batch)

    return step


def _reference(loss_fn, params, batch):
    watched = vsf.tree.map(lambda t: t.clone().requires_grad_(), params)
    loss = loss_fn(watched, *batch)
    leaves = vsf.tree.leaves(watched)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), vsf.tree.unflatten(vsf.tree.structure(watched), list(grads))


def _run(sim, layout, params, batch, loss_fn, rules=None):
    """The step jitted on ``layout`` (batch laid out by its spec, params by ``rules``): gathered results and the plan."""
    shape, names, batch_spec = MESHES[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    rules = rules if "tp" in names else [(r".*", P())]
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec))
    jitted = vsf.jit(_step(loss_fn))
    plan = jitted.lower(p, *b).plan
    return vsf.device_get(jitted(p, *b)), plan


def _assert_equal_to_one_device(got, want):
    loss, grads = got
    want_loss, want_grads = want
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for (path, g), w in zip(vsf.tree.leaves_with_path(grads), vsf.tree.leaves(want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{vsf.tree.keystr(path)}: {m}")


def _on_axis(plan, placements, axis="cp"):
    return placements[list(plan.mesh.device_axes).index(axis)]


def _attention_plans(plan):
    found = {op: [p for n, p in plan.nodes.items() if n.target is op] for op in (SDPA, SDPA_BACKWARD)}
    assert found[SDPA] and found[SDPA_BACKWARD], "the step traced to no CPU SDPA kernels"
    return found


def assert_attention_on_sequence_shards(plan):
    """Queries, output and log-sum-exp stay split on the sequence over cp; keys and values come whole."""
    found = _attention_plans(plan)
    for p in found[SDPA]:
        q, k, v = (_on_axis(plan, pl) for pl in p.ins[:3])
        assert (q, k, v) == (Shard(2), Replicate(), Replicate()), p.ins
        assert all(_on_axis(plan, o) == Shard(2) for o in p.outs), p.outs
    for p in found[SDPA_BACKWARD]:
        grad_out, q, k, v, out, lse = (_on_axis(plan, pl) for pl in p.ins[:6])
        assert (grad_out, q, out, lse) == (Shard(2),) * 4 and (k, v) == (Replicate(),) * 2, p.ins
        assert _on_axis(plan, p.outs[0]) == Shard(2), p.outs


def _attention_loss(q, k, v, causal):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def _qkv_case(causal: bool, kv_heads: int, seq: int = 16, heads: int = 4):
    q = torch.randn(4, heads, seq, 8)
    k, v = torch.randn(2, 4, kv_heads, seq, 8).unbind(0)
    return {"q": q, "k": k, "v": v}, (), lambda p: _attention_loss(p["q"], p["k"], p["v"], causal)


QKV_SPECS = {"cp2": P(None, None, "cp"), "cp4": P(None, None, "cp"), "cp2_tp2": P(None, "tp", "cp"), "dp2_cp2": P("dp", None, "cp")}


def _run_qkv(sim, layout, params, loss_fn):
    """The attention step jitted with q, k and v laid out as ``QKV_SPECS[layout]``."""
    shape, names, _ = MESHES[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    p = vsf.device_put(params, vsf.NamedSharding(mesh, QKV_SPECS[layout]))
    jitted = vsf.jit(_step(loss_fn))
    plan = jitted.lower(p).plan
    return vsf.device_get(jitted(p)), plan


CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_attention_on_sequence_shards_equals_one_device(sim, layout, kv_heads, causal):
    params, batch, loss_fn = _qkv_case(causal=causal, kv_heads=kv_heads)
    want = _reference(loss_fn, params, batch)
    got, _ = _run_qkv(sim, layout, params, loss_fn)
    _assert_equal_to_one_device(got, want)


@CAUSAL
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_grouped_query_attention_gathers_only_keys_and_values_over_cp(sim, layout, causal):
    """With 2 key/value heads for 8 query heads, gathering k and v (and reduce-scattering their
    gradients) sends less than gathering q too. (With as many key/value heads, attention alone
    with nothing else in the step is cheaper in bytes fully gathered, with no gradient to reduce:
    the cost model counts bytes, not the work each rank repeats; in a block it splits, below.)"""
    params, batch, loss_fn = _qkv_case(causal=causal, kv_heads=2, heads=8)
    _, plan = _run_qkv(sim, layout, params, loss_fn)
    assert_attention_on_sequence_shards(plan)


@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["cp2", "cp4", "cp2_tp2"])
def test_an_attention_block_keeps_its_tokens_split_on_cp(sim, layout, kv_heads, causal):
    """A GPT-like block (projections, heads, SDPA) on one sequence: only keys and values are
    gathered. (A batch of several sequences split on cp merges into a strided shard of the
    projections' rows, which the planner does not keep through ``mm`` yet.)"""
    params, batch, loss_fn = _block_case(causal=causal, kv_heads=kv_heads, batch=1)
    want = _reference(loss_fn, params, batch)
    got, plan = _run(sim, layout, params, batch, loss_fn, MEGATRON)
    _assert_equal_to_one_device(got, want)
    assert_attention_on_sequence_shards(plan)


@pytest.mark.parametrize("seq", [10, 6], ids=["uneven", "an-empty-shard"])
def test_causal_attention_on_uneven_sequence_shards_is_gathered_and_equals_one_device(sim, seq):
    """10 positions over 4 ranks are 3, 3, 3, 1 (6: 2, 2, 2, 0): the split is not offered, q is gathered."""
    params, batch, loss_fn = _qkv_case(causal=True, kv_heads=2, heads=8, seq=seq)
    want = _reference(loss_fn, params, batch)
    got, plan = _run_qkv(sim, "cp4", params, loss_fn)
    _assert_equal_to_one_device(got, want)
    for p in _attention_plans(plan)[SDPA]:
        assert _on_axis(plan, p.ins[0]) != Shard(2), p.ins


def test_dtensor_never_runs_causal_attention_on_query_shards(sim):
    """DTensor is told the query split only for full attention: eager DTensor SDPA on sequence
    shards, causal or not, equals one device (a causal kernel on a later shard would mask from
    that shard's first query)."""
    from torch.distributed.tensor import distribute_tensor

    q, k, v = torch.randn(3, 2, 4, 8, 8).unbind(0)
    sim(2)
    mesh = vsf.make_mesh((2,), ("cp",)).device_mesh
    placed = [distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v)]
    for causal in (False, True):
        got = F.scaled_dot_product_attention(*placed, is_causal=causal).full_tensor()
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(vsf.device_get(got), want, rtol=1e-5, atol=1e-6)
