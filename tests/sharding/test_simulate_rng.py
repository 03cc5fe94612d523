"""Explicit ``torch.Generator``s under ``vsf.simulate`` draw what separate processes would.

The oracle is the same calls in this plain process: under ``torchrun`` every process seeds its
own generator alike and draws the same numbers, so every simulated rank must hold exactly
those numbers, and the generator must end in the state one process leaves it in.
"""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P
from toy_models import GPT, GPTConfig

SEED = 7

DRAWS = {
    "randint": lambda g: torch.randint(1, 64, (4, 16), generator=g),
    "randn": lambda g: torch.randn(3, 5, generator=g),
    "rand": lambda g: torch.rand(7, generator=g),
    "randperm": lambda g: torch.randperm(10, generator=g),
    "normal_": lambda g: torch.empty(3, 4).normal_(2.0, 0.5, generator=g),
    "uniform_": lambda g: torch.empty(5).uniform_(-1.0, 1.0, generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((4, 8), 0.3), generator=g),
    "normal": lambda g: torch.normal(torch.zeros(6), torch.ones(6), generator=g),
    "multinomial": lambda g: torch.multinomial(torch.tensor([0.1, 0.2, 0.7]), 5, replacement=True, generator=g),
    "init.kaiming_uniform_": lambda g: torch.nn.init.kaiming_uniform_(torch.empty(4, 3), generator=g),
    "randn out=": lambda g: torch.randn(2, 3, generator=g, out=torch.empty(2, 3)),
    "rrelu_with_noise": lambda g: _rrelu_and_noise(g),
}


def _rrelu_and_noise(g):
    """A fresh result and an argument written in place (the noise), both drawn from ``g``."""
    noise = torch.empty(6)
    y = torch.ops.aten.rrelu_with_noise(torch.linspace(-1.0, 1.0, 6), noise, 0.1, 0.3, True, generator=g)
    return torch.stack([y, noise])


def plain(draw, times=2):
    """``times`` draws from a freshly seeded generator in this process, and the generator's state after."""
    g = torch.Generator().manual_seed(SEED)
    return [draw(g) for _ in range(times)], g.get_state()


def per_rank(x):
    """Each simulated rank's value of ``x`` (a plain tensor, made from plain inputs, is every rank's)."""
    shards = {s.rank: s.data for s in vsf.debug.shards(x)}
    return shards if len(shards) > 1 else {r: shards[0] for r in range(vsf.runtime.world_size())}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_every_rank_draws_what_one_process_draws(sim, name):
    want, want_state = plain(DRAWS[name])
    sim(2)
    g = torch.Generator().manual_seed(SEED)
    got = [DRAWS[name](g) for _ in want]
    for draw, (a, b) in enumerate(zip(got, want)):
        for r, v in per_rank(a).items():
            assert torch.equal(v, b), f"{name}: draw {draw} on rank {r} differs from a plain process's"
    assert torch.equal(g.get_state(), want_state)


def test_reseeding_inside_the_simulation_restarts_every_rank(sim):
    want, _ = plain(DRAWS["randn"], times=1)
    sim(2)
    g = torch.Generator().manual_seed(SEED + 1)
    torch.randn(5, generator=g)
    g.manual_seed(SEED)
    for v in per_rank(DRAWS["randn"](g)).values():
        assert torch.equal(v, want[0])


def test_draws_of_different_sizes_per_rank_keep_each_rank_its_own_state(sim):
    # 3 rows on 2 ranks: rank 0 draws 2 numbers, rank 1 one, so their generators part; a later
    # draw on each rank continues from where that rank's own process would be.
    def process(rows):
        g = torch.Generator().manual_seed(SEED)
        return torch.bernoulli(torch.full((rows,), 0.5), generator=g), torch.rand(4, generator=g), g.get_state()

    (a0, b0, state0), (a1, b1, _) = process(2), process(1)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    g = torch.Generator().manual_seed(SEED)
    probs = vsf.device_put(torch.full((3,), 0.5), vsf.NamedSharding(mesh, P("dp"))).to_local()
    mask = per_rank(torch.bernoulli(probs, generator=g))
    assert torch.equal(mask[0], a0) and torch.equal(mask[1], a1)
    later = per_rank(torch.rand(4, generator=g))
    assert torch.equal(later[0], b0) and torch.equal(later[1], b1)
    assert torch.equal(g.get_state(), state0)  # rank 0's, as its process leaves it


def test_shuffling_data_loader_with_a_generator_gives_one_process_batches(sim):
    # the sampler draws a permutation from the generator; ranks that drew different ones held
    # per-rank indices, which indexing a dataset refuses
    data = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(10, 2))

    def batches():
        loader = torch.utils.data.DataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(SEED)
        )
        return [b for (b,) in loader]

    want = batches()
    sim(2)
    got = batches()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert all(torch.equal(v, b) for v in per_rank(a).values())


def test_default_generator_stays_per_rank(sim):
    torch.manual_seed(3)
    want = torch.randn(2, 3), torch.randn(4)
    sim(2)
    torch.manual_seed(3)
    for a, b in zip((torch.randn(2, 3), torch.randn(4)), want):
        for v in per_rank(a).values():
            assert torch.equal(v, b)


def test_batch_drawn_with_a_generator_trains_with_the_one_device_losses(sim):
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1)
    model = GPT(cfg)
    params = vsf.tree.from_module(model)

    def batch():
        g = torch.Generator().manual_seed(SEED)
        return torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g), torch.randint(
            0, cfg.vocab, (4, cfg.seq), generator=g
        )

    def step(p, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda q: vsf.tree.apply(model, q, idx, tgt))(p)
        return vsf.tree.map(lambda w, d: w - 0.1 * d, p, grads), loss

    p, want = params, []
    for _ in range(3):
        p, loss = step(p, *batch())
        want.append(loss)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    jitted = vsf.jit(step)
    p, got = vsf.device_put(params, vsf.NamedSharding(mesh, P())), []
    for _ in range(3):
        p, loss = jitted(p, *vsf.device_put(batch(), vsf.NamedSharding(mesh, P("dp"))))
        got.append(vsf.device_get(loss))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
def test_dtensor_random_op_with_a_generator_runs_and_ranks_stay_alike(sim):
    # DTensor infers the op's output on fake tensors first: the generator's per-rank states must
    # not be looked at there. Its values on a CPU mesh are DTensor's own business (real gloo
    # processes get other numbers on every run); later draws from the generator agree on all ranks.
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    g = torch.Generator().manual_seed(SEED)
    x = vsf.device_put(torch.zeros(4), vsf.NamedSharding(mesh, P("dp")))
    x.uniform_(generator=g)
    later = per_rank(torch.rand(3, generator=g))
    assert torch.equal(later[0], later[1])
