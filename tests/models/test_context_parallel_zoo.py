"""Hugging Face models (tiny random configs, default SDPA attention, GQA where the family has it)
with two sequences, each split over ``cp``: the loss and every gradient equal the one-device run, and
every attention runs on sequence shards (keys and values gathered, or passed around a ring;
queries and output kept split)."""

from __future__ import annotations

import pytest
import torch
import zoo
from context_parallel_checks import (
    assert_attention_on_a_ring,
    assert_attention_on_sequence_shards,
    assert_equal_to_one_device,
    reference,
)

import vsf
from vsf import P

pytestmark = pytest.mark.models


def _causal_lm(name, sequences):
    """The family's model's params, ``sequences`` random token rows, its loss function and the
    one-device loss and gradients (the oracle)."""
    model, _ = zoo.built(zoo.families()[name])
    params = vsf.tree.from_module(model)
    ids = torch.randint(0, zoo.VOCAB, (sequences, zoo.SEQ))

    def loss_fn(p, ids):
        return vsf.tree.apply(model, p, input_ids=ids, labels=ids).loss

    return params, ids, loss_fn, reference(loss_fn, params, (ids,))


# by default each model with one way of moving keys and values, each way with a model; the rest in the sweep
CP_CASES = [
    pytest.param(
        n,
        m,
        id=f"{n}-{m}",
        marks=() if (n, m) in {("gpt2", "ring"), ("llama", "all_gather"), ("mixtral", "ring")} else pytest.mark.sweep,
    )
    for n in ("gpt2", "llama", "mixtral")
    for m in ("all_gather", "ring")
]


@pytest.mark.parametrize("name, mode", CP_CASES)
def test_two_sequences_on_cp_equal_one_device(sim, monkeypatch, name, mode):
    monkeypatch.setattr(vsf.config, "context_parallel", mode)
    # (Mixtral's experts run on each rank's own tokens, split over cp as they come: on two
    # sequences the plan finds it cheaper to split the batch over cp after the first MoE layer, a
    # layout vsf may choose; on one, the sequence is the only split)
    params, ids, loss_fn, want = _causal_lm(name, sequences=1 if name == "mixtral" else 2)
    sim(2)
    mesh = vsf.make_mesh((2,), ("cp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    tokens = vsf.device_put(ids, vsf.NamedSharding(mesh, P(None, "cp")))
    step = vsf.jit(lambda p, ids: vsf.value_and_grad(loss_fn)(p, ids))
    plan = step.lower(p, tokens).plan
    assert_equal_to_one_device(vsf.device_get(step(p, tokens)), want)
    (assert_attention_on_a_ring if mode == "ring" else assert_attention_on_sequence_shards)(plan)


ORDERS = [  # (mesh axes, params' layout, tokens' spec): the batch and the sequence split, the mesh in either order
    (("cp", "dp"), "replicated", P("dp", "cp")),
    (("fsdp", "cp"), "fsdp", P("fsdp", "cp")),
    (("cp", "fsdp"), "fsdp", P("fsdp", "cp")),
]


# by default each axis order once (Llama on fsdp-cp, whose loss was wrong before); the rest in the sweep
ORDER_CASES = [
    pytest.param(
        n,
        *o,
        id=f"{n}-{'-'.join(o[0])}",
        marks=()
        if (n, o[0]) in {("gpt2", ("cp", "dp")), ("llama", ("fsdp", "cp")), ("gpt2", ("cp", "fsdp"))}
        else pytest.mark.sweep,
    )
    for n in ("gpt2", "llama")
    for o in ORDERS
]


@pytest.mark.parametrize("name, axes, kind, spec", ORDER_CASES)
def test_batch_and_sequence_split_on_a_mesh_in_any_axis_order_equal_one_device(sim, name, axes, kind, spec):
    """Merging a ``[batch, seq]`` split into one dim (the tokens' rows) on a mesh whose ``cp`` axis
    comes before the batch's gives strided shards DTensor cannot regather itself (``S(0)/sf4,
    S(0)`` gathered over dp): vsf moves them (one 1D collective of the local shard, or gathered
    and sliced again), and the loss and every gradient are one device's."""
    params, ids, loss_fn, want = _causal_lm(name, sequences=4)
    sim(4)
    mesh = vsf.make_mesh((2, 2), axes)
    specs = {k: P("fsdp") if kind == "fsdp" and v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    tokens = vsf.device_put(ids, vsf.NamedSharding(mesh, spec))
    assert_equal_to_one_device(
        vsf.device_get(vsf.jit(lambda p, ids: vsf.value_and_grad(loss_fn)(p, ids))(p, tokens)), want
    )
