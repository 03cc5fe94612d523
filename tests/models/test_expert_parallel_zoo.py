"""Expert parallelism on the Hugging Face MoE families (the zoo's tiny configs with 8 experts,
top-2: Mixtral by default, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 in the sweep): their experts'
fused weights split over ``ep`` on the expert dim, the tokens over ``("dp", "ep")``, the
experts run through ``vsf.nn.expert_parallel`` (``vsf.nn.use_expert_parallel``: vsf's experts
implementation registered with transformers). Oracles: the model trained by plain PyTorch on one device (params after 3 steps), and
the analytic dispatch + combine volume, computed here by hand."""

from __future__ import annotations

import math

import pytest
import zoo

import vsf
from vsf import P, optim

pytestmark = pytest.mark.models

EXPERTS, TOP_K = 8, 2
MOE_LAYERS = {"mixtral": zoo.LAYERS, "qwen2_moe": zoo.LAYERS, "qwen3_moe": zoo.LAYERS, "deepseek_v3": zoo.LAYERS - 1}  # DeepSeek's first layer is dense
FAMILIES = ["mixtral"] + [pytest.param(f, marks=pytest.mark.sweep) for f in ("qwen2_moe", "qwen3_moe", "deepseek_v3")]


def expert_specs(params):
    return {k: P("ep") if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else P() for k in params}


@pytest.mark.parametrize("name", FAMILIES)
def test_on_dp_x_ep_trains_like_torch_on_one_device_sending_tokens_not_experts(sim, name):
    family = zoo.moe(name, EXPERTS)
    want = zoo.torch_run(family)
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    tx = zoo.adamw()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "ep"))
    vsf.nn.use_expert_parallel(model, axis="ep", token_axes=("dp", "ep"), mesh=mesh)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, expert_specs(params)))
    s = optim.init_sharded(tx, p)
    step = vsf.jit(zoo.train_step(model, tx, family.loss))
    tokens = vsf.NamedSharding(mesh, P(("dp", "ep")))
    losses = []
    for batch in batches:
        p, s, loss = step(p, s, vsf.device_put(batch, tokens))
        losses.append(vsf.device_get(loss))
    zoo.assert_like_oracle(f"{name} dp x ep", losses, vsf.device_get(p), want)

    cost = step.lower(p, s, vsf.device_put(batches[0], tokens)).cost()
    over_ep = [c for c in cost.collectives if c.axis == "ep"]
    # per layer: dispatch and combine forward, their transposes backward, each the rank's tokens
    # (batch x seq / 4 ranks) x top-k x hidden x 4 bytes; and the per-expert counts (int64) once
    rank_tokens = zoo.BATCH * zoo.SEQ // 4
    exchanges = [c.bytes for c in over_ep if c.kind == "all_to_all_v"]
    assert exchanges == [rank_tokens * TOP_K * zoo.HIDDEN * 4] * (4 * MOE_LAYERS[name])
    counts = [c for c in over_ep if c.kind == "all_gather" and c.shape == (2, EXPERTS)]  # [ep ranks, experts] gathered
    assert [c.bytes for c in counts] == [EXPERTS * 8] * MOE_LAYERS[name]
    # no expert weight crosses ep: one layer's local down_proj alone is 32 KiB, the rest gathered
    # over ep (attention's and the loss's activations, as any plan with tokens split over two axes)
    # is smaller altogether
    shard = EXPERTS // 2 * zoo.HIDDEN * zoo.FFN * 4
    gathered = [c for c in over_ep if c.kind == "all_gather" and c.dtype.is_floating_point]
    assert sum(c.bytes for c in gathered) < shard, gathered
    assert not any(math.prod(c.shape) % (EXPERTS * zoo.HIDDEN * zoo.FFN) == 0 for c in gathered), gathered


def test_a_model_without_transformers_experts_is_an_error(sim):
    model, _ = zoo.built(zoo.families()["llama"])
    sim(2)
    mesh = vsf.make_mesh((2,), ("ep",))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no transformers experts module"):
        vsf.nn.use_expert_parallel(model, axis="ep", mesh=mesh)
