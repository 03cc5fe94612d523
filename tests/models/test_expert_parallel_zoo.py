"""Expert parallelism on the Hugging Face MoE families (the zoo's tiny configs with 8 experts,
top-2: Mixtral by default, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE and GLM-4.5 in the sweep): their experts'
fused weights split over ``ep`` on the expert dim, the tokens over ``("dp", "ep")``, the
experts run through ``vsf.nn.expert_parallel``: with those specs alone (``vsf.jit`` recognises
transformers' experts modules while it traces), or set explicitly (``vsf.nn.use_expert_parallel``:
vsf's experts implementation registered with transformers). Oracles: the model trained by plain
PyTorch on one device (params after 3 steps), the experts module run on one device (loss and
gradients), and the analytic dispatch + combine volume, computed here by hand."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import zoo
from context_parallel_checks import assert_equal_to_one_device, reference

import vsf
from vsf import P, optim

pytestmark = pytest.mark.models

EXPERTS, TOP_K = 8, 2
MOE_LAYERS = {
    "mixtral": zoo.LAYERS,
    "qwen2_moe": zoo.LAYERS,
    "qwen3_moe": zoo.LAYERS,
    "deepseek_v3": zoo.LAYERS - 1,
    "olmoe": zoo.LAYERS,
    "glm4_moe": zoo.LAYERS - 1,
}  # DeepSeek's and GLM's first layers are dense
FAMILIES = ["mixtral"] + [
    pytest.param(f, marks=pytest.mark.sweep) for f in ("qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "glm4_moe")
]
# how the experts come to run through the dispatch: their specs alone, or vsf.nn.use_expert_parallel
HOW = ["specs", "use_expert_parallel"]


# Megatron's split of transformers' experts over tp: gate_up's rows (the ffn, gate's then up's)
# packed (each rank its slice of gate's rows and of up's: transformers' "packed_colwise") and
# down's columns
EXPERTS_TP = {"gate_up_proj": P("ep", vsf.packed("tp", 2), None), "down_proj": P("ep", None, "tp")}


def expert_specs(params):
    return {k: P("ep") if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else P() for k in params}


def trained_on_ep(sim, family, name, axes, token_spec, specs_of=expert_specs, before_put=None):
    """``family`` trained 3 AdamW steps by vsf.jit on a 2 x 2 ``axes`` mesh (params ``specs_of``,
    tokens ``token_spec``), checked against torch on one device (losses and every param); returns the
    lowered step on the first batch."""
    want = zoo.torch_run(family)
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    tx = zoo.adamw()
    sim(4)
    mesh = vsf.make_mesh((2, 2), axes)
    if before_put is not None:
        before_put(model, mesh)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs_of(params)))
    s = optim.init_sharded(tx, p)
    step = vsf.jit(zoo.train_step(model, tx, family.loss))
    tokens = vsf.NamedSharding(mesh, token_spec)
    losses = []
    for batch in batches:
        p, s, loss = step(p, s, vsf.device_put(batch, tokens))
        losses.append(vsf.device_get(loss))
    zoo.assert_like_oracle(name, losses, vsf.device_get(p), want)
    return step.lower(p, s, vsf.device_put(batches[0], tokens))


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", FAMILIES)
def test_on_dp_x_ep_trains_like_torch_on_one_device_sending_tokens_not_experts(sim, name, how):
    def routed(model, mesh):
        vsf.nn.use_expert_parallel(model, axis="ep", token_axes=("dp", "ep"), mesh=mesh)

    lowered = trained_on_ep(
        sim,
        zoo.moe(name, EXPERTS),
        f"{name} dp x ep ({how})",
        ("dp", "ep"),
        P(("dp", "ep")),
        before_put=routed if how == "use_expert_parallel" else None,
    )
    assert lowered.as_text().count("all_to_all_v over ep (inside shard_map(expert_dispatch))") == 4 * MOE_LAYERS[name]
    assert_tokens_sent_not_experts(lowered.cost().collectives, zoo.BATCH * zoo.SEQ // 4, MOE_LAYERS[name])


@pytest.mark.sweep
def test_experts_further_split_over_fsdp_from_specs_dispatch_tokens_split_over_both(sim):
    """torchtitan's efsdp from specs alone: Mixtral's experts ``P("ep", "fsdp")`` (fsdp splits
    gate_up's ffn dim and down's hidden dim: a storage split, not tensor parallelism) on an
    ``("fsdp", "ep")`` mesh, the batch over both: the params after 3 AdamW steps are torch's on one
    device; over ep each exchange sends a rank's 16 tokens x top-2 x 32 floats (the analytic volume:
    with fsdp left out of the token axes each sent its fsdp group's 32 tokens, twice as much); over
    fsdp the experts are gathered into the dispatch and their gradients reduce-scattered, each a
    rank's half of its 4 local experts in each layer (as FSDP does), and no token is exchanged. In
    the sweep (about 17 s): the default suite checks the experts module alone
    (test_an_experts_module_further_split_over_fsdp_dispatches_tokens_split_over_both)."""

    def efsdp(params):
        return {k: P("ep", "fsdp") if s == P("ep") else s for k, s in expert_specs(params).items()}

    lowered = trained_on_ep(
        sim,
        zoo.moe("mixtral", EXPERTS),
        "mixtral fsdp x ep (efsdp specs)",
        ("fsdp", "ep"),
        P(("fsdp", "ep")),
        specs_of=efsdp,
    )
    collectives = lowered.cost().collectives
    assert_tokens_sent_not_experts(collectives, zoo.BATCH * zoo.SEQ // 4, zoo.LAYERS)
    half = zoo.LAYERS * EXPERTS // 2 * (2 * zoo.FFN * zoo.HIDDEN + zoo.HIDDEN * zoo.FFN) * 4 // 2
    over_fsdp = [(c.kind, c.bytes) for c in collectives if c.axis == "fsdp"]
    assert [b for k, b in over_fsdp if k == "reduce_scatter"] == [half]
    assert [b for k, b in over_fsdp if k == "all_gather" and b >= half] == [half]
    assert not [k for k, _ in over_fsdp if k == "all_to_all_v"]


@pytest.mark.sweep
def test_on_ep_x_tp_trains_like_torch_on_one_device_sending_tokens_not_experts(sim):
    """Mixtral with attention, embedding and head Megatron-split over tp (the zoo's rules), its
    experts over ep and their ffn over tp (``EXPERTS_TP``: transformers fuses gate and up into
    one weight whose ffn rows are gate's then up's, packed over tp so that each rank holds a slice
    of each), the batch over ep: the params after 3 AdamW steps are torch's on one device, and
    over ep the tokens go to the experts (each exchange a rank's 32 tokens x top-2 x 32 floats:
    its ep group's half of the batch; tp's ranks send the same) and no expert weight moves. Over
    tp the experts are tensor-parallel: per MoE layer one all-reduce of the receive buffer (2 ep
    ranks x 64 rows x 32 floats: the down projection's partial sums; the rows' gradient is reduced
    where it is smaller), and nothing gathered the size of an expert weight. In the sweep (tens of
    seconds): the default suite checks the experts module alone
    (test_an_experts_module_with_its_ffn_over_tp_dispatches_over_ep_alone)."""
    family = zoo.moe("mixtral", EXPERTS)

    def specs(params):
        tp = vsf.sharding.match(params, list(family.tp_rules))
        return {k: EXPERTS_TP[k.rsplit(".", 1)[-1]] if ".experts." in k else s for k, s in tp.items()}

    lowered = trained_on_ep(sim, family, "mixtral ep x tp", ("ep", "tp"), P("ep"), specs_of=specs)
    collectives = lowered.cost().collectives
    assert_tokens_sent_not_experts(collectives, zoo.BATCH * zoo.SEQ // 2, zoo.LAYERS)
    rows = 2 * zoo.BATCH * zoo.SEQ // 2 * TOP_K  # the receive buffer: every ep rank's 32 tokens x top-2
    over_tp = [c for c in collectives if c.axis == "tp"]
    sums = [(c.kind, c.bytes) for c in over_tp if c.shape == (rows, zoo.HIDDEN)]
    assert sums == [("all_reduce", rows * zoo.HIDDEN * 4)] * zoo.LAYERS  # each layer's down projection
    expert = EXPERTS // 2 * zoo.FFN * zoo.HIDDEN  # a rank's experts' gate (or up, or down) floats
    assert not any(c.kind == "all_gather" and math.prod(c.shape) % expert == 0 for c in over_tp), over_tp


# (mesh axes, the batch's spec): the tokens split ep-major, against the mesh order. In the sweep
# (about 30 s); the default suite keeps the costed order on the experts module alone (the bytes by
# hand and one device's gradients: test_the_dispatch_takes_tokens_split_against_the_mesh_order_as_they_arrive;
# cp before ep: test_cp_before_ep_dispatches_the_tokens_as_they_arrive)
ORDERS = [
    pytest.param(("dp", "ep"), P(("ep", "dp")), id="dp-ep-tokens-ep-major", marks=pytest.mark.sweep),
]


@pytest.mark.parametrize("axes, batch_spec", ORDERS)
def test_the_token_axes_taken_in_the_cheaper_order_train_like_torch_on_one_device(sim, axes, batch_spec):
    """Mixtral's experts ``P("ep")`` alone: the plan takes the dispatch's token axes in the order
    that moves fewest bytes (every order planned), not the mesh's: the params after 3 AdamW steps
    are torch's on one device, and over ep the tokens go to the experts (each exchange a rank's 16
    tokens x top-2 x 32 floats) and the rest gathered there stays under one layer's local experts
    (the mesh's order, ("dp", "ep"), regathered the ep-major tokens around each dispatch: 111 KiB)."""
    lowered = trained_on_ep(sim, zoo.moe("mixtral", EXPERTS), f"mixtral {axes} tokens {batch_spec}", axes, batch_spec)
    assert_tokens_sent_not_experts(lowered.cost().collectives, zoo.BATCH * zoo.SEQ // 4, zoo.LAYERS)


@pytest.mark.sweep
def test_cp_before_ep_dispatches_the_tokens_as_they_arrive(sim):
    """Mixtral's experts ``P("ep")`` alone, the batch over ep and the sequence over cp on a ``("cp",
    "ep")`` mesh: the tokens' rows, merged in each MoE layer, are a strided shard over cp (each
    rank holds half of each of its ep group's 2 sequences), which the dispatch takes as they
    arrive, and the router's softmax and top-k run on them so: no token row is gathered over ep
    (the mesh's order regathered them: 104,072 B over ep a rank). The params after 3 AdamW steps
    are torch's on one device. Over ep a rank sends, by hand (76,808 B; the cache's keys and values,
    cat to its empty tensors, are gathered nowhere: 85,000 B when they were, each layer's K and V):

    - the dispatch: per layer the dispatch and combine forward and their transposes backward, each
      a rank's 16 tokens x top-2 x 32 floats (8 x 4,096 B, the analytic volume), and the
      per-expert counts, 2 x 8 int64 gathered (64 B a layer);
    - the loss: the final hidden states [4, 16, 32] floats (4,096 B) and the labels [4, 16] int64
      (256 B) gathered for the shifted cross-entropy, and a 4 B scalar all-reduced;
    - the gradients of the params ep leaves whole, all-reduced in at most two buckets (those
      partial over cp as well, and those of the k and v projections, which the plan computes from
      whole sequences over cp): at most every non-expert param's floats (2(n-1)/n = 1 of them)."""
    lowered = trained_on_ep(sim, zoo.moe("mixtral", EXPERTS), "mixtral cp x ep", ("cp", "ep"), P("ep", "cp"))
    collectives = lowered.cost().collectives
    assert_tokens_sent_not_experts(collectives, zoo.BATCH * zoo.SEQ // 4, zoo.LAYERS)
    over_ep = [c for c in collectives if c.axis == "ep"]
    by_hand = sorted(
        [("all_to_all_v", zoo.BATCH * zoo.SEQ // 4 * TOP_K * zoo.HIDDEN * 4)] * (4 * zoo.LAYERS)
        + [("all_gather", EXPERTS * 8)] * zoo.LAYERS
        + [("all_gather", zoo.BATCH * zoo.SEQ * zoo.HIDDEN * 4 // 2), ("all_gather", zoo.BATCH * zoo.SEQ * 8 // 2)]
        + [("all_reduce", 4)]
    )
    # the gradients: one bucket of those partial over cp too, and one of those the plan computes
    # from whole sequences over cp (the k and v projections')
    grads = [c for c in over_ep if c.kind == "all_reduce" and c.bytes > 4]
    assert 1 <= len(grads) <= 2, grads
    assert sorted((c.kind, c.bytes) for c in over_ep if not any(c is g for g in grads)) == by_hand
    non_expert = sum(
        math.prod(t.shape)
        for k, t in vsf.tree.from_module(zoo.built(zoo.moe("mixtral", EXPERTS))[0]).items()
        if "experts." not in k
    )
    assert sum(c.bytes for c in grads) <= non_expert * 4
    # the tokens into each dispatch, as they arrive
    taken = [t for t in lowered.as_text().splitlines() if "= manual_in(" in t and "[64@<cp/sf4,ep>,32])" in t]
    assert len(taken) == zoo.LAYERS


def assert_tokens_sent_not_experts(collectives, rank_tokens, layers):
    """Over ``ep``: per MoE layer, the dispatch and combine forward and their transposes backward,
    each a rank's ``rank_tokens`` x top-k x hidden x 4 bytes, and the per-expert counts (int64)
    once; no expert weight."""
    over_ep = [c for c in collectives if c.axis == "ep"]
    exchanges = [c.bytes for c in over_ep if c.kind == "all_to_all_v"]
    assert exchanges == [rank_tokens * TOP_K * zoo.HIDDEN * 4] * (4 * layers)
    counts = [c for c in over_ep if c.kind == "all_gather" and c.shape == (2, EXPERTS)]  # [ep ranks, experts] gathered
    assert [c.bytes for c in counts] == [EXPERTS * 8] * layers
    # one layer's local experts are 96 KiB (4 x (128 x 32 + 32 x 64) floats), the rest gathered over
    # ep (attention's and the loss's activations, as any plan with tokens split over two axes;
    # with cp before ep in the mesh, the tokens' rows regathered in the region's order) is smaller
    # altogether
    shard = EXPERTS // 2 * (2 * zoo.FFN * zoo.HIDDEN + zoo.HIDDEN * zoo.FFN) * 4
    gathered = [c for c in over_ep if c.kind == "all_gather" and c.dtype.is_floating_point]
    assert sum(c.bytes for c in gathered) < shard, gathered
    assert not any(math.prod(c.shape) % (EXPERTS * zoo.HIDDEN * zoo.FFN) == 0 for c in gathered), gathered


# (mesh axes, how keys and values move): the tokens' rows (batch over ep, sequence over cp) merged
# in the MoE layer, the region's in mesh order: as they are, or (cp first) moved
CP_ORDERS = [
    pytest.param(("ep", "cp"), "ring", id="ep-cp-ring"),
    pytest.param(("cp", "ep"), "all_gather", id="cp-ep-all_gather", marks=pytest.mark.sweep),
]


@pytest.mark.parametrize("axes, mode", CP_ORDERS)
def test_on_ep_x_cp_equals_one_device(sim, monkeypatch, axes, mode):
    """Mixtral's experts ``P("ep")`` alone, four sequences split over ep by the batch and over cp by
    the sequence (attention on sequence shards): the loss and every gradient are one device's, and
    the tokens go to the experts (each rank's 16 tokens), no expert weight over ep."""
    monkeypatch.setattr(vsf.config, "context_parallel", mode)
    model, _ = zoo.built(zoo.moe("mixtral", EXPERTS))
    params = vsf.tree.from_module(model)
    ids = torch.randint(0, zoo.VOCAB, (4, zoo.SEQ), generator=torch.Generator().manual_seed(2))

    def loss_fn(p, ids):
        return vsf.tree.apply(model, p, input_ids=ids, labels=ids).loss

    want = reference(loss_fn, params, (ids,))
    sim(4)
    mesh = vsf.make_mesh((2, 2), axes)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, expert_specs(params)))
    tokens = vsf.device_put(ids, vsf.NamedSharding(mesh, P("ep", "cp")))
    step = vsf.jit(lambda p, ids: vsf.value_and_grad(loss_fn)(p, ids))
    assert_equal_to_one_device(vsf.device_get(step(p, tokens)), want)
    assert_tokens_sent_not_experts(step.lower(p, tokens).cost().collectives, 4 * zoo.SEQ // 4, zoo.LAYERS)


def _moe_blocks():
    """Two of Mixtral's MoE blocks (router and experts: hidden 16, ffn 8, 4 experts, top-2; seeded
    random weights), each with a residual connection: the model of a fast pipeline test."""
    import transformers as T

    config = T.MixtralConfig(
        hidden_size=16,
        intermediate_size=8,
        num_local_experts=4,
        num_experts_per_tok=TOP_K,
        experts_implementation="grouped_mm",
    )
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([T.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config) for _ in range(2)])
    for w in blocks.parameters():
        torch.nn.init.normal_(w, std=0.3)
    return blocks


def _squared_error(y, target):
    return ((y - target) ** 2).mean()


# (mesh shape, axes, the batch's spec, the experts' spec, the routers' spec): the experts over ep
# alone, or further split over fsdp (torchtitan's efsdp), the routers then fsdp-split too
PIPELINED = {
    "pp_ep": ((2, 2), ("pp", "ep"), P("ep"), P("ep"), P()),
    "pp_fsdp_ep": ((2, 2, 2), ("pp", "fsdp", "ep"), P(("fsdp", "ep")), P("ep", "fsdp"), P("fsdp")),
}


def _moe_pipeline(sim, layout_name, seq=4):
    """The two MoE blocks, their params, 3 batches (inputs, targets) of one sequence of ``seq``
    tokens per rank and microbatch, and on ``PIPELINED[layout_name]``'s simulated mesh their
    pipeline (a stage a block, its residual connection included, 1F1B, two microbatches) with the
    params it placed and their layout."""
    shape, axes, batch, experts, router = PIPELINED[layout_name]
    ranks = math.prod(shape) // 2  # a stage's
    blocks = _moe_blocks()
    params = vsf.tree.from_module(blocks)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(2 * ranks, seq, 16, generator=g), torch.randn(2 * ranks, seq, 16, generator=g)) for _ in range(3)
    ]

    def stage(s):
        return lambda p, x: x + vsf.tree.apply(blocks[s], {k[2:]: v for k, v in p.items() if k.startswith(f"{s}.")}, x)

    sim(2 * ranks)
    mesh = vsf.make_mesh(shape, axes)
    pipe = vsf.pipeline.Pipeline(
        [stage(0), stage(1)], _squared_error, [["0."], ["1."]], mesh=mesh, microbatches=2, batch=batch
    )
    return (
        blocks,
        params,
        batches,
        (pipe, *pipe.place(params, {k: experts if ".experts." in k else router for k in params})),
    )


def _torch_blocks(blocks, batches):
    """The two blocks trained by plain PyTorch on one device: the losses and the params after each batch's AdamW step."""
    model = copy.deepcopy(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=zoo.LR, betas=zoo.BETAS, eps=zoo.EPS, weight_decay=zoo.WEIGHT_DECAY)
    losses = []
    for x, target in batches:
        opt.zero_grad()
        h = x + model[0](x)
        loss = _squared_error(h + model[1](h), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("layout_name", ["pp_ep", pytest.param("pp_fsdp_ep", marks=pytest.mark.sweep)])
def test_pipelined_on_pp_x_ep_dispatches_and_trains_like_torch_on_one_device(sim, layout_name):
    """Two MoE blocks in two stages over pp, 1F1B, two microbatches, their experts split over ep (and
    fsdp) and the batch over the same axes: the losses and the params after 3 AdamW steps are
    torch's on one device. The experts stay split over ep (gathered once a step over fsdp alone;
    no expert weight or gradient over ep): each stage's program dispatches its microbatch's tokens
    (a rank's one sequence of 4 tokens x top-2 x 16 floats) and combines them, the combine's
    transpose in the backward and, on stage 1 (whose input needs a gradient), the dispatch's; the
    gradients reduced once a step over ep are the router's alone."""
    blocks, params, batches, (pipe, p, layout) = _moe_pipeline(sim, layout_name)
    want = _torch_blocks(blocks, batches)
    lowered = pipe.lower(p, *batches[0], layout=layout)
    trained, losses = zoo.train_pipelined(pipe, zoo.adamw(), (p, layout), batches)
    got = vsf.device_get(trained)
    zoo.assert_like_oracle(f"moe blocks {layout_name}", losses, got, want)

    assert not [c for g in lowered.gathers.values() for c in g.cost().collectives if c.axis == "ep"]
    rows = 4 * TOP_K * 16 * 4
    for stage_index, exchanges in ((0, 3), (1, 4)):
        over_ep = [c for c in lowered.stages[stage_index].cost().collectives if c.axis == "ep"]
        assert (
            sorted((c.kind, c.bytes) for c in over_ep) == [("all_gather", 4 * 8)] + [("all_to_all_v", rows)] * exchanges
        )
        reduced = [(c.kind, c.shape) for c in lowered.reducers[stage_index].cost().collectives if c.axis == "ep"]
        gate = layout.where(f"{stage_index}.gate.weight", stage_index)[0].shard_shape((4, 16))
        assert reduced == [("all_reduce", gate)]
        if layout_name == "pp_ep":  # a step: 2 microbatches, the router's gradient (256 B), stage 1's losses;
            # fewer bytes than the gather plan's 6,400 (the experts gathered and their gradients
            # reduce-scattered, 2 x 3,072, and the router's 256: the test below's)
            step = 2 * (exchanges * rows + 4 * 8) + 256 + 4 * 2 * stage_index
            assert lowered.cost().stages[stage_index].comm_bytes["ep"] == step < 2 * 3072 + 256
    assert "all_to_all_v over ep (inside shard_map(expert_dispatch))" in lowered.as_text()


def test_pipelined_with_many_tokens_to_tiny_experts_gathers_them_once_a_step(sim):
    """Dispatch against gather, costed (each planned): with a microbatch of two sequences of 64
    tokens over ep, a rank's 64 tokens, dispatching sends each exchange 64 x top-2 x 16 floats
    (8 KiB; 3 a microbatch on stage 0, whose input needs no gradient, 4 on stage 1) and the
    per-expert counts (32 B), and the router's gradient is all-reduced once a step (256 B): 49,472
    B a step on stage 0. Gathering the experts once a step (each rank's 2 experts' 16x16 and 16x8
    floats, 3 KiB), each rank runs them on its own tokens (``shard_map(own_tokens)``) and their
    gradients are reduce-scattered once a step (3 KiB): 6,400 B a step (and stage 1 sums each
    microbatch's loss). (The old planner ran the gathered experts on the microbatch's every token,
    whose routing transformers sorts whole, gathering the routing, tokens, gates and two gradients
    each microbatch: 47,360 B.) The pipeline gathers (one bucket over ep), exchanges no token, and
    trains like torch on one device (params after 3 AdamW steps)."""
    blocks, _, batches, (pipe, p, layout) = _moe_pipeline(sim, "pp_ep", seq=64)
    exchange, counts, router = 64 * TOP_K * 16 * 4, 2 * 4 * 8 // 2, 2 * (4 * 16 * 4) // 2
    experts = 2 * (16 * 16 + 16 * 8) * 4
    gathered = 2 * experts + router
    assert gathered < 2 * (3 * exchange + counts) + router  # stage 0's dispatch; stage 1's sends more
    lowered = pipe.lower(p, *batches[0], layout=layout)
    for s in (0, 1):
        assert [c.bytes for c in lowered.gathers[s].cost().collectives if c.axis == "ep"] == [experts]
        assert not [c for c in lowered.stages[s].cost().collectives if c.axis == "ep"]
        reduced = sorted((c.kind, c.bytes) for c in lowered.reducers[s].cost().collectives if c.axis == "ep")
        assert reduced == [("all_reduce", router), ("reduce_scatter", experts)]
        assert lowered.cost().stages[s].comm_bytes["ep"] == gathered + 4 * 2 * s  # (and the last stage's losses)
    trained, losses = zoo.train_pipelined(pipe, zoo.adamw(), (p, layout), batches)
    got = vsf.device_get(trained)
    zoo.assert_like_oracle("moe blocks gathered", losses, got, _torch_blocks(blocks, batches))


@torch.library.custom_op("vsf_tests::experts_without_rules", mutates_args=())
def _experts_without_rules(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Experts code that vsf cannot plan: a custom op with no sharding strategy (as torchtitan's
    combine, its scatter-add). Dispatched, the experts' own code never runs."""
    raise AssertionError("the experts' own code ran: they were not dispatched")


_experts_without_rules.register_fake(lambda x, w: torch.empty_like(x))
_experts_without_rules.register_autograd(lambda ctx, grad: (grad, None))


def test_pipelined_experts_whose_own_code_has_no_plan_dispatch(sim, monkeypatch):
    """The two MoE blocks pipelined over pp x ep with an experts implementation registered with
    transformers whose code runs an op without a sharding strategy: gathered once a step (one of
    the two plans the pipeline costs), a stage has no plan (the PlanError the costing raised), so
    the pipeline dispatches: no gather, and each stage exchanges its microbatch's tokens (a rank's
    one sequence of 4 tokens x top-2 x 16 floats; the test above trains that plan like torch on
    one device, torchtitan's pipelined MoE trains so in tests/models/test_torchtitan_moe.py)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # type: ignore[import-not-found]

    monkeypatch.setitem(
        ALL_EXPERTS_FUNCTIONS,
        "without_rules",
        lambda module, x, index, weights: _experts_without_rules(x, module.gate_up_proj),
    )
    blocks, _, batches, (pipe, p, layout) = _moe_pipeline(sim, "pp_ep")
    blocks[0].experts.config._experts_implementation = "without_rules"  # (the two blocks' config)
    lowered = pipe.lower(p, *batches[0], layout=layout)
    assert not lowered.gathers
    for s, exchanges in ((0, 3), (1, 4)):
        sent = [c.bytes for c in lowered.stages[s].cost().collectives if c.kind == "all_to_all_v"]
        assert sent == [4 * TOP_K * 16 * 4] * exchanges


def test_pipelined_with_dispatch_experts_off_gathers_the_experts_once_a_step(sim, monkeypatch):
    """``vsf.config.dispatch_experts = False``: the pipeline gathers each stage's experts over ep once
    a step, as params split over the batch's axes (each rank sends its 2 experts' 16x16 and 16x8
    floats, one bucket), and its programs exchange no token."""
    monkeypatch.setattr(vsf.config, "dispatch_experts", False)
    _, _, batches, (pipe, p, layout) = _moe_pipeline(sim, "pp_ep")
    lowered = pipe.lower(p, *batches[0], layout=layout)
    for s in (0, 1):
        assert [c.bytes for c in lowered.gathers[s].cost().collectives if c.axis == "ep"] == [
            2 * (16 * 16 + 16 * 8) * 4
        ]
        assert not [c for c in lowered.stages[s].cost().collectives if c.kind == "all_to_all_v"]


@pytest.mark.sweep
def test_pipelined_mixtral_on_pp_x_ep_dispatches_and_trains_like_torch_on_one_device(sim):
    """Mixtral cut into two stages of one layer each (``zoo.pipeline_stages``), 1F1B over ``pp``, two
    microbatches, the experts ``P("ep")`` and the microbatches split over ep: the losses and the
    params after 3 AdamW steps are one device's. The experts stay split (the pipeline gathers no
    param once a step), and each stage's program exchanges its microbatch's tokens over ep: the
    dispatch and combine forward, their transposes backward (the MoE layer's input needs a
    gradient on both stages: stage 0's comes from the embedding); no expert weight goes over ep."""
    family = zoo.moe("mixtral", EXPERTS)
    want = zoo.torch_run(family)
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    fns, prefixes, tied = zoo.pipeline_stages("mixtral", model)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("pp", "ep"))
    pipe = vsf.pipeline.Pipeline(fns, zoo.causal_lm_loss, prefixes, mesh=mesh, microbatches=2, batch=P("ep"), tied=tied)
    placed = pipe.place(params, expert_specs(params))
    p, losses = zoo.train_pipelined(pipe, zoo.adamw(), placed, batches)
    zoo.assert_like_oracle("mixtral pp x ep", losses, vsf.device_get(p), want)
    lowered = pipe.lower(p, batches[0]["input_ids"], batches[0]["labels"], layout=placed[1])
    assert not lowered.gathers
    rows = zoo.BATCH // 4 * zoo.SEQ * TOP_K * zoo.HIDDEN * 4  # a rank's microbatch
    shard = EXPERTS // 2 * (2 * zoo.FFN * zoo.HIDDEN + zoo.HIDDEN * zoo.FFN) * 4
    for s in (0, 1):
        over_ep = [c for c in lowered.stages[s].cost().collectives if c.axis == "ep"]
        assert [c.bytes for c in over_ep if c.kind == "all_to_all_v"] == [rows] * 4
        assert sum(c.bytes for c in over_ep if c.kind == "all_gather" and c.dtype.is_floating_point) < shard
        assert not [c for c in lowered.reducers[s].cost().collectives if c.axis == "ep" and c.bytes >= shard]


@pytest.mark.sweep
@pytest.mark.multiprocess
@pytest.mark.world("pipeline_hf.py", "mixtral", nproc=4)
def test_pipelined_mixtral_on_real_pp_x_ep_processes_dispatches_like_torch_on_one_device(world):
    """Mixtral in two stages on 4 real gloo processes (pp=2 x ep=2, torch's Schedule1F1B, 2
    microbatches; tests/workers/pipeline_hf.py): each process trains its stage with the one-device
    losses and params; its stage's program exchanges its microbatch's tokens over its ep group (a
    rank's one sequence of 16 tokens x top-2 x 32 floats: the dispatch and combine and their
    transposes), and no stage gathers params. In the sweep (about 30 s of a quiet 2-core run): the
    default suite keeps the same plan and numbers on simulated ranks (above), the exchanges on real
    gloo processes (tests/jit/test_expert_parallel.py) and collectives over a stage's sub-mesh on real
    processes (pp=2 x dp=2, tests/transforms/test_pipeline_multiproc.py)."""
    rows = zoo.BATCH // 2 // 2 * zoo.SEQ * TOP_K * zoo.HIDDEN * 4
    for rank, r in enumerate(world("pipeline_hf.py", "mixtral", nproc=4)):
        torch.testing.assert_close(r["losses"], r["want_losses"], rtol=1e-4, atol=0)
        assert r["not_close"] == [], (rank, r["max_param_err"])
        assert r["gathers"] == [] and r["exchanges"] == [rows] * 4, (rank, r)


TOKENS = 32


def _experts(implementation):
    """Mixtral's experts module alone (hidden 32, ffn 16, 8 experts, top-2; seeded random weights),
    run by transformers' experts ``implementation``, its params, and a routing of TOKENS tokens."""
    import transformers as T

    config = T.MixtralConfig(
        hidden_size=32,
        intermediate_size=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        experts_implementation=implementation,
    )
    torch.manual_seed(0)
    module = T.models.mixtral.modeling_mixtral.MixtralExperts(config)
    for w in module.parameters():
        torch.nn.init.normal_(w, std=0.1)
    g = torch.Generator().manual_seed(0)
    gates, index = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=g), -1).topk(TOP_K, -1)
    return module, vsf.tree.from_module(module), (torch.randn(TOKENS, 32, generator=g), index, gates)


def _loss_of(module):
    def loss(p, x, index, gates):
        return (vsf.tree.apply(module, p, x, index, gates) ** 2).sum()

    return loss


def _jitted_like_one_device(
    sim,
    implementation: str,
    tokens_spec: P,
    axes: tuple[str, str] = ("dp", "ep"),
    weights: P | dict[str, P] = P("ep"),
) -> tuple[Any, tuple]:
    """The experts module (``_experts(implementation)``) with its two weights ``weights`` (one spec
    for both, or each its own) and its
    tokens ``tokens_spec`` on a 2 x 2 mesh ``axes`` of 4 simulated ranks, jitted: the loss and the
    gradients (both weights, the tokens) are those of the same function on one device, under the
    ``vsf.config`` switches set now. Returns the jitted function and its arguments."""
    module, params, batch = _experts(implementation)
    grad_of = vsf.value_and_grad(_loss_of(module), argnums=(0, 1))
    want_loss, (want, want_x) = grad_of(params, *batch)
    sim(4)
    mesh = vsf.make_mesh((2, 2), axes)
    tokens = vsf.NamedSharding(mesh, tokens_spec)
    specs = weights if isinstance(weights, dict) else dict.fromkeys(params, weights)
    args = (
        vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)),
        *(vsf.device_put(t, tokens) for t in batch),
    )
    step = vsf.jit(grad_of)
    loss, (grads, grad_x) = step(*args)
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(vsf.device_get(grad_x), want_x, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(
            vsf.device_get(grads[k]), want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"d loss / d {k}: {m}"
        )
    return step, args


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_an_experts_module_split_on_the_expert_dim_dispatches_its_tokens(sim, implementation):
    """transformers' experts module, its two weights ``P("ep")``, nothing else said: the loss and
    the gradients (both weights, the tokens) are one device's, and over ``ep`` the plan sends the
    per-expert counts, the dispatch and combine (forward and backward, each the rank's 8 tokens x
    top-2 x 32 floats) and the loss, and no weight ("eager": transformers' per-expert loop,
    replaced all the same)."""
    step, args = _jitted_like_one_device(sim, implementation, P(("dp", "ep")))
    over_ep = sorted((c.kind, c.bytes) for c in step.lower(*args).cost().collectives if c.axis == "ep")
    assert (
        over_ep
        == [("all_gather", EXPERTS * 8), ("all_reduce", 4)] + [("all_to_all_v", TOKENS // 4 * TOP_K * 32 * 4)] * 4
    )


def test_an_experts_module_further_split_over_fsdp_dispatches_tokens_split_over_both(sim):
    """efsdp from specs alone: the experts module's weights ``P("ep", "fsdp")`` (fsdp splits
    gate_up's ffn dim and down's hidden dim: stored split, as FSDP does) on an ``("fsdp", "ep")``
    mesh, the tokens over both: loss and gradients are one device's; over ep the four exchanges
    each send a rank's 8 tokens x top-2 x 32 floats (the analytic volume; with fsdp left out of the
    token axes, its fsdp group's 16 tokens: twice as much), over fsdp the weights are gathered
    into the dispatch (a rank's half of its 4 experts' 32x32 and 32x16 floats) and their
    gradients, partial sums over fsdp, all-reduced (returned whole: nothing asks them split), the
    loss too, and no token moves."""
    step, args = _jitted_like_one_device(sim, "grouped_mm", P(("fsdp", "ep")), ("fsdp", "ep"), P("ep", "fsdp"))
    collectives = step.lower(*args).cost().collectives
    assert [c.bytes for c in collectives if c.axis == "ep" and c.kind == "all_to_all_v"] == [
        TOKENS // 4 * TOP_K * 32 * 4
    ] * 4
    half = EXPERTS // 2 * (32 * 32 + 32 * 16) * 4 // 2
    over_fsdp = sorted((c.kind, c.bytes) for c in collectives if c.axis == "fsdp")
    assert over_fsdp == [("all_gather", half), ("all_reduce", 4), ("all_reduce", 2 * half)]


def test_an_experts_module_with_its_ffn_over_tp_dispatches_over_ep_alone(sim):
    """The experts over ep and their ffn over tp (``EXPERTS_TP``: gate_up packed) on an
    ``("ep", "tp")`` mesh, the tokens over ep (tp's ranks hold the same tokens): the token axes
    leave tp out (it splits the weights' ffn dims alone), so over ep the four exchanges each send
    a rank's 16 tokens x top-2 x 32 floats (its ep group's half; the analytic volume), with the
    per-expert counts and the loss, and no weight. Over tp the experts are Megatron-split: each
    rank runs its slice of every expert's gate and up and its rows of down, and the plan sends two
    all-reduces, the down projection's partial sums forward and the received rows' gradient
    backward, each the receive buffer's 2 ep ranks x 32 rows x 32 floats (a ring of 2 sends all
    of it once), and no weight. Loss and gradients are one device's."""
    step, args = _jitted_like_one_device(sim, "grouped_mm", P("ep"), ("ep", "tp"), EXPERTS_TP)
    collectives = step.lower(*args).cost().collectives
    over_ep = sorted((c.kind, c.bytes) for c in collectives if c.axis == "ep")
    assert (
        over_ep
        == [("all_gather", EXPERTS * 8), ("all_reduce", 4)] + [("all_to_all_v", TOKENS // 2 * TOP_K * 32 * 4)] * 4
    )
    rows = 2 * TOKENS // 2 * TOP_K  # the receive buffer: every ep rank's 16 tokens x top-2
    assert [(c.kind, c.bytes) for c in collectives if c.axis == "tp"] == [("all_reduce", rows * 32 * 4)] * 2


def test_the_dispatch_takes_tokens_split_against_the_mesh_order_as_they_arrive(sim):
    """The tokens ``P(("ep", "dp"))`` on a ``("dp", "ep")`` mesh (ep major, against the mesh's
    order): the plan takes the dispatch's token axes in that order (the cheaper of the two, both
    planned), so nothing regathers them. Over dp: the loss and the experts' gradients (4 experts'
    32x32 and 32x16 floats, all-reduced: 2(n-1)/n = 1 of them); over ep: the loss, the per-expert
    counts and the four exchanges of a rank's 8 tokens x top-2 x 32 floats. Loss and gradients are
    one device's."""
    step, args = _jitted_like_one_device(sim, "grouped_mm", P(("ep", "dp")))
    got = sorted((c.axis, c.kind, c.bytes) for c in step.lower(*args).cost().collectives)
    exchange = ("ep", "all_to_all_v", TOKENS // 4 * TOP_K * 32 * 4)
    experts = EXPERTS // 2 * (32 * 32 + 32 * 16) * 4
    assert got == sorted(
        [
            ("dp", "all_reduce", 4),
            ("dp", "all_reduce", experts),
            ("ep", "all_gather", EXPERTS * 8),
            ("ep", "all_reduce", 4),
        ]
        + [exchange] * 4
    )


def test_the_dispatch_takes_tokens_merged_from_batch_and_sequence_splits_as_they_arrive(sim):
    """The experts module on tokens ``[batch, seq]`` split ``[batch@ep, seq@cp]`` on a ``("cp",
    "ep")`` mesh, merged into rows as a model's MoE layer does: each rank holds half of each of its
    ep group's 2 sequences, ``S(0)/sf4`` over cp, which neither order of the dispatch's token axes
    is. The dispatch takes the rows as they arrive (a strided shard) and gives its result and the
    tokens' gradient back so: no token moves over ep or cp around it (the mesh's order regathered
    them over both). Over ep: the loss, the per-expert counts and the four exchanges of a rank's 8
    tokens x top-2 x 32 floats; over cp: the loss, the experts' gradients (4 experts' 32x32 and
    32x16 floats, all-reduced: 2(n-1)/n = 1 of them), and the loss's backward seed, replicated,
    which the squares' gradient takes gathered over cp (a rank's 8 rows x 32 floats, half sent).
    Loss and gradients are one device's."""
    module, params, batch = _experts("grouped_mm")
    loss_of = _loss_of(module)

    def loss(p, x, index, gates):
        return loss_of(p, *(t.reshape(TOKENS, *t.shape[2:]) for t in (x, index, gates)))

    merged = tuple(t.reshape(4, TOKENS // 4, *t.shape[1:]) for t in batch)
    grad_of = vsf.value_and_grad(loss, argnums=(0, 1))
    want = grad_of(params, *merged)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("cp", "ep"))
    tokens = vsf.NamedSharding(mesh, P("ep", "cp"))
    args = (vsf.device_put(params, vsf.NamedSharding(mesh, P("ep"))), *(vsf.device_put(t, tokens) for t in merged))
    step = vsf.jit(grad_of)
    torch.testing.assert_close(vsf.device_get(step(*args)), want, rtol=1e-5, atol=1e-6)
    lowered = step.lower(*args)
    got = sorted((c.axis, c.kind, c.bytes) for c in lowered.cost().collectives)
    exchange = ("ep", "all_to_all_v", TOKENS // 4 * TOP_K * 32 * 4)
    experts = EXPERTS // 2 * (32 * 32 + 32 * 16) * 4
    assert got == sorted(
        [
            ("cp", "all_gather", TOKENS // 4 * 32 * 4),
            ("cp", "all_reduce", 4),
            ("cp", "all_reduce", experts),
            ("ep", "all_gather", EXPERTS * 8),
            ("ep", "all_reduce", 4),
        ]
        + [exchange] * 4
    )
    assert "manual_in(%view:f32[32@<cp/sf4,ep>,32])" in lowered.as_text()


def test_with_dispatch_experts_off_the_same_specs_gather_the_experts(sim, monkeypatch):
    """``vsf.config.dispatch_experts = False``: the experts module planned as transformers runs it,
    one device's numbers, its weights brought to the tokens (each rank sends its 4 experts' 32x32
    and 32x16 floats over ep) and no exchange; switching it back plans again, saying why."""
    monkeypatch.setattr(vsf.config, "dispatch_experts", False)
    step, args = _jitted_like_one_device(sim, "grouped_mm", P(("dp", "ep")))
    over_ep = [c for c in step.lower(*args).cost().collectives if c.axis == "ep"]
    assert not [c for c in over_ep if c.kind == "all_to_all_v"]
    assert [c.bytes for c in over_ep if c.kind == "all_gather" and c.bytes >= 4096] == [
        EXPERTS // 2 * (32 * 32 + 32 * 16) * 4
    ]
    monkeypatch.setattr(vsf.config, "dispatch_experts", True)
    step.lower(*args)
    assert step.replans[-1] == "options changed: vsf.config.dispatch_experts False -> True"


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            {"gate_up_proj": P("ep"), "down_proj": P()},
            r"MixtralExperts: its weights split the expert dim \(dim 0\) differently \(args\[0\]\['gate_up_proj'\] is P\('ep'\); args\[0\]\['down_proj'\] is P\(\)\)",
        ),
        (
            {"gate_up_proj": P(("dp", "ep")), "down_proj": P(("dp", "ep"))},
            r"MixtralExperts: its weights split the expert dim \(dim 0\) over \('dp', 'ep'\) .*: vsf dispatches tokens over one mesh axis",
        ),
        (
            {"gate_up_proj": P("ep"), "down_proj": P("ep")},
            r"MixtralExperts: its experts split over 'ep' take 30 tokens, which the 4 ranks of the token axes \('dp', 'ep'\) .* do not divide",
        ),
    ],
    ids=["one-weight-split", "two-axes", "tokens-indivisible"],
)
def test_an_expert_split_vsf_cannot_dispatch_is_an_error(sim, specs, message):
    module, params, batch = _experts("grouped_mm")
    batch = batch if "30 tokens" not in message else tuple(t[:30] for t in batch)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "ep"))
    p = {k: vsf.device_put(v, vsf.NamedSharding(mesh, specs[k])) for k, v in params.items()}
    with pytest.raises(vsf.PlanError, match=message):
        vsf.jit(_loss_of(module)).lower(p, *batch)


def test_a_model_without_transformers_experts_is_an_error(sim):
    model, _ = zoo.built(zoo.families()["llama"])
    sim(2)
    mesh = vsf.make_mesh((2,), ("ep",))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no transformers experts module"):
        vsf.nn.use_expert_parallel(model, axis="ep", mesh=mesh)


def test_replicated_experts_on_dp_run_on_each_ranks_own_tokens_and_train_like_torch(sim):
    """Data parallelism over two MoE blocks (every weight replicated, the batch over dp): each rank
    runs the experts on its own tokens, as DDP does, and the step sends only the all-reduce of the
    gradients: by hand, every param's bytes (a ring of 2 sends each byte once) and the loss's 4.
    The old planner gathered each block's tokens and their routing over dp (the experts'
    implementation sorts the tokens by expert: on the whole batch, every rank held every rank's
    tokens). The losses and the params after 3 AdamW steps are torch's on one device."""
    blocks = _moe_blocks()
    params = vsf.tree.from_module(blocks)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, 16, generator=g), torch.randn(4, 4, 16, generator=g)) for _ in range(3)]
    want = _torch_blocks(blocks, batches)
    tx = zoo.adamw()

    def loss_fn(p, x, target):
        for s, block in enumerate(blocks):
            x = x + vsf.tree.apply(block, {k[2:]: v for k, v in p.items() if k.startswith(f"{s}.")}, x)
        return _squared_error(x, target)

    @vsf.jit
    def step(p, s, x, target):
        loss, grads = vsf.value_and_grad(loss_fn)(p, x, target)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s, loss

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    s = optim.init_sharded(tx, p)
    losses = []
    for x, target in batches:
        p, s, loss = step(p, s, *vsf.device_put((x, target), vsf.NamedSharding(mesh, P("dp"))))
        losses.append(vsf.device_get(loss))
    zoo.assert_like_oracle("moe blocks dp", losses, vsf.device_get(p), want)
    collectives = step.lower(p, s, *vsf.device_put(batches[0], vsf.NamedSharding(mesh, P("dp")))).cost().collectives
    assert {c.kind for c in collectives} == {"all_reduce"}, [(c.kind, c.bytes) for c in collectives]
    assert sum(c.bytes for c in collectives) == sum(v.numel() * v.element_size() for v in params.values()) + 4
