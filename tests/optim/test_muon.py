"""vsf.optim.muon: against the public reference on one device, and sharded on simulated ranks
against itself on one device, with each matrix orthogonalised by its owner only.

The oracle below is the reference's math written out in plain torch (Keller Jordan's Muon,
github.com/KellerJordan/Muon ``muon.py``: ``zeropower_via_newtonschulz5``, ``muon_update``,
``SingleDeviceMuonWithAuxAdam``), with torch.optim.AdamW (the reference's defaults) for the
other leaves.
"""

from __future__ import annotations

import collections

import pytest
import torch

import vsf
from vsf import P, optim
from vsf.ops import backend
from vsf.sharding import NamedSharding, sharding_of

STEPS = 3


def reference_orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    if g.size(0) > g.size(1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if g.size(0) > g.size(1) else x


def reference(params: dict, grads: list[dict], lr: float = 0.02, beta: float = 0.95, wd: float = 0.0) -> dict:
    p = {k: v.clone() for k, v in params.items()}
    buf = {k: torch.zeros_like(v) for k, v in p.items() if v.ndim == 2}
    adam = torch.optim.AdamW(
        [p[k].requires_grad_() for k in p if p[k].ndim != 2],
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-10,
        weight_decay=0.0,
        foreach=True,
    )
    for g in grads:
        for k in p:
            if p[k].ndim != 2:
                p[k].grad = g[k].clone()
                continue
            grad = g[k].clone()
            buf[k].lerp_(grad, 1 - beta)
            u = reference_orthogonalize(grad.lerp_(buf[k], beta))
            u *= max(1, grad.size(0) / grad.size(1)) ** 0.5
            with torch.no_grad():
                p[k].mul_(1 - lr * wd).add_(u, alpha=-lr)
        adam.step()
    return {k: v.detach() for k, v in p.items()}


def _params() -> dict[str, torch.Tensor]:
    # Newton-Schulz costs (min^2 * max): a 8192, c 12288, d 13824, e 2560
    return {
        "a": torch.randn(32, 16),
        "b": torch.randn(16),
        "c": torch.randn(16, 48),
        "d": torch.randn(24, 24),
        "e": torch.randn(8, 40),
    }


def _grads(params: dict) -> list[dict]:
    return [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(STEPS)]


def run(tx: optim.GradientTransformation, params: dict, grads: list[dict], place=lambda g: g) -> dict:
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(place(g), state, params)
        params = optim.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_one_device_matches_the_reference(wd):
    params = _params()
    grads = _grads(params)
    got = run(optim.muon(0.02, weight_decay=wd), params, grads)
    want = reference(params, grads, wd=wd)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_newton_schulz_is_the_reference_iteration():
    g = torch.randn(40, 24)
    assert torch.equal(optim.newton_schulz(g), reference_orthogonalize(g))
    s = torch.linalg.svdvals(optim.newton_schulz(g).float())
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's "roughly orthogonal" (reference's docstring)


LAYOUTS = {  # how the params (and their gradients) are laid out on 4 ranks
    "rows": lambda params, mesh: vsf.sharding.ragged_plan(params, "fsdp", mesh=mesh),
    "shard": lambda params, mesh: {k: NamedSharding(mesh, P("fsdp")) for k in params},
    "replicated": lambda params, mesh: {k: NamedSharding(mesh, P()) for k in params},
}
# Largest cost first onto the least loaded rank: d -> 0, c -> 1, a -> 2, e -> 3. With "rows", the
# plan already holds a (2048 B of a 2192 B mean) whole on rank 0 and e whole on rank 3: they stay
# there, then d -> 1 and c -> 2.
OWNERS = {
    "rows": {"a": {0}, "d": {1}, "c": {2}, "e": {3}},
    "shard": {"d": {0}, "c": {1}, "a": {2}, "e": {3}},
    "replicated": {"d": {0}, "c": {1}, "a": {2}, "e": {3}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_four_ranks_equal_one_device_and_each_matrix_has_one_owner(sim, layout):
    params = _params()
    grads = _grads(params)
    want = run(optim.muon(0.02, weight_decay=0.1), params, grads)
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    shardings = LAYOUTS[layout](params, mesh)
    seen: list[tuple[int, str]] = []
    tx = optim.muon(0.02, weight_decay=0.1, axis="fsdp", on_orthogonalize=lambda rank, path: seen.append((rank, path)))
    got = run(tx, vsf.device_put(params, shardings), grads, lambda g: vsf.device_put(g, shardings))
    assert all(sharding_of(got[k]) == shardings[k] for k in params)
    full = vsf.device_get(got)
    for k in params:
        assert torch.equal(full[k], want[k]), k
    owners = {path: {r for r, p in seen if p == path} for _, path in seen}
    assert owners == OWNERS[layout]
    if layout == "rows":
        assert [shardings[k].spec.ragged.units for k in ("a", "e")] == [(32, 0, 0, 0), (0, 0, 0, 8)]
    assert collections.Counter(seen) == {
        (r, p): STEPS for p, rs in owners.items() for r in rs
    }  # once per step, nowhere else


def test_matrices_whole_on_a_rank_are_orthogonalised_there_without_moving(sim, monkeypatch):
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    params = _params()
    grads = _grads(params)
    plan = vsf.sharding.ragged_plan(params, "fsdp", block="leaf", mesh=mesh)
    holders = {k: next(i for i, u in enumerate(s.spec.ragged.units) if u) for k, s in plan.items()}
    seen: list[tuple[int, str]] = []
    tx = optim.muon(on_orthogonalize=lambda rank, path: seen.append((rank, path)))
    placed = vsf.device_put(params, plan)
    state = tx.init(placed)
    moved = collections.Counter()
    original = backend.exchange
    monkeypatch.setattr(backend, "exchange", lambda *a, **k: (moved.update(["exchange"]), original(*a, **k))[1])
    updates, state = tx.update(vsf.device_put(grads[0], plan), state, placed)
    assert moved == {}
    assert sorted(seen) == sorted((holders[k], k) for k in ("a", "c", "d", "e"))
    want = run(optim.muon(), params, grads[:1])
    got = vsf.device_get(optim.apply_updates(placed, updates))
    for k in params:
        assert torch.equal(got[k], want[k]), k


def test_errors(sim):
    tx = optim.scale_by_muon()
    with pytest.raises(ValueError, match=r"leaf b has shape \(16,\); mask it out"):
        tx.init(_params())
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    w = {"w": vsf.device_put(torch.randn(8, 8), NamedSharding(mesh, P("dp", "tp")))}
    with pytest.raises(
        ValueError, match=r"laid out as P\('dp', 'tp'\) is split over \['dp', 'tp'\]; pass muon\(..., axis=...\)"
    ):
        tx.update(w, tx.init(w), w)


def test_matrices_only_and_empty_trees():
    """Muon over params that are all matrices leaves AdamW's masked part empty; that, and any
    optimizer on an empty tree, must work (it failed unpacking the results of no leaves)."""
    params = _params()
    grads = _grads(params)
    matrices = {k: v for k, v in params.items() if v.ndim == 2}
    got = run(optim.muon(0.02), matrices, [{k: g[k] for k in matrices} for g in grads])
    want = reference(params, grads)  # each matrix's update depends only on its own gradients
    for k in matrices:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
    for tx in (optim.adamw(1e-3), optim.lion(1e-3), optim.sgd(0.1, momentum=0.9)):
        assert run(tx, {}, [{}]) == {}
