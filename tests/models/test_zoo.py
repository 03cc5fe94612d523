"""The conformance zoo: models no one here wrote (Hugging Face ``transformers`` families from tiny
random configs, default attention and ``use_cache``), each trained a few steps through
``vsf.jit`` (``value_and_grad`` + ``adamw`` + ``apply_updates``) on simulated ranks in every layout,
and two of them on 4 real gloo processes (dp x tp), against the same model trained by plain
PyTorch (``torch.optim.AdamW``) on one device."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import zoo

import vsf
from vsf import P, optim
from vsf.jit.graph import meta_of

pytestmark = pytest.mark.models

CORE = ["gpt2", "llama", "bert", "t5", "mixtral"]
EXTRA = ["mistral", "qwen2", "gemma", "phi", "gpt_neox", "falcon"]  # other families, on two layouts
MOE = ["qwen2_moe", "qwen3_moe", "deepseek_v3"]  # mixture-of-experts families beside Mixtral, on DP, FSDP and TP
CASES = (
    [(f, l) for f in CORE for l in zoo.LAYOUTS]
    + [(f, l) for f in EXTRA for l in ("dp", "dp_tp")]
    + [(f, l) for f in MOE for l in ("dp", "fsdp", "tp")]
)
# By default each family trains on one layout, and each layout with one core family; the rest of
# the cross product is the sweep (`-m sweep`)
DEFAULT = {
    "gpt2": "5d",
    "llama": "fsdp",
    "bert": "dp",
    "t5": "tp",
    "mixtral": "dp_tp",
    "mistral": "dp",
    "qwen2": "dp",
    "gemma": "dp_tp",
    "phi": "dp_tp",
    "gpt_neox": "dp_tp",
    "falcon": "dp",
    "qwen2_moe": "tp",
    "qwen3_moe": "fsdp",
    "deepseek_v3": "dp",
}
CASES = [
    c if hasattr(c, "values") or DEFAULT.get(c[0], c[1]) == c[1] else pytest.param(*c, marks=pytest.mark.sweep)
    for c in CASES
]


@functools.cache
def _families() -> dict[str, zoo.Family]:
    return zoo.families()


@functools.cache
def _oracle(name: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return zoo.torch_run(_families()[name])


@pytest.mark.parametrize(
    "name, layout",
    CASES,
    ids=[f"{c.values[0]}-{c.values[1]}" if hasattr(c, "values") else f"{c[0]}-{c[1]}" for c in CASES],
)
def test_trains_like_torch_on_one_device(sim, name, layout):
    want = _oracle(name)
    # each layout's core family takes its first step in checking mode: no op may differ from one
    # device's (the other families are held to the oracle's numbers; checking adds ~40% to a step)
    losses, params, step = zoo.jit_train(_families()[name], layout, sim, check=name in CORE and DEFAULT[name] == layout)
    assert step.plan_count == 1
    zoo.assert_like_oracle(f"{name} {layout}", losses, params, want)


# Llama with Hugging Face's activation checkpointing (each decoder layer recomputed in the backward),
# against the oracle without it; the 8-layer cases in the sweep
CHECKPOINTED = [(zoo.LAYERS, "dp")] + [pytest.param(8, layout, marks=pytest.mark.sweep) for layout in ("dp", "dp_tp")]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("layers, layout", CHECKPOINTED)
def test_llama_with_activation_checkpointing_trains_like_torch_without_it(sim, layers, layout):
    """The recompute reads the params being trained (on the old code, from the second step on,
    every gradient was off: the plan held the module's own weights as constants)."""
    losses, params, _ = zoo.jit_train(zoo.llama(layers, checkpointed=True), layout, sim)
    zoo.assert_like_oracle(f"llama x{layers} {layout}", losses, params, zoo.torch_run(zoo.llama(layers)))


def _planned_llama(sim, shape, dtype, seq, sizes):
    """The zoo's two-layer Llama of ``sizes`` (hidden, FFN, heads, KV heads, vocabulary; meta
    weights of ``dtype``), its AdamW step planned (not run) on a 5D mesh of ``shape`` with the zoo's
    5D rules (``fsdp_tp``) and one ``seq``-token sequence a rank of dp x fsdp: its params and its
    ``Lowered``."""
    hidden, ffn, heads, kv_heads, vocab = sizes
    family = zoo.llama(
        2,
        use_cache=False,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
    )
    with torch.device("meta"):
        model = family.build()
    tx = zoo.adamw()
    params = {k: torch.empty(v.shape, dtype=dtype) for k, v in vsf.tree.from_module(model).items()}
    sim(math.prod(shape), compute=False)
    mesh = vsf.make_mesh(shape, ("pp", "dp", "fsdp", "cp", "tp"))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, zoo.specs(params, "fsdp_tp", family)))
    ids = torch.zeros(shape[1] * shape[2], seq, dtype=torch.long)
    batch = vsf.device_put({"input_ids": ids, "labels": ids}, vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    return params, vsf.jit(zoo.train_step(model, tx, family.loss)).lower(p, optim.init_sharded(tx, p), batch)


def test_llama_3_8b_sizes_on_fsdp_send_no_more_than_fsdp(sim):
    """Llama 3 8B's sizes (hidden 4096, FFN 14,336, 32 heads, 8 KV heads, a vocabulary of 128,256,
    bf16), two layers, planned only (meta weights) on 8 fsdp ranks with the zoo's 5D rules and one
    4096-token sequence a rank: the AdamW step sends no more than FSDP's plan (by hand: ``7/8`` of
    the params' bytes twice, 5.2 GB a rank, and two scalar all-reduces). From its token ids
    gathered for the embedding, the cheapest move for it, the plan once moved activations through
    every layer and reduced the logits whole: 21.6 GB a rank."""
    params, lowered = _planned_llama(sim, (1, 1, 8, 1, 1), torch.bfloat16, 4096, (4096, 14336, 32, 8, 128256))
    assert sum(lowered.cost().comm_bytes.values()) <= zoo.fsdp_bytes(params.values(), 8)


def test_llama_on_dp_x_fsdp_all_reduces_each_gradients_fsdp_shard_over_dp(sim):
    """A Llama of hidden 256, FFN 512 and a vocabulary of 8192, two layers, planned only on dp=4 x
    fsdp=4 with one 256-token sequence a rank: what the AdamW step moves over dp of the weights'
    values (gradients, moments, params, updates) is at most HSDP's: each gradient's fsdp shard
    all-reduced, ``2 * 3/4`` of the params' bytes over 4 (by hand). The solver charged dp's
    all-reduce of a gradient at its whole size, where the reduce-scatter over fsdp leaves a
    quarter of it, so it split the update over dp instead (ZeRO-style: the gradient reduce-scattered
    whole over dp, then the update and both moments gathered back each step): 17.2 MB over dp
    where HSDP sends 8.1 MB. (Llama 3 8B's sizes on dp=8 x fsdp=8 x tp=8: 24.7 -> 14.5 GB a rank.)"""
    params, lowered = _planned_llama(sim, (1, 4, 4, 1, 1), torch.float32, 256, (256, 512, 4, 2, 8192))
    shapes = {v.shape for v in params.values()}
    over_dp = sum(
        c.bytes
        for r in lowered.plan.redistributions
        for c in r.collectives
        if c.axis == "dp" and meta_of(r.value).shape in shapes
    )
    assert over_dp <= 2 * 3 / 4 * sum(v.numel() * v.element_size() for v in params.values()) / 4


def test_gpt2_with_fewer_sequences_than_batch_ranks_trains_like_one_device(sim, monkeypatch):
    """GPT-2 (hidden 128, FFN 256, a vocabulary of 6144, one layer) with 2 sequences of 256 tokens on
    dp=2 x fsdp=2: the batch cannot split over both. Each axis alone computes the tied embedding's
    gradient from its share of the sequences, a partial sum; on the whole mesh that layout has
    half a sequence a rank, which DTensor refuses, so its decision splits the gradient by hidden
    over fsdp instead, and the sum with the head's gradient wanted a partial sum there. Planning
    raised "no redistribution does that"; the split gradient is now gathered over fsdp and
    partitioned, and the step trains like torch's AdamW on one device."""
    for name, value in {"HIDDEN": 128, "FFN": 256, "VOCAB": 6144, "LAYERS": 1, "SEQ": 256, "BATCH": 2}.items():
        monkeypatch.setattr(zoo, name, value)
    family = zoo.families()["gpt2"]
    losses, params, _ = zoo.jit_train(family, "5d", sim, shape=(1, 2, 2, 1, 1))
    zoo.assert_like_oracle("gpt2, 2 sequences on dp x fsdp", losses, params, zoo.torch_run(family))


REAL = ["llama", "bert"]  # rotary tables; position and token-type buffers, padding masks


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", REAL)
@pytest.mark.world("zoo_jit.py", "llama")
@pytest.mark.world("zoo_jit.py", "bert")
def test_trains_like_torch_on_one_device_on_real_processes(world, name):
    """The traced local program a real run executes (tests/workers/zoo_jit.py: dp x tp on 4 gloo
    processes, Megatron rules) with each model's buffers and constants in it: a model whose code
    reads a buffer (Llama's rotary frequencies) could not be traced before."""
    for r in world("zoo_jit.py", name):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-4, atol=0)
        assert r["plan_count"] == 1
        assert r["not_close"] == [], r["max_param_err"]


def _planned_collectives(model: torch.nn.Module, family: zoo.Family, batch: dict[str, torch.Tensor]) -> list:
    """The collectives of the zoo's train step of ``model`` planned on dp (the params replicated)."""
    params = vsf.tree.from_module(model)
    tx = zoo.adamw()
    shape, axes, kind, batch_spec = zoo.LAYOUTS["dp"]
    mesh = vsf.make_mesh(shape, axes)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, zoo.specs(params, kind, family)))
    step = vsf.jit(zoo.train_step(model, tx, family.loss))
    low = step.lower(p, optim.init_sharded(tx, p), vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec)))
    return sorted((c.kind, c.axis, c.bytes) for c in low.cost().collectives)


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.sweep)])
def test_the_default_cache_costs_no_collective(sim, name):
    """With ``use_cache`` on (transformers' default), each attention layer cats its keys and values
    to its cache's ``torch.tensor([])``, which adds nothing: the step on dp sends exactly what it
    sends with the cache off. (The old planner gathered the keys and values over dp in every layer,
    DTensor's cat rule replicating every operand, and sliced them back; over tp too, on dp x tp.)"""
    family = _families()[name]
    model, batches = zoo.built(family)
    assert model.config.use_cache
    sim(2, compute=False)
    cached = _planned_collectives(model, family, batches[0])
    model.config.use_cache = False
    assert cached == _planned_collectives(model, family, batches[0])


def _gpt2_packed() -> zoo.Family:
    """GPT-2 with its fused q, k, v (``c_attn``) packed over tp: each rank its heads of each."""
    gpt2 = _families()["gpt2"]
    packed = ((r".*c_attn\.weight", P(None, vsf.packed("tp", 3))), (r".*c_attn\.bias", P(vsf.packed("tp", 3))))
    return dataclasses.replace(gpt2, tp_rules=(*packed, *gpt2.tp_rules))


def test_gpt2_with_its_fused_qkv_packed_over_tp_moves_what_megatron_moves(sim):
    """GPT-2's ``c_attn`` is one ``Conv1D`` giving q, k and v side by side (``[hidden, 3 * hidden]``).
    Split contiguously over tp, a rank holds q and part of k, and the plan gathers weights to make
    the heads; packed (``vsf.packed("tp", 3)``, transformers' ``packed_colwise``) each rank holds its
    heads of q, of k and of v, and the AdamW step moves what Megatron's does (by hand, 2 ranks, 2
    layers): in each layer an all-reduce after attention's and after the MLP's row-split matmul,
    forward and backward (8 of a [4, 16, 32] float activation: 8 KiB each), the vocab-split
    embedding gathered for the tied head (96 x 32 floats: 6 KiB) and the head's logits gathered
    (64 x 96, half a rank: 12 KiB). A strided input's nesting once pulled the activations of its
    shape into it (12 collectives, 100 KiB). Its training: the sweep case below."""
    family = _gpt2_packed()
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("tp",))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, zoo.specs(params, "tp", family)))
    batch = vsf.device_put(batches[0], vsf.NamedSharding(mesh, P()))
    step = vsf.jit(zoo.train_step(model, zoo.adamw(), family.loss))
    moved = sorted(
        (c.kind, c.bytes) for c in step.lower(p, optim.init_sharded(zoo.adamw(), p), batch).cost().collectives
    )
    kib = 1024
    assert moved == sorted([("all_reduce", 8 * kib)] * 8 + [("all_gather", 6 * kib), ("all_gather", 12 * kib)])


@pytest.mark.sweep
def test_gpt2_with_its_fused_qkv_packed_over_tp_trains_like_one_device(sim):
    losses, params, _ = zoo.jit_train(_gpt2_packed(), "tp", sim)
    zoo.assert_like_oracle("gpt2 packed tp", losses, params, _oracle("gpt2"))
