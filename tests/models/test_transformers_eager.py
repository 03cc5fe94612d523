"""A Hugging Face Llama (eager attention, no cache) trained through vsf.jit equals one device.

The user's reproduction of issue 14's planner mismatches: plain data parallel over 2 simulated
ranks and Megatron TP on dp x tp. Before the fixes, DP stopped with ``PlanMismatch`` in RMSNorm's
backward (DTensor's sharding cache answered ``sum(x, [2])`` with ``sum(x, [0, 1])``'s layout) and
row-parallel rules on dp x tp with a ``KeyError`` from the cost model (a layout no redistribution
reaches, downstream of the same stale answer).
"""

from __future__ import annotations

import math

import pytest
import torch

import vsf
from vsf import P, optim

transformers = pytest.importorskip("transformers")

STEPS = 3

MEGATRON = [
    (r".*(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight", P("tp")),  # column-parallel
    (r".*(o_proj|down_proj)\.weight", P(None, "tp")),  # row-parallel
    (r".*", P()),
]
# the same split written against the weights' (in, out) reading: still a layout vsf must plan
MEGATRON_TRANSPOSED = [(MEGATRON[0][0], P(None, "tp")), (MEGATRON[1][0], P("tp")), MEGATRON[2]]


def llama_case():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    params = vsf.tree.from_module(model)
    tx = optim.adamw(1e-3)

    def step(p, state, ids):
        loss, grads = vsf.value_and_grad(lambda p, ids: vsf.tree.apply(model, p, input_ids=ids, labels=ids).loss)(
            p, ids
        )
        updates, state = tx.update(grads, state, p)
        return optim.apply_updates(p, updates), state, loss

    return params, torch.randint(1, 64, (4, 16)), tx, step


@pytest.mark.parametrize(
    "layout",
    [((2,), ("dp",), None), ((2, 2), ("dp", "tp"), MEGATRON), ((2, 2), ("dp", "tp"), MEGATRON_TRANSPOSED)],
    ids=["dp", "dp x tp", "dp x tp transposed rules"],
)
def test_llama_matches_one_device(sim, layout):
    params, ids, tx, step = llama_case()
    want, state, want_losses = params, tx.init(params), []
    for _ in range(STEPS):
        want, state, loss = step(want, state, ids)
        want_losses.append(loss)

    shape, names, rules = layout
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    specs = vsf.sharding.match(params, rules) if rules else vsf.tree.map(lambda _: P(), params)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    s = tx.init(p)
    batch = vsf.device_put(ids, vsf.NamedSharding(mesh, P("dp")))
    jitted, losses = vsf.jit(step), []
    for _ in range(STEPS):
        p, s, loss = jitted(p, s, batch)
        losses.append(vsf.device_get(loss))

    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=0)
    # Adam divides each gradient by its own scale, so a near-zero one's last digits (which depend
    # on the reduction order) move its element: on dp x tp one element of layer 1's up_proj, whose
    # gradient is 2.8e-9 (1e-6 of the largest; every gradient is within 5e-7 of the largest of its
    # param), ends 1.4e-5 away after three 1e-3 steps (with plain SGD every param stays within 2e-7
    # relative)
    got = vsf.device_get(p)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
