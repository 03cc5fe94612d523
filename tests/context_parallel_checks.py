"""Checks shared by the context-parallel tests (tests/jit, tests/models): the one-device oracle of
a loss and its gradients, and what a plan must say of attention on sequence shards."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

import vsf

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def reference(loss_fn, params, batch):
    """``loss_fn(params, *batch)`` and its gradients by plain torch autograd on one device."""
    watched = vsf.tree.map(lambda t: t.clone().requires_grad_(), params)
    loss = loss_fn(watched, *batch)
    leaves = vsf.tree.leaves(watched)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), vsf.tree.unflatten(vsf.tree.structure(watched), list(grads))


def assert_equal_to_one_device(got, want):
    """``(loss, grads)`` of a sharded run equal :func:`reference`'s (fp32)."""
    loss, grads = got
    want_loss, want_grads = want
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for (path, g), w in zip(vsf.tree.leaves_with_path(grads), vsf.tree.leaves(want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{vsf.tree.keystr(path)}: {m}")


def on_axis(plan, placements, axis="cp"):
    """The placement on mesh axis ``axis`` of a value laid out as ``placements`` in ``plan``."""
    return placements[list(plan.mesh.device_axes).index(axis)]


def attention_plans(plan):
    """The plans of the CPU SDPA kernels and their backward in ``plan``, by op (both must be there)."""
    found = {op: [p for n, p in plan.nodes.items() if n.target is op] for op in (SDPA, SDPA_BACKWARD)}
    assert found[SDPA] and found[SDPA_BACKWARD], "the step traced to no CPU SDPA kernels"
    return found


def assert_attention_on_sequence_shards(plan):
    """Queries, output and log-sum-exp stay split on the sequence over cp; keys and values come whole."""
    found = attention_plans(plan)
    for p in found[SDPA]:
        q, k, v = (on_axis(plan, pl) for pl in p.ins[:3])
        assert (q, k, v) == (Shard(2), Replicate(), Replicate()), p.ins
        assert all(on_axis(plan, o) == Shard(2) for o in p.outs), p.outs
    for p in found[SDPA_BACKWARD]:
        grad_out, q, k, v, out, lse = (on_axis(plan, pl) for pl in p.ins[:6])
        assert (grad_out, q, out, lse) == (Shard(2),) * 4 and (k, v) == (Replicate(),) * 2, p.ins
        assert on_axis(plan, p.outs[0]) == Shard(2), p.outs


def assert_attention_on_a_ring(plan):
    """q, k, v, the output, its log-sum-exp and every gradient stay split on the sequence over cp."""
    for p in [p for found in attention_plans(plan).values() for p in found]:
        assert all(on_axis(plan, pl) == Shard(2) for pl in p.ins), p.ins
        assert all(on_axis(plan, o) == Shard(2) for o in p.outs), p.outs
