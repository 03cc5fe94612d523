"""Megatron TP through explicit-matmul attention (hand-written GPTs and many Hugging Face models):
a 4D ``q @ k.transpose(-2, -1)`` traces to ``expand``/``clone``/``_unsafe_view`` to
``[batch * heads, t, d]`` and ``bmm``, which turns a split of the heads into a strided shard of
the merged dim. The plan keeps it split through ``bmm`` and the views back, so each rank runs
attention on its own heads; every plan's loss and gradients equal the one-device run."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Partial
from torch.utils.flop_counter import FlopCounterMode
from toy_models import GPT, GPTConfig

import vsf
from vsf import P
from vsf.jit.cost import COLLECTIVE_LATENCY_BYTES
from vsf.jit.graph import meta_of

aten = torch.ops.aten

MEGATRON = [  # column-parallel q/k/v/fc1, row-parallel proj/fc2
    (r".*attn\.(q|k|v)\.(weight|bias)", P("tp")),
    (r".*fc1\.(weight|bias)", P("tp")),
    (r".*(proj|fc2)\.weight", P(None, "tp")),
    (r".*", P()),
]
LAYOUTS = {  # mesh shape, axis names, batch spec
    "tp2": ((2,), ("tp",), P()),
    "tp4": ((4,), ("tp",), P()),
    "dp2_tp2": ((2, 2), ("dp", "tp"), P("dp")),
}
# the start-up charge per collective (``vsf.config.collective_latency_bytes``) the trade-off tests below
# plan with, and :func:`_break_evens` derives their figures for: small beside the activations' bytes
# (the CPU default, 64 KiB, is one ``[b, t, d]`` activation of the issue's GPT)
LATENCY = 4096.0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out with 4D matmuls (no SDPA)."""
    t = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    return att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


def attention_step(qkv, w):
    return vsf.value_and_grad(lambda qkv, w: (attention(*qkv) * w).sum())(qkv, w)


def gpt_step(model):
    def step(params, idx, tgt):
        return vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(params)

    return step


def assert_close_trees(got, want):
    for (path, g), w in zip(vsf.tree.leaves_with_path(got), vsf.tree.leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{vsf.tree.keystr(path)}: {m}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_attention_on_split_heads_sends_only_the_loss_reduction(sim, layout):
    """Heads are independent: with q, k, v and the loss weights split on the heads (and the batch
    over dp), the step's only collective is the scalar loss's all-reduce over each mesh axis,
    ``2(n-1)/n * 4`` bytes per rank (the ring model :mod:`vsf.jit.cost` counts); gradients stay
    split as their inputs. Forward and backward match the one-device run."""
    shape, names, batch = LAYOUTS[layout]
    b, h, t, hd = 4, 4, 8, 8
    qkv = tuple(torch.randn(b, h, t, hd) for _ in range(3))
    w = torch.randn(b, h, t, hd)
    want_loss, want_grads = attention_step(qkv, w)
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    split = vsf.NamedSharding(mesh, P(batch[0] if len(batch) else None, "tp"))
    args = vsf.device_put((qkv, w), split)
    jitted = vsf.jit(attention_step)
    cost = jitted.lower(*args).cost()
    ring = {a: 2 * (mesh.axis_size(a) - 1) / mesh.axis_size(a) * 4 for a in names}
    assert {a: cost.comm_bytes.get(a, 0) for a in names} == pytest.approx(ring)
    assert {c.kind for c in cost.collectives} == {"all_reduce"} and all(
        math.prod(c.shape) == 1 for c in cost.collectives
    )
    loss, grads = jitted(*args)
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=1e-5)
    assert_close_trees(vsf.device_get(grads), want_grads)
    assert all(tuple(g.placements) == tuple(split.placements) for g in grads)


def _megatron_gpt(layout, cfg, sequences):
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    idx = torch.randint(0, cfg.vocab, (sequences, cfg.seq))
    shape, names, batch = LAYOUTS[layout]
    mesh = vsf.make_mesh(shape, names)
    sharded = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, MEGATRON)))
    whole = (idx, idx.roll(1, 1))
    return model, params, whole, sharded, vsf.device_put(whole, vsf.NamedSharding(mesh, batch))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_gpt_matches_one_device_and_never_moves_attention(sim, layout):
    """A 2-layer GPT with separate q/k/v projections under Megatron TP: loss and every gradient
    equal the one-device run, and no value attention computes on (a 4D ``[b, h, t, *]`` or
    ``[b, t, h, hd]`` value, or an operand or result of a ``bmm``) is ever redistributed."""
    cfg = GPTConfig(vocab=32, seq=8, dim=32, heads=4, layers=2, fused_qkv=False)
    sim(math.prod(LAYOUTS[layout][0]))
    model, params, whole, sharded, data = _megatron_gpt(layout, cfg, sequences=4)
    want_loss, want_grads = gpt_step(model)(params, *whole)
    jitted = vsf.jit(gpt_step(model))
    plan = jitted.lower(sharded, *data).plan
    bmm = aten.bmm.default
    moved = [
        r
        for r in plan.redistributions
        if meta_of(r.value).ndim == 4 or r.value[0].target is bmm or r.before.target is bmm
    ]
    assert not moved, [f"%{r.value[0].name} {r.src} -> {r.dst} before %{r.before.name}" for r in moved]
    loss, grads = jitted(sharded, *data)
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=1e-5)
    assert_close_trees(vsf.device_get(grads), want_grads)


def _issue_gpt_cost(sim, monkeypatch, bytes_per_flop, vocab=64, latency=LATENCY):
    """The plan of an AdamW-free step (loss and grads) of the issue's GPT: d=64, 4 heads, 2 layers,
    8 x 32 tokens, separate q/k/v, Megatron TP over tp=2, with each FLOP an op runs beyond its
    share charged ``bytes_per_flop`` bytes and each collective's start-up ``latency`` bytes."""
    monkeypatch.setattr(vsf.config, "compute_bytes_per_flop", bytes_per_flop)
    monkeypatch.setattr(vsf.config, "collective_latency_bytes", latency)
    cfg = GPTConfig(vocab=vocab, seq=32, dim=64, heads=4, layers=2, fused_qkv=False)
    sim(2)
    model, params, whole, sharded, data = _megatron_gpt("tp2", cfg, sequences=8)
    return cfg, model, params, whole, vsf.jit(gpt_step(model)).lower(sharded, *data).cost()


def _break_evens(cfg, m, n):
    """By hand, the ``compute_bytes_per_flop`` above which running an op split pays, for the
    choices the issue's GPT offers on ``n`` ranks (``m`` tokens, fp32, one collective's start-up
    :data:`LATENCY`; ``(n-1)/n`` of an op's ``F`` FLOPs is what each
    rank runs beyond its share when it runs whole):

    * ``proj``: the row-parallel attention projection ``[m, d] @ [d, d]`` all-reduces its output
      (``2(n-1)/n * m d`` words) or gathers its input and weight (``(n-1)/n * (m d + d d)``) and
      runs its ``2 m d d`` FLOPs whole (its backward runs on the split operands either way);
    * ``head_grad``: the tied head's weight gradient ``[d, m] @ [m, V]`` runs whole, or on each
      rank's half of its ``d`` rows, gathered after (``(n-1)/n * d V`` words, one start-up);
    * ``head``: the head's forward ``[m, d] @ [d, V]`` (and its input gradient) runs whole, or
      on each rank's vocabulary rows, the ``[m, V]`` logits gathered (one start-up)."""
    ring, d, v, latency = (n - 1) / n, cfg.dim, cfg.vocab, LATENCY
    return {
        "proj": (2 * ring * m * d - ring * (m * d + d * d)) * 4 / (ring * 2 * m * d * d),
        "head_grad": (ring * d * v * 4 + latency) / (ring * 2 * d * m * v),
        "head": (ring * m * v * 4 + latency) / (ring * 2 * m * d * v),
    }


@pytest.mark.parametrize("bytes_per_flop", [0.0, 0.005])
def test_megatron_gpt_gathers_the_projection_where_its_work_costs_less_than_the_bytes(sim, monkeypatch, bytes_per_flop):
    """Bytes only (or work charged below every break-even of :func:`_break_evens`), by hand under
    the ring model (bytes each rank sends: all-reduce ``2(n-1)/n``, all-gather ``(n-1)/n`` of the
    tensor): attention on its own heads sends nothing; the row-parallel fc2 all-reduces its
    ``[b, t, d]`` output (gathering its 4d-wide input would send twice that); the row-parallel
    proj is cheapest gathered, its input and weight (``(n-1)/n * (b*t*d + d*d)`` words) rather
    than its output all-reduced (``2(n-1)/n * b*t*d``), and then needs nothing in backward;
    backward all-reduces the summed partial gradients of the column-parallel q/k/v and of fc1
    once each. That is below Megatron's four all-reduces per block."""
    cfg, _, _, _, cost = _issue_gpt_cost(sim, monkeypatch, bytes_per_flop)
    n, b, t, d = 2, 8, cfg.seq, cfg.dim
    assert bytes_per_flop < min(_break_evens(cfg, b * t, n).values())
    ring = (n - 1) / n
    per_block = ring * (b * t * d + d * d) * 4 + 3 * 2 * ring * b * t * d * 4
    assert sum(cost.comm_bytes.values()) == cfg.layers * per_block
    assert sum(cost.comm_bytes.values()) < cfg.layers * 4 * 2 * ring * b * t * d * 4
    gathered = [c for c in cost.collectives if c.kind != "all_reduce"]  # (proj's input and weight: one bucket or two)
    assert {c.kind for c in gathered} == {"all_gather"} and sum(math.prod(c.shape) for c in gathered) == cfg.layers * (
        b * t * d + d * d
    )


def test_a_collective_start_up_above_the_bytes_it_saves_plans_megatron_with_fewer_collectives(sim, monkeypatch):
    """Bytes only, as above, but each collective's start-up charged as one ``[b, t, d]`` activation's
    bytes, 64 KiB (the CPU default of ``vsf.config.collective_latency_bytes``; :data:`LATENCY` gives
    the plan above, 5 collectives a block): gathering the projection's input and weight saves
    ``(n-1)/n * (b*t*d - d*d) * 4`` bytes a block (24 KiB) but starts more collectives, so the plan
    is Megatron's, 4 all-reduces of ``[b, t, d]`` a block and nothing else (more bytes, fewer
    launches)."""
    cfg, _, _, _, cost = _issue_gpt_cost(sim, monkeypatch, 0.0, latency=None)
    n, b, t, d = 2, 8, cfg.seq, cfg.dim
    assert COLLECTIVE_LATENCY_BYTES["cpu"] == b * t * d * 4
    assert [(c.kind, tuple(c.shape)) for c in cost.collectives] == [("all_reduce", (b, t, d))] * (cfg.layers * 4)
    assert sum(cost.comm_bytes.values()) == cfg.layers * 4 * 2 * (n - 1) / n * b * t * d * 4


def test_megatron_gpt_step_sends_megatron_bytes(sim, monkeypatch):
    """With work charged above the projection's and the head gradient's break-evens but below the
    head's (:func:`_break_evens`): Megatron's plan on every block, two all-reduces of the
    ``[b, t, d]`` activation in forward (after the row-parallel proj and fc2), two in backward
    (before the column-parallel q/k/v and fc1), ``layers * 4 * 2(n-1)/n * b*t*d*4`` bytes per
    rank, no activation gathered; and the tied head's weight gradient computed on each rank's
    rows and gathered, ``(n-1)/n * d*V*4``. Each rank then runs half the FLOPs of the one-device
    step (PyTorch's ``FlopCounterMode``) but for the head's forward and input gradient, which it
    runs whole (``2 * b*t*d*V`` FLOPs each)."""
    r = 0.03
    cfg, model, params, whole, cost = _issue_gpt_cost(sim, monkeypatch, r)
    n, m, d, v = 2, 8 * cfg.seq, cfg.dim, cfg.vocab
    evens = _break_evens(cfg, m, n)
    assert max(evens["proj"], evens["head_grad"]) < r < evens["head"]
    ring = (n - 1) / n
    weights = {tuple(p.shape) for p in params.values()}
    gathered = [c for c in cost.collectives if c.kind == "all_gather" and tuple(c.shape) not in weights]
    assert (sum(cost.comm_bytes.values()), gathered) == (cfg.layers * 4 * 2 * ring * m * d * 4 + ring * d * v * 4, [])
    with FlopCounterMode(display=False) as counter:
        gpt_step(model)(params, *whole)
    assert cost.flops == counter.get_total_flops() / n + 2 * 2 * m * d * v * (1 - 1 / n)


def test_megatron_gpt_runs_the_loss_on_token_shards_where_the_head_pays(sim, monkeypatch):
    """The issue's GPT with a 256-word vocabulary. With work charged above every break-even
    (:func:`_break_evens`), everything runs split:
    Megatron's blocks, and the final norm, the tied head and the loss on each rank's share of the
    tokens (sequence-parallel): the last block's forward all-reduce becomes a reduce-scatter and
    the norm's input gradient is all-gathered, together one all-reduce's bytes, so the blocks send
    exactly Megatron's ``layers * 4`` all-reduces of ``[b, t, d]``; beside them only the tied head's
    weight gradient, the norm's two gradients and the scalar loss are all-reduced: no
    ``[b*t, V]`` value (the logits or log-probabilities) is sent, unlike a plan stuck with the
    log-probabilities gathered (their three readers each gain nothing alone from reading them
    split; that plan sends ``(n-1)/n * b*t*V`` words more, and the head's gradient gathered). Each rank runs
    ``1/n`` of the one-device step's FLOPs (PyTorch's ``FlopCounterMode``), and the loss and
    gradients equal the one-device run."""
    r = 0.05
    cfg, model, params, whole, cost = _issue_gpt_cost(sim, monkeypatch, r, vocab=256)
    n, m, d, v = 2, 8 * cfg.seq, cfg.dim, cfg.vocab
    assert r > max(_break_evens(cfg, m, n).values())
    ring = (n - 1) / n
    assert sum(cost.comm_bytes.values()) == 2 * ring * (cfg.layers * 4 * m * d + v * d + 2 * d + 1) * 4
    with FlopCounterMode(display=False) as counter:
        want_loss, want_grads = gpt_step(model)(params, *whole)
    assert cost.flops == counter.get_total_flops() / n
    mesh = vsf.make_mesh((n,), ("tp",))
    sharded = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, MEGATRON)))
    loss, grads = vsf.jit(gpt_step(model))(sharded, *vsf.device_put(whole, vsf.NamedSharding(mesh, P())))
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=1e-5)
    assert_close_trees(vsf.device_get(grads), want_grads)


def test_megatron_gpt_sums_each_blocks_input_gradients_before_one_all_reduce(sim, monkeypatch):
    """bench_torch's quick GPT (d=128, 4 heads, 2 layers, 8 x 64 tokens, a 512-word vocabulary) at
    a 4 KiB start-up charge and the default work charge: in backward the column-parallel q/k/v
    (and fc1) of each block give their input gradients as partial sums, added, then all-reduced
    once before the norm's backward, ``layers * 2`` all-reduces of ``[b, t, d]``; no backward
    matmul (``mm``: the forward's are ``addmm``) reads a value exchanged all-to-all. Computing each
    of the three products on each rank's tokens instead (its output gradient exchanged, its
    weight gathered, the sum gathered) looks cheaper to each product alone, but sends ``3 *
    ((n-1)/n**2 * b*t*d + (n-1)/n * d*d) + (n-1)/n * b*t*d`` words a block (104K at n=2) for the
    all-reduce's ``2(n-1)/n * b*t*d`` (64K): the partial sum is one move of the products and the
    additions together (``AxisSolver._merge_partials``)."""
    monkeypatch.setattr(vsf.config, "collective_latency_bytes", LATENCY)
    cfg = GPTConfig(vocab=512, seq=64, dim=128, heads=4, layers=2, fused_qkv=False)
    sim(2)
    model, _, _, sharded, data = _megatron_gpt("tp2", cfg, sequences=8)
    plan = vsf.jit(gpt_step(model)).lower(sharded, *data).plan
    kinds = lambda r: [c.kind for c in r.collectives]  # noqa: E731
    summed = [
        r
        for r in plan.redistributions
        if r.before.target is aten.native_layer_norm_backward.default
        and isinstance(r.src[0], Partial)
        and kinds(r) == ["all_reduce"]
        and tuple(meta_of(r.value).shape) in {(8, cfg.seq, cfg.dim), (8 * cfg.seq, cfg.dim)}
    ]
    assert len(summed) == cfg.layers * 2
    exchanged = [r for r in plan.redistributions if r.before.target is aten.mm.default and "all_to_all" in kinds(r)]
    assert not exchanged, [f"%{r.value[0].name} {r.src} -> {r.dst} before %{r.before.name}" for r in exchanged]
