"""Expert parallelism on torchtitan's MoE (torchtitan 0.3: ``torchtitan.models.common.moe.MoE``, its
top-k router, token dispatcher and grouped experts with separate ``w1_EFD``, ``w3_EFD`` and
``w2_EDF`` weights, the expert dim first): two MoE layers with residual connections (tiny config
built here, seeded random weights), the experts split over ``ep`` on the expert dim and the tokens
over the batch's axes. ``vsf.jit`` recognises torchtitan's routed experts while it traces and sends
the tokens to the experts. Oracles: the same layers trained by plain PyTorch on one device (losses,
params after 3 AdamW steps, the routers' token counts), and the analytic dispatch + combine volume,
computed here by hand.

torchtitan 0.3's MoE imports ``triton`` (its async-EP kernels, imported by the token dispatcher
whatever the backend), ``spmd_types`` and ``tyro``: without them this file is skipped (``pip install
torch==2.13.0 -e ".[test,titan]"`` installs them; CI does not)."""

from __future__ import annotations

import copy
import types
from collections.abc import Sequence

import pytest
import torch
import zoo

import vsf
from vsf import P, optim

titan = pytest.importorskip("torchtitan.models.common.moe", reason="torchtitan 0.3 with triton, spmd_types and tyro")
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

pytestmark = [
    pytest.mark.models,
    # torchtitan's router computes its scores under CPU autocast to fp32, which torch turns off with a warning
    pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning"),
]

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 16, 8, 4, 2, 2
BATCH, SEQ = 8, 4  # 32 tokens a step, 8 a rank on 4 ranks


def moe_config(ffn: int = FFN) -> titan.MoE.Config:
    return titan.MoE.Config(
        num_experts=EXPERTS,
        router=titan.TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=Linear.Config(in_features=HIDDEN, out_features=EXPERTS),
            top_k=TOP_K,
            score_func="softmax",
        ),
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=titan.GroupedExperts.Config(dim=HIDDEN, hidden_dim=ffn, num_experts=EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
        ),
    )


class Layers(torch.nn.Module):
    """torchtitan MoE layers, each with a residual connection."""

    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([moe_config(ffn).build() for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def built(ffn: int = FFN) -> tuple[Layers, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = Layers(ffn)
    for w in model.parameters():
        torch.nn.init.normal_(w, std=0.3)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)) for _ in range(3)
    ]
    return model, batches


def squared_error(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def counts_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The routers' token counts (``tokens_per_expert_E``, written by each training forward)."""
    buffers = vsf.tree.from_module(model, params=False, buffers=True)
    return {k: v for k, v in buffers.items() if k.endswith("tokens_per_expert_E")}


def torch_run(model: Layers, batches, groups: Sequence[Sequence[int]], dim: int = 0, ffn_parts: int = 1):
    """The layers trained by plain PyTorch on one device, each batch's gradient accumulated over its
    ``groups`` of indices along ``dim`` (0: the batch, 1: the sequence; each group's mean loss
    weighted alike), each expert's ffn computed in ``ffn_parts`` slices (:func:`ffn_sliced`): the
    losses, and the params and token counts after 3 AdamW steps.

    torchtitan's experts compute in bf16 (its grouped mm casts to bf16), so an expert's gradient
    is rounded to bf16 once for each slice of the tokens that computes it: data parallelism (DDP,
    FSDP, vsf's dp) sums each rank's rounded gradient, and the whole batch at once differs from
    that by bf16 roundings (here up to 5e-4 in a param after 3 steps, against 1e-6). A rank's
    experts take the tokens of its ep group alike: the groups are the tokens that the layout's
    other axes (dp, fsdp, cp; a pipeline's microbatches) split apart."""
    model = copy.deepcopy(model)
    if ffn_parts > 1:
        for m in model.modules():
            if isinstance(m, titan.GroupedExperts):
                m.forward = ffn_sliced(m, ffn_parts)
    opt = torch.optim.AdamW(model.parameters(), lr=zoo.LR, betas=zoo.BETAS, eps=zoo.EPS, weight_decay=zoo.WEIGHT_DECAY)
    losses = []
    for x, target in batches:
        opt.zero_grad()
        loss = sum(
            squared_error(
                model(x.index_select(dim, torch.tensor(list(g)))), target.index_select(dim, torch.tensor(list(g)))
            )
            / len(groups)
            for g in groups
        )
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return (losses, {k: v.detach() for k, v in model.named_parameters()}), counts_of(model)


def ffn_sliced(experts: titan.GroupedExperts, parts: int):
    """torchtitan's ``GroupedExperts.forward`` on one device with each expert's ffn cut in
    ``parts`` slices, each slice's output (its down projection's partial sum) rounded to bf16 and
    the slices summed, rounded to bf16 again: the arithmetic of tensor parallelism over ``parts``
    ranks (each a slice of w1 and w3's ffn rows and w2's ffn columns, the bf16 partial sums
    all-reduced), which differs from one bf16 sum over the whole ffn by bf16 roundings (here up to
    1e-3 in a loss)."""
    forward = type(experts).forward

    def sliced(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        cuts = [
            forward(
                types.SimpleNamespace(
                    w1_EFD=experts.w1_EFD[:, f],
                    w3_EFD=experts.w3_EFD[:, f],
                    w2_EDF=experts.w2_EDF[..., f],
                    _grouped_mm=experts._grouped_mm,
                ),
                x,
                counts,
            )
            for f in torch.arange(experts.w1_EFD.shape[1]).chunk(parts)
        ]
        return sum(cuts).bfloat16().type_as(x)

    return sliced


def _alike(spec: P) -> dict[str, P]:
    return dict.fromkeys(("w1_EFD", "w3_EFD", "w2_EDF"), spec)


BATCH_HALVES = (range(BATCH // 2), range(BATCH // 2, BATCH))  # the batch split over dp or fsdp
# (mesh axes, the batch's spec, each expert weight's spec, the experts' ffn, the oracle's (token
# groups, their dim, ffn slices): how the layout rounds the bf16 experts, see torch_run). The
# experts over ep; further split over fsdp (torchtitan's efsdp: fsdp splits w1/w3's ffn dim and
# w2's hidden dim, a storage split); their ffn over tp (torchtitan's ETP: w1/w3 column-parallel,
# w2 row-parallel; ffn 16, so that a rank's 8 bf16 columns are the 16 bytes DTensor's grouped mm
# asks of a split weight's rows); the sequence over cp
LAYOUTS = {
    "dp_ep": (("dp", "ep"), P(("dp", "ep")), _alike(P("ep")), FFN, (BATCH_HALVES, 0, 1)),
    "fsdp_ep": (("fsdp", "ep"), P(("fsdp", "ep")), _alike(P("ep", "fsdp")), FFN, (BATCH_HALVES, 0, 1)),
    "ep_tp": (
        ("ep", "tp"),
        P("ep"),
        {"w1_EFD": P("ep", "tp", None), "w3_EFD": P("ep", "tp", None), "w2_EDF": P("ep", None, "tp")},
        2 * FFN,
        ((range(BATCH),), 0, 2),
    ),
    "ep_cp": (("ep", "cp"), P("ep", "cp"), _alike(P("ep")), FFN, ((range(SEQ // 2), range(SEQ // 2, SEQ)), 1, 1)),
}


def trained(sim, layout: str):
    """torchtitan's MoE layers trained 3 AdamW steps by vsf.jit on ``LAYOUTS[layout]``'s 2 x 2
    mesh, from specs alone, checked against torch on one device (torch_run, rounding as the layout
    does): the losses, every param and the routers' token counts (carried as mutable state).
    Returns the lowered step on the first batch and the experts' ffn."""
    axes, batch_spec, experts_specs, ffn, (groups, dim, ffn_parts) = LAYOUTS[layout]
    model, batches = built(ffn)
    (want_losses, want_params), want_counts = torch_run(model, batches, groups, dim, ffn_parts)
    params = vsf.tree.from_module(model)
    tx = zoo.adamw()
    sim(4)
    mesh = vsf.make_mesh((2, 2), axes)
    specs = {k: experts_specs.get(k.rsplit(".", 1)[-1], P()) for k in params}
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    counts = vsf.device_put(counts_of(model), vsf.NamedSharding.tree(mesh, {k: P() for k in counts_of(model)}))
    s = optim.init_sharded(tx, p)

    def loss_fn(p, counts, x, target):
        y, counts = vsf.tree.apply(model, {**p, **counts}, x, mutable=True)
        return squared_error(y, target), counts

    def train_step(p, s, counts, x, target):
        (loss, counts), grads = vsf.value_and_grad(loss_fn, has_aux=True)(p, counts, x, target)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s, counts, loss

    step = vsf.jit(train_step)
    tokens = vsf.NamedSharding(mesh, batch_spec)
    losses = []
    for x, target in batches:
        p, s, counts, loss = step(p, s, counts, vsf.device_put(x, tokens), vsf.device_put(target, tokens))
        losses.append(vsf.device_get(loss))
    zoo.assert_like_oracle(f"torchtitan moe {layout}", losses, vsf.device_get(p), (want_losses, want_params))
    got_counts = vsf.device_get(counts)
    for k, want in want_counts.items():
        torch.testing.assert_close(got_counts[k], want, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    x, target = (vsf.device_put(t, tokens) for t in batches[0])
    return step.lower(p, s, counts, x, target), ffn


def assert_tokens_sent_not_experts(lowered, rank_tokens: int, ffn: int) -> None:
    """Over ep each exchange sends a rank's ``rank_tokens`` x top-2 x 16 floats: per layer the
    dispatch and combine and the combine's transpose in the backward, and the dispatch's transpose
    where the layer's input needs a gradient (not the first layer's: 7 exchanges, under the
    analytic 4 x 2 of them); the per-expert counts are gathered once a layer and no expert weight
    moves (nothing else is gathered there, and what is reduced there, the routers' gradients, the
    loss and the token counts, is under one local expert weight of ``ffn``)."""
    assert lowered.as_text().count("all_to_all_v over ep (inside shard_map(expert_dispatch))") == 4 * LAYERS - 1
    over_ep = [c for c in lowered.cost().collectives if c.axis == "ep"]
    exchanges = [c.bytes for c in over_ep if c.kind == "all_to_all_v"]
    assert exchanges == [rank_tokens * TOP_K * HIDDEN * 4] * (4 * LAYERS - 1)
    assert sum(exchanges) <= 4 * LAYERS * rank_tokens * TOP_K * HIDDEN * 4
    assert [c.bytes for c in over_ep if c.kind == "all_gather"] == [EXPERTS * 8] * LAYERS  # [ep ranks, experts] int64
    assert {c.kind for c in over_ep} == {"all_to_all_v", "all_gather", "all_reduce"}
    assert sum(c.bytes for c in over_ep if c.kind == "all_reduce") < EXPERTS // 2 * HIDDEN * ffn * 4


@pytest.mark.parametrize("layout", ["dp_ep", pytest.param("fsdp_ep", marks=pytest.mark.sweep)])
def test_torchtitan_moe_on_ep_trains_like_torch_on_one_device_sending_tokens_not_experts(sim, layout):
    """torchtitan's MoE layers, their experts ``P("ep")`` (or ``P("ep", "fsdp")``) and the batch
    over both mesh axes, from specs alone: the losses, the params after 3 AdamW steps and the
    routers' token counts are torch's on one device (the batch's gradient summed over its halves,
    as dp splits it: see torch_run). Over ep each exchange sends a rank's 8 tokens x top-2 x 16
    floats, 1,024 B, 7 of them (assert_tokens_sent_not_experts); no expert weight moves."""
    lowered, ffn = trained(sim, layout)
    assert_tokens_sent_not_experts(lowered, BATCH * SEQ // 4, ffn)


@pytest.mark.sweep
def test_torchtitan_moe_on_ep_x_tp_runs_each_experts_ffn_split_like_torch_on_one_device(sim):
    """torchtitan's ETP from specs alone: the experts over ep, each expert's ffn over tp (w1 and w3
    ``P("ep", "tp", None)``, w2 ``P("ep", None, "tp")``), the batch over ep (tp ranks hold the same
    tokens): the losses, params after 3 AdamW steps and token counts are torch's on one device
    with the ffn's two halves summed in bf16 as tp's ranks sum them (torch_run's ffn_parts; one
    bf16 sum over the whole ffn is up to 1e-3 off in a loss). Over ep each exchange sends a rank's
    16 tokens x top-2 x 16 floats (its ep group's batch half; 2,048 B). Over tp no weight moves:
    per layer the down projection's partial sums over the 64 rows of the dispatch's receive buffer
    (2 ranks x 16 tokens x top-2) are all-reduced, 64 x 16 bf16, and in the backward the second
    layer's input gradient, the two up projections' partial sums, 64 x 16 floats (the first
    layer's input needs none)."""
    lowered, ffn = trained(sim, "ep_tp")
    assert_tokens_sent_not_experts(lowered, BATCH * SEQ // 2, ffn)
    over_tp = sorted((c.kind, c.bytes) for c in lowered.cost().collectives if c.axis == "tp")
    assert over_tp == [("all_reduce", 64 * HIDDEN * 2)] * LAYERS + [("all_reduce", 64 * HIDDEN * 4)]


@pytest.mark.sweep
def test_torchtitan_moe_on_ep_x_cp_dispatches_each_ranks_sequence_shard_like_torch_on_one_device(sim):
    """The batch over ep and the sequence over cp, the experts ``P("ep")``: each rank dispatches
    its 2 sequences' 2 positions (torchtitan's MoE routes each token alone), so over ep each
    exchange sends a rank's 8 tokens x top-2 x 16 floats; the losses, params after 3 AdamW steps
    and token counts are torch's on one device (the gradient summed over the sequence's halves, as
    cp splits it). No token moves over cp: there the experts' gradients (a rank's 2 experts' three
    16 x 8 weights a layer) are all-reduced in one bucket, and the routers' gradients (4 x 16 a
    layer), the token counts (4 a layer) and the loss in another."""
    lowered, ffn = trained(sim, "ep_cp")
    assert_tokens_sent_not_experts(lowered, BATCH * SEQ // 4, ffn)
    over_cp = sorted((c.kind, c.bytes) for c in lowered.cost().collectives if c.axis == "cp")
    experts = LAYERS * 3 * EXPERTS // 2 * HIDDEN * ffn * 4
    assert over_cp == sorted([("all_reduce", experts), ("all_reduce", (LAYERS * (EXPERTS * HIDDEN + EXPERTS) + 1) * 4)])


@pytest.mark.sweep
def test_torchtitan_moe_pipelined_on_pp_x_ep_trains_like_torch_on_one_device_counting_tokens(sim):
    """The two MoE layers in two stages over pp (each with its residual connection), 1F1B, two
    microbatches, the experts ``P("ep")`` and the batch over ep, in training mode: each stage's
    router writes its token counts in forward, which its program returns and the next microbatch's
    forward reads (the pipeline's state). The losses, the params after 3 AdamW steps and the
    routers' token counts are torch's on one device (the gradient summed over the microbatches: a
    rank's 4 sequences cut in two, so microbatch m holds sequences 2m, 2m+1, 4+2m and 5+2m; the
    counts, over the whole batch, of 3 x 32 tokens x top-2). The pipeline keeps the experts split
    (it gathers no param once a step: gathered, torchtitan's combine runs its scatter-add custom
    op, which has no plan without rules, so the dispatch is the plan), and each stage's program
    exchanges its microbatch's tokens over ep (a rank's 2 sequences of 4 tokens x top-2 x 16
    floats): the dispatch and combine, the combine's transpose in the backward and on stage 1,
    whose input needs a gradient, the dispatch's, and it all-reduces the microbatch's token
    counts (each rank counted its own tokens; 4 f32); the gradients reduced once a step over ep are
    the router's alone."""
    model, batches = built()
    microbatches = ((0, 1, 4, 5), (2, 3, 6, 7))
    (want_losses, want_params), want_counts = torch_run(model, batches, microbatches)
    params = vsf.tree.from_module(model)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("pp", "ep"))

    def stage(s):
        prefix = f"layers.{s}."

        def layer(p, counts, x):
            own = {k[len(prefix) :]: v for k, v in {**p, **counts}.items()}
            y, written = vsf.tree.apply(model.layers[s], own, x, mutable=True)
            return x + y, {prefix + k: v for k, v in written.items()}

        return layer

    pipe = vsf.pipeline.Pipeline(
        [stage(0), stage(1)], squared_error, [["layers.0."], ["layers.1."]], mesh=mesh, microbatches=2, batch=P("ep")
    )
    p, layout = pipe.place(params, {k: P("ep") if ".inner_experts." in k else P() for k in params})
    counts = pipe.place(counts_of(model), state=True)
    lowered = pipe.lower(p, *batches[0], layout=layout, state=counts)
    trained, losses, got_counts = zoo.train_pipelined(pipe, zoo.adamw(), (p, layout), batches, state=counts)
    zoo.assert_like_oracle("torchtitan moe pp x ep", losses, vsf.device_get(trained), (want_losses, want_params))
    got_counts = vsf.device_get(got_counts)
    assert sum(want_counts.values()).sum() == LAYERS * 3 * BATCH * SEQ * TOP_K
    for k, want in want_counts.items():
        torch.testing.assert_close(got_counts[k], want, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    assert not lowered.gathers
    rows = 2 * SEQ * TOP_K * HIDDEN * 4
    for s, exchanges in ((0, 3), (1, 4)):
        over_ep = sorted((c.kind, c.bytes) for c in lowered.stages[s].cost().collectives if c.axis == "ep")
        assert (
            over_ep == [("all_gather", EXPERTS * 8), ("all_reduce", EXPERTS * 4)] + [("all_to_all_v", rows)] * exchanges
        )
        reduced = [(c.kind, c.bytes) for c in lowered.reducers[s].cost().collectives if c.axis == "ep"]
        assert reduced == [("all_reduce", EXPERTS * HIDDEN * 4)]


def test_replicated_experts_plan_torchtitans_scatter_add_with_the_rules_a_user_registers(sim):
    """Experts not split on the expert dim run as torchtitan runs them: its combine's custom op
    ``torchtitan::deterministic_scatter_add`` has no DTensor strategy, and vsf plans it with the
    rules registered through torch's public ``register_sharding`` (here: all replicated, or the
    accumulator and the rows partial sums). On dp the loss and every gradient are torch's on one
    device; the tokens are gathered over dp into each layer's routing (torchtitan sorts every
    token by expert), so each rank runs every token through the experts (32 tokens x 16 floats)."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.torchtitan.deterministic_scatter_add.default)
    def rules(out, index, src):
        return [
            ([Replicate()], [Replicate(), Replicate(), Replicate()]),
            ([Partial()], [Partial(), Replicate(), Partial()]),
        ]

    model, (batch, *_) = built()
    model.eval()  # (no token counts written)
    want_model = copy.deepcopy(model)
    want_loss = squared_error(want_model(batch[0]), batch[1])
    want_loss.backward()
    params = vsf.tree.from_module(model)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: P() for k in params}))
    x, target = (vsf.device_put(t, vsf.NamedSharding(mesh, P("dp"))) for t in batch)
    step = vsf.jit(
        lambda p, x, target: vsf.value_and_grad(lambda q: squared_error(vsf.tree.apply(model, q, x), target))(p)
    )
    loss, grads = vsf.device_get(step(p, x, target))
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    for k, w in want_model.named_parameters():
        torch.testing.assert_close(grads[k], w.grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"d loss / d {k}: {m}")
    gathered = [c.shape for c in step.lower(p, x, target).cost().collectives if c.kind == "all_gather"]
    assert gathered.count((BATCH * SEQ, HIDDEN)) == LAYERS
