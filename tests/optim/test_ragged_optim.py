"""Computing on ragged DTensors (simulated ranks): eager math, vsf.optim, and flat-buffer FSDP.

Oracles: the same computation on the unsharded tensors (torch ops, torch.optim.AdamW with
clip_grad_norm_), hand-computed byte counts, and collectives counted at vsf's backend.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import vsf
from vsf import P, _compat, optim
from vsf.ops import backend
from vsf.sharding import NamedSharding, eager, sharding_of
from test_optim import MASK, TOL, _grads, _params, run_torch

ragged = vsf.ragged
STEPS = 6


@pytest.fixture
def calls(monkeypatch):
    """Counts of vsf's backend collectives (ragged ones all go through ``exchange``)."""
    seen = collections.Counter()
    for fn in ("exchange", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        original = getattr(backend, fn)
        monkeypatch.setattr(backend, fn, lambda *a, _f=original, _n=fn, **k: (seen.update([_n]), _f(*a, **k))[1])
    return seen


# -- eager math ----------------------------------------------------------------------------------------


def test_elementwise_and_reductions_match_unsharded(sim, calls):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    s = NamedSharding(mesh, P(ragged("fsdp", (1, 3)), "tp"))
    x, y = vsf.device_put(a, s), vsf.device_put(b, s)
    scalar = vsf.device_put(torch.tensor(0.5), NamedSharding(mesh, P()))
    z = eager.elementwise(lambda u, v, c, k: u * v + c * k, x, y, scalar, 2.0)
    total = eager.sum(x)
    assert calls == {"all_reduce": 2}  # elementwise math is local; the sum: one psum over fsdp (rows), one over tp
    assert sharding_of(z) == s and torch.allclose(vsf.device_get(z), a * b + 0.5 * 2.0)
    assert vsf.typeof(total) == "f32[]" and torch.allclose(vsf.device_get(total), a.sum())
    for dim, keepdim, typ in [(1, False, "f32[8@fsdp~(1,3)]"), (0, True, "f32[1,6@tp]"), ((0, 1), False, "f32[]")]:
        m = eager.mean(x, dim, keepdim)
        assert vsf.typeof(m) == typ and torch.allclose(vsf.device_get(m), a.mean(dim, keepdim))
    for p in (1, 2, 3.0, math.inf):
        torch.testing.assert_close(vsf.device_get(eager.norm(x, p)), torch.linalg.vector_norm(a, p))
    c = torch.randn(2, 8, 5)
    w = vsf.device_put(c, NamedSharding(mesh, P(ragged("fsdp", (3, 1), dims=2, block=4))))
    assert torch.allclose(vsf.device_get(eager.sum(w, (0, 1))), c.sum((0, 1)))
    assert torch.allclose(vsf.device_get(eager.mean(w, 2, keepdim=True)), c.mean(2, keepdim=True))


def test_eager_errors(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    x = vsf.device_put(torch.randn(8, 6), NamedSharding(mesh, P(ragged("fsdp", (1, 3)))))
    y = vsf.device_put(torch.randn(8, 6), NamedSharding(mesh, P(ragged("fsdp", (3, 1)))))
    with pytest.raises(
        ValueError,
        match=r"argument 1 has shape \(8, 6\) laid out as P\(RaggedShard\('fsdp', units=\(3, 1\).*device_put one",
    ):
        eager.elementwise(torch.add, x, y)
    with pytest.raises(ValueError, match=r"argument 1 is a plain tensor of shape \(8, 6\)"):
        eager.elementwise(torch.add, x, torch.ones(8, 6))
    w = vsf.device_put(torch.randn(2, 8, 5), NamedSharding(mesh, P(ragged("fsdp", (1, 1), dims=2))))
    with pytest.raises(
        ValueError, match=r"flattens dims 0..1 into rows; a reduction must cover all of them or none, got dim=\(0,\)"
    ):
        eager.sum(w, 0)
    with pytest.raises(ValueError, match="dim 3 is out of range for a tensor of rank 3"):
        eager.mean(w, 3)
    u = vsf.device_put(torch.randn(8, 6), NamedSharding(mesh, P(ragged("fsdp", (1, 3)), unreduced="tp")))
    with pytest.raises(ValueError, match="norm of an unreduced value"):
        eager.norm(u)


# -- vsf.optim on ragged params ---------------------------------------------------------------------------

SPECS = {  # w: (16, 8), b: (8,), e: (4, 8)
    "w": P(ragged("fsdp", (1, 2, 1, 0))),
    "b": P(ragged("fsdp", (0, 1, 0, 1))),
    "e": P(ragged("fsdp", (3, 0, 0, 1), dims=2, block=2)),
}


@pytest.mark.parametrize("grads_as", ["ragged", "partial", "replicated"])
def test_clip_adamw_on_ragged_params_match_torch(sim, grads_as):
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    params, tx = _params(), optim.chain(optim.clip_by_global_norm(5.0), optim.adamw(1e-2, weight_decay=0.1, mask=MASK))
    grads = _grads(params, STEPS)
    layout = NamedSharding.tree(mesh, SPECS)
    placed = vsf.device_put(params, layout)
    state = tx.init(placed)
    arrive = {
        "ragged": layout,
        "partial": NamedSharding(mesh, P(unreduced="fsdp")),
        "replicated": NamedSharding(mesh, P()),
    }[grads_as]
    for g in grads:
        updates, state = tx.update(vsf.device_put(g, arrive), state, placed)
        placed = optim.apply_updates(placed, updates)
    assert all(sharding_of(placed[k]) == layout[k] for k in params)
    assert all(sharding_of(state[1].mu[k]) == layout[k] for k in params)
    want = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads, mask=MASK, clip=5.0)
    full = vsf.device_get(placed)
    for k in params:
        torch.testing.assert_close(full[k], want[k], **TOL)


def test_global_norm_is_one_reduction_per_axis_and_state_bytes_are_exact(sim, calls):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    specs = {"w": P(ragged("fsdp", (1, 3))), "b": P(ragged("fsdp", (1, 0))), "e": P(ragged("fsdp", (0, 1)), "dp")}
    layout = NamedSharding.tree(mesh, specs)
    params = vsf.device_put(_params(), layout)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    state = tx.init(params)
    grads = vsf.device_put(_grads(_params(), 1)[0], layout)
    with CommDebugMode() as cm:
        tx.update(grads, state, params)
    assert {str(op).split(".")[-1]: k for op, k in cm.get_comm_counts().items()} == {"all_reduce": 2}  # dp and fsdp
    assert calls == {}  # nothing gathered, nothing moved
    # elements of one moment by fsdp index: w rows 4 | 12 of 8; b 8 | 0; e rows 0 | 4 of 8 columns halved by dp
    per = {0: 4 * 8 + 8 + 0, 1: 12 * 8 + 0 + 4 * 4}
    assert vsf.debug.memory_report(state) == {
        r: 2 * 4 * per[r % 2] + 4 for r in range(4)
    }  # mu, nu in f32; the int32 count


# -- flat-buffer FSDP -------------------------------------------------------------------------------------

GROUP = {"wq": (64, 48), "b": (48,), "w2": (96, 48), "norm": (48,), "emb": (40, 48)}


def test_ragged_plan_balances_bytes_in_whole_blocks(sim):
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    params = {k: torch.randn(shape, dtype=torch.float64 if k == "emb" else torch.float32) for k, shape in GROUP.items()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    for block, slack in [(None, 48 * 8), (8, 8 * 48 * 8)]:  # within one block (the largest) of the mean
        plan = vsf.sharding.ragged_plan(params, "fsdp", block=block, mesh=mesh)
        placed = vsf.device_put(params, plan)
        report = vsf.debug.memory_report(placed)
        assert sum(report.values()) == total
        assert max(report.values()) - total / 4 <= slack, (block, report)
        for k, s in plan.items():
            rows = s.spec.ragged.row_counts(params[k].shape)
            assert all(r % (block or 1) == 0 for r in rows)  # whole blocks
    whole = vsf.sharding.ragged_plan(params, "fsdp", block="leaf", mesh=mesh)
    owners = {k: [i for i, u in enumerate(s.spec.ragged.units) if u] for k, s in whole.items()}
    # largest first onto the least loaded rank: w2 18432 B -> 0, emb 15360 -> 1, wq 12288 -> 2, b and norm (192) -> 3
    assert owners == {"w2": [0], "emb": [1], "wq": [2], "b": [3], "norm": [3]}
    with pytest.raises(ValueError, match=r"block=32 rows does not divide the 40 rows of params leaf emb"):
        vsf.sharding.ragged_plan(
            params, "fsdp", block={"b": None, "norm": None, "emb": 32, "wq": 32, "w2": 32}, mesh=mesh
        )
    with pytest.raises(ValueError, match=r"leaf x has shape \(\); a ragged split needs rows"):
        vsf.sharding.ragged_plan({"x": torch.tensor(1.0)}, "fsdp", mesh=mesh)
    with pytest.raises(ValueError, match="balances one of"):
        vsf.sharding.ragged_plan(params, "fsdp", balance="flops", mesh=mesh)


def test_gather_group_is_one_collective_and_exact(sim, calls):
    sim(8)
    mesh = vsf.make_mesh((2, 4), ("tp", "fsdp"))
    params = {k: torch.randn(shape, dtype=torch.float64 if k == "emb" else torch.float32) for k, shape in GROUP.items()}
    plan = vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh)
    plan = {
        k: NamedSharding(mesh, P(s.spec.ragged, "tp")) if len(GROUP[k]) == 2 else s for k, s in plan.items()
    }  # FSDP x TP
    placed = vsf.device_put(params, plan)
    calls.clear()
    full = vsf.sharding.gather_group(placed)
    assert calls == {"exchange": 1}
    for k in params:
        assert sharding_of(full[k]) == vsf.sharding.ragged.without_ragged(plan[k])
        assert full[k].dtype == params[k].dtype and torch.equal(vsf.device_get(full[k]), params[k])
    grads = {
        k: vsf.device_put(torch.ones(shape), NamedSharding(mesh, P(*sharding_of(full[k]).spec, unreduced="fsdp")))
        for k, shape in GROUP.items()
    }
    calls.clear()
    reduced = vsf.sharding.reduce_scatter_group(grads, placed)
    assert calls == {"exchange": 1}
    for k in params:
        assert sharding_of(reduced[k]) == plan[k] and torch.equal(vsf.device_get(reduced[k]), torch.ones(GROUP[k]))


def test_fsdp_step_with_one_gather_and_one_reduce_matches_torch(sim):
    """An MLP trained with params packed by ragged_plan: gather the group, run each rank's quarter
    of the batch, reduce-scatter the gradients, AdamW on the ragged shards; against
    torch.optim.AdamW on the whole batch."""
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    params = {"w1": torch.randn(12, 6) / 3, "b1": torch.zeros(12), "w2": torch.randn(3, 12) / 3}
    xs, ts = torch.randn(STEPS, 8, 6), torch.randn(STEPS, 8, 3)

    def loss_fn(p: dict, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T
        return ((y - t) ** 2).sum() / 8  # the mean over the whole batch of 8: ranks' parts add up

    with _compat.local_mode_disabled():
        ref = {k: v.clone().requires_grad_() for k, v in params.items()}
        opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1, foreach=True)
        for x, t in zip(xs, ts):
            opt.zero_grad()
            loss_fn(ref, x, t).backward()
            opt.step()
    tx = optim.adamw(1e-2, weight_decay=0.1)
    placed = vsf.device_put(params, vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh))
    state = tx.init(placed)
    batch = NamedSharding(mesh, P("fsdp"))
    for x, t in zip(xs, ts):
        full = {k: v.to_local().requires_grad_() for k, v in vsf.sharding.gather_group(placed).items()}
        mine = loss_fn(full, vsf.device_put(x, batch).to_local(), vsf.device_put(t, batch).to_local())
        grads = vsf.sharding.reduce_scatter_group(
            dict(zip(full, torch.autograd.grad(mine, list(full.values())))), placed
        )
        updates, state = tx.update(grads, state, placed)
        placed = optim.apply_updates(placed, updates)
    got = vsf.device_get(placed)
    for k in params:
        torch.testing.assert_close(got[k], ref[k].detach(), rtol=1e-5, atol=1e-6)
