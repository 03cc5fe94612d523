"""FSDP on a GPT (every param ``P("fsdp")`` on dim 0, the batch too): the plan sends the analytic
optimum for each choice of ``reshard_after_forward``, and both give the one-device numbers.

The optimum, by hand under the ring model (bytes each rank sends, :mod:`vsf.jit.cost`): each
param is all-gathered once (``(n-1)/n`` of it) and its gradient reduce-scattered once
(``(n-1)/n``); resharding after forward gathers again, in the backward, every param the backward
reads, which is what autograd saves for it (read here with ``saved_tensors_hooks`` on the plain
module, not from the plan). The mean loss adds two scalar all-reduces: the summed token losses and
the count of counted tokens."""

from __future__ import annotations

import pytest
import torch
from toy_models import GPT, GPTConfig, params_saved_for_backward

import vsf
from vsf import P

CFG = GPTConfig(vocab=32, seq=8, dim=32, heads=4, layers=2, fused_qkv=False)


def _step(model):
    def step(params, idx, tgt):
        return vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(params)

    return step


def _case(sim, n: int):
    model = GPT(CFG)
    params = vsf.tree.from_module(model)
    idx = torch.randint(0, CFG.vocab, (16, CFG.seq))
    tgt = idx.roll(1, 1)
    sim(n)
    mesh = vsf.make_mesh((n,), ("fsdp",))
    sharded = vsf.device_put(params, vsf.NamedSharding(mesh, P("fsdp")))
    batch = vsf.device_put((idx, tgt), vsf.NamedSharding(mesh, P("fsdp")))
    return model, params, (idx, tgt), sharded, batch


def _optimum(model, params, whole, n: int, reshard: bool) -> float:
    ring = (n - 1) / n
    size = {k: p.numel() * p.element_size() for k, p in params.items()}
    again = sum(size[k] for k in params_saved_for_backward(model, *whole)) if reshard else 0
    return ring * (2 * sum(size.values()) + again) + 2 * (2 * ring * 4)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("reshard", [False, True])
def test_fsdp_gpt_sends_the_optimum_for_each_reshard_choice(sim, n, reshard):
    model, params, whole, sharded, batch = _case(sim, n)
    cost = vsf.jit(_step(model), reshard_after_forward=reshard).lower(sharded, *batch).cost()
    assert sum(cost.comm_bytes.values()) == pytest.approx(_optimum(model, params, whole, n, reshard))
    assert cost.count("all_to_all") == 0


def test_both_choices_equal_one_device(sim):
    model, params, whole, sharded, batch = _case(sim, 2)
    want_loss, want_grads = _step(model)(params, *whole)
    for reshard in (False, True):
        loss, grads = vsf.jit(_step(model), reshard_after_forward=reshard)(sharded, *batch)
        torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=1e-6)
        for k, g in vsf.device_get(grads).items():
            torch.testing.assert_close(g, want_grads[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_resharding_gathers_each_layer_again_lowers_the_peak_and_launches_no_more_than_fsdp2(sim):
    """Planned only (shapes, no values): a 3-block GPT whose blocks each about fill a bucket (3 MiB
    of params), 4 ranks. Kept gathered, a block's params live from its forward to its backward;
    resharded, each block is gathered again in the backward (a bucket's worth at a time, with the
    bucket's flat buffers beside it while it runs: with 2 blocks that holds about as much as
    keeping both, so the peak falls from 3 blocks on). Either way the program launches no
    more collectives than FSDP2 with ``fully_shard`` on each block and the root: one all-gather
    per module in the forward (and one more in the backward when resharding), one reduce-scatter
    per module, besides the loss's two scalar all-reduces."""
    cfg = GPTConfig(vocab=256, seq=64, dim=256, heads=4, layers=3, fused_qkv=False)
    model = GPT(cfg)
    sim(4, compute=False)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    sharded = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, P("fsdp")))
    idx = torch.zeros(16, cfg.seq, dtype=torch.long)
    batch = vsf.device_put((idx, idx), vsf.NamedSharding(mesh, P("fsdp")))
    kept, again = (vsf.jit(_step(model), reshard_after_forward=r).lower(sharded, *batch).cost() for r in (False, True))
    assert again.count("all_gather") > kept.count("all_gather") and again.comm_bytes["fsdp"] > kept.comm_bytes["fsdp"]
    assert again.peak_bytes < kept.peak_bytes
    modules = cfg.layers + 1
    for cost, gathers in ((kept, modules), (again, 2 * modules)):
        assert cost.count("all_gather") <= gathers and cost.count("reduce_scatter") <= modules
        assert (
            cost.count("all_reduce") == 2
            and len(cost.collectives) == cost.count("all_gather") + cost.count("reduce_scatter") + 2
        )


def test_a_memory_budget_chooses_resharding_only_when_keeping_would_exceed_it(sim):
    model, params, whole, sharded, batch = _case(sim, 2)
    costs = {r: vsf.jit(_step(model), reshard_after_forward=r).lower(sharded, *batch).cost() for r in (False, True)}
    for budget, chosen in ((costs[False].peak_bytes, False), (costs[False].peak_bytes - 1, True)):
        got = vsf.jit(_step(model), memory_budget=budget).lower(sharded, *batch).cost()
        assert (got.comm_bytes, got.peak_bytes) == (costs[chosen].comm_bytes, costs[chosen].peak_bytes)
