"""Expert parallelism on torchtitan's MoE (torchtitan 0.3: ``torchtitan.models.common.moe.MoE``, its
top-k router, token dispatcher and grouped experts with separate ``w1_EFD``, ``w3_EFD`` and
``w2_EDF`` weights, the expert dim first): two MoE layers with residual connections (tiny config
built here, seeded random weights), the experts split over ``ep`` on the expert dim and the tokens
over the batch's axes. ``vsf.jit`` recognises torchtitan's routed experts while it traces and sends
the tokens to the experts. Oracles: the same layers trained by plain PyTorch on one device (losses,
params after 3 AdamW steps, the routers' token counts), and the analytic dispatch + combine volume,
computed here by hand.

torchtitan 0.3's MoE imports ``triton`` (its async-EP kernels, imported by the token dispatcher
whatever the backend), ``spmd_types`` and ``tyro``: without them this file is skipped."""

from __future__ import annotations

import copy

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


def moe_config() -> titan.MoE.Config:
    return titan.MoE.Config(
        num_experts=EXPERTS,
        router=titan.TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=Linear.Config(in_features=HIDDEN, out_features=EXPERTS),
            top_k=TOP_K,
            score_func="softmax",
        ),
        routed_experts=titan.RoutedExperts.Config(
            inner_experts=titan.GroupedExperts.Config(dim=HIDDEN, hidden_dim=FFN, num_experts=EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
        ),
    )


class Layers(torch.nn.Module):
    """torchtitan MoE layers, each with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([moe_config().build() for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def built() -> tuple[Layers, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = Layers()
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


def torch_run(model: Layers, batches, parts: int):
    """The layers trained by plain PyTorch on one device, each batch's gradient accumulated over its
    ``parts`` consecutive slices: the losses, and the params and token counts after 3 AdamW steps.

    torchtitan's experts compute in bf16 (its grouped mm casts to bf16), so an expert's gradient
    is rounded to bf16 once for each slice of the batch that computes it: data parallelism (DDP,
    FSDP, vsf's dp) sums each rank's rounded gradient, and the whole batch at once differs from
    that by bf16 roundings (here up to 5e-4 in a param after 3 steps, against 1e-6)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=zoo.LR, betas=zoo.BETAS, eps=zoo.EPS, weight_decay=zoo.WEIGHT_DECAY)
    losses = []
    for x, target in batches:
        opt.zero_grad()
        loss = sum(squared_error(model(xi), ti) / parts for xi, ti in zip(x.chunk(parts), target.chunk(parts)))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return (losses, {k: v.detach() for k, v in model.named_parameters()}), counts_of(model)


# (mesh axes, the batch's spec, the experts' spec): the experts over ep, or further split over fsdp
# (torchtitan's efsdp: fsdp splits w1/w3's ffn dim and w2's hidden dim, a storage split)
LAYOUTS = {
    "dp_ep": (("dp", "ep"), P(("dp", "ep")), P("ep")),
    "fsdp_ep": (("fsdp", "ep"), P(("fsdp", "ep")), P("ep", "fsdp")),
}


@pytest.mark.parametrize("layout", ["dp_ep", pytest.param("fsdp_ep", marks=pytest.mark.sweep)])
def test_torchtitan_moe_on_ep_trains_like_torch_on_one_device_sending_tokens_not_experts(sim, layout):
    """torchtitan's MoE layers, their experts ``P("ep")`` (or ``P("ep", "fsdp")``) and the batch
    over both mesh axes, from specs alone: the losses, the params after 3 AdamW steps and the
    routers' token counts (carried as mutable state) are torch's on one device (the batch's gradient
    summed over its halves, as dp splits it: see torch_run). Over ep each
    exchange sends a rank's 8 tokens x top-2 x 16 floats, 1,024 B: per layer the dispatch and
    combine and the combine's transpose in the backward, and the dispatch's transpose where the
    layer's input needs a gradient (not the first layer's: 7 exchanges, under the analytic
    4 x 2 x 1,024 B); the per-expert counts are gathered once a layer and no expert weight moves."""
    axes, batch_spec, experts_spec = LAYOUTS[layout]
    model, batches = built()
    (want_losses, want_params), want_counts = torch_run(model, batches, parts=2)  # the batch's halves over dp / fsdp
    params = vsf.tree.from_module(model)
    tx = zoo.adamw()
    sim(4)
    mesh = vsf.make_mesh((2, 2), axes)
    p = vsf.device_put(
        params, vsf.NamedSharding.tree(mesh, {k: experts_spec if ".inner_experts." in k else P() for k in params})
    )
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
    lowered = step.lower(p, s, counts, x, target)
    assert lowered.as_text().count("all_to_all_v over ep (inside shard_map(expert_dispatch))") == 4 * LAYERS - 1
    over_ep = [c for c in lowered.cost().collectives if c.axis == "ep"]
    rank_copies = BATCH * SEQ // 4 * TOP_K
    exchanges = [c.bytes for c in over_ep if c.kind == "all_to_all_v"]
    assert exchanges == [rank_copies * HIDDEN * 4] * (4 * LAYERS - 1)
    assert sum(exchanges) <= 4 * LAYERS * rank_copies * HIDDEN * 4
    assert [c.bytes for c in over_ep if c.kind == "all_gather"] == [EXPERTS * 8] * LAYERS  # [ep ranks, experts] int64
    # no expert weight over ep, nor its gradient: nothing else is gathered there, and what is reduced
    # there (the routers' gradients, the loss, the token counts) is under one local expert weight
    assert {c.kind for c in over_ep} == {"all_to_all_v", "all_gather", "all_reduce"}
    local_weight = EXPERTS // 2 * HIDDEN * FFN * 4
    assert sum(c.bytes for c in over_ep if c.kind == "all_reduce") < local_weight


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
