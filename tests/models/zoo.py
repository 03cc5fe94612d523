"""The conformance zoo's models: tiny Hugging Face ``transformers`` families built from configs in
code (random weights, no hub access), each with its default attention implementation and
``use_cache``, its batches, its Megatron tensor-parallel rules, and for GPT-2 and Llama the stage
functions that cut it into two pipeline stages (all in this one place)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

import vsf
from vsf import P, optim

VOCAB, SEQ, BATCH, HIDDEN, LAYERS, HEADS, FFN = 96, 16, 4, 32, 2, 4, 64
STEPS = 3
# AdamW's hyperparameters, for vsf.optim.adamw and torch.optim.AdamW alike. eps is larger than
# torch's 1e-8 because Adam divides by the gradient's own scale: a gradient that is zero in exact
# arithmetic (a key bias: softmax ignores a shift of every score) or nearly so comes out as
# rounding noise of ~1e-8 whose value depends on the summation order, and a step changes by up to
# lr * noise / eps, which must stay below the params' atol of 1e-6. With 1e-6, one weight of T5 on
# dp x tp differed by 1.9e-6; with 1e-5, on an AMD EPYC one weight of diffusers' UNet on dp differed
# by 2.2e-6: its first gradient is 1.5e-7 (float64), against a weight gradient of scale 0.07 whose
# fp32 rounding over the batch's two halves moves it by about 1.5e-8 (torch's own fp32 run is 9e-8
# off a float64 run there). 1e-4 keeps that noise's step under 1.5e-7.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-4, 0.01
PARAMS_RTOL, PARAMS_ATOL = 1e-5, 1e-6  # a trained param against the oracle's


def model_loss(run: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss a Hugging Face model computes itself: ``run(**batch).loss`` (``run`` calls the
    model: the module itself, or ``vsf.tree.apply`` of it with the params being trained)."""
    return run(**batch).loss


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its model built from a tiny config, a batch maker, its TP rules, and its
    loss of a batch given a callable that runs the model (:func:`model_loss` by default)."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    tp_rules: tuple[tuple[str, Any], ...]
    loss: Callable[[Callable[..., Any], dict[str, torch.Tensor]], torch.Tensor] = model_loss


def causal_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def masked_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Masked-LM labels on about 30% of the tokens, and padding: rows of different lengths."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH, 1), generator=g)
    return {"input_ids": ids, "labels": labels, "attention_mask": (torch.arange(SEQ) < lengths).long()}


def seq2seq_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=g),
    }


def megatron(
    column: str, row: str, vocab: str, *, conv1d: bool = False, also: tuple[tuple[str, Any], ...] = ()
) -> tuple[tuple[str, Any], ...]:
    """Megatron's rules over ``tp``: column-parallel weights (q/k/v, gate/up, fc1) and their biases
    split over their outputs, row-parallel weights (o, down, fc2) over their inputs, embeddings and
    the head over the vocabulary, then the rules ``also`` gives; everything else replicated.
    ``conv1d``: GPT-2's ``Conv1D`` stores weights as ``[in, out]`` (transposed from ``nn.Linear``)."""
    col, rw = (P(None, "tp"), P("tp", None)) if conv1d else (P("tp", None), P(None, "tp"))
    return (
        *also,
        (rf"({vocab})\.weight", P("tp", None)),
        (rf".*({column})\.weight", col),
        (rf".*({column})\.bias", P("tp")),
        (rf".*({row})\.weight", rw),
        (r".*", P()),
    )


def _llama_like(config_cls: Any, model_cls: Any, **extra: Any) -> Callable[[], torch.nn.Module]:
    return lambda: model_cls(
        config_cls(
            **{
                "vocab_size": VOCAB,
                "hidden_size": HIDDEN,
                "intermediate_size": FFN,
                "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS,
                "num_key_value_heads": 2,
                "max_position_embeddings": 2 * SEQ,
                **extra,
            }
        )
    )


_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB = (
    r"q_proj|k_proj|v_proj|gate_proj|up_proj",
    r"o_proj|down_proj",
    r"model\.embed_tokens|lm_head",
)
_LLAMA_TP = megatron(_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB)
# the experts' fused [experts, 2 * ffn, hidden] and [experts, hidden, ffn] weights (Mixtral's, Qwen's,
# DeepSeek's) split over ffn
_EXPERTS_TP = ((r".*experts\.gate_up_proj", P(None, "tp", None)), (r".*experts\.down_proj", P(None, None, "tp")))


def families() -> dict[str, Family]:
    """Every family of the zoo, by name (transformers is imported here, not at collection)."""
    import transformers as T

    return {
        f.name: f
        for f in [
            Family(
                "gpt2",
                lambda: T.GPT2LMHeadModel(
                    T.GPT2Config(
                        vocab_size=VOCAB,
                        n_positions=2 * SEQ,
                        n_embd=HIDDEN,
                        n_layer=LAYERS,
                        n_head=HEADS,
                        resid_pdrop=0.0,
                        embd_pdrop=0.0,
                        attn_pdrop=0.0,
                        bos_token_id=0,
                        eos_token_id=0,
                    )
                ),
                causal_batch,
                megatron(r"c_attn|c_fc", r"attn\.c_proj|mlp\.c_proj", r"transformer\.wte", conv1d=True),
            ),
            Family("llama", _llama_like(T.LlamaConfig, T.LlamaForCausalLM), causal_batch, _LLAMA_TP),
            Family(
                "bert",
                lambda: T.BertForMaskedLM(
                    T.BertConfig(
                        vocab_size=VOCAB,
                        hidden_size=HIDDEN,
                        num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS,
                        intermediate_size=FFN,
                        max_position_embeddings=2 * SEQ,
                        hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0,
                    )
                ),
                masked_batch,
                megatron(
                    r"self\.query|self\.key|self\.value|intermediate\.dense",
                    r"attention\.output\.dense|layer\.\d+\.output\.dense",
                    r"bert\.embeddings\.word_embeddings",
                    also=((r"cls\.predictions\.bias", P("tp")),),
                ),
            ),
            Family(
                "t5",
                lambda: T.T5ForConditionalGeneration(
                    T.T5Config(
                        vocab_size=VOCAB,
                        d_model=HIDDEN,
                        d_kv=HIDDEN // HEADS,
                        d_ff=FFN,
                        num_layers=LAYERS,
                        num_heads=HEADS,
                        dropout_rate=0.0,
                        decoder_start_token_id=0,
                        pad_token_id=0,
                    )
                ),
                seq2seq_batch,
                megatron(
                    r"Attention\.q|Attention\.k|Attention\.v|DenseReluDense\.wi",
                    r"Attention\.o|DenseReluDense\.wo",
                    r"shared|lm_head",
                ),
            ),
            Family(
                "mixtral",
                _llama_like(T.MixtralConfig, T.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2),
                causal_batch,
                megatron(_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB, also=_EXPERTS_TP),
            ),
            Family(
                "qwen2_moe",
                _llama_like(
                    T.Qwen2MoeConfig,
                    T.Qwen2MoeForCausalLM,
                    moe_intermediate_size=FFN,
                    shared_expert_intermediate_size=FFN,
                    num_experts=4,
                    num_experts_per_tok=2,
                ),
                causal_batch,
                megatron(_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB, also=_EXPERTS_TP),
            ),
            Family(
                "qwen3_moe",
                _llama_like(
                    T.Qwen3MoeConfig,
                    T.Qwen3MoeForCausalLM,
                    moe_intermediate_size=FFN,
                    num_experts=4,
                    num_experts_per_tok=2,
                    head_dim=HIDDEN // HEADS,
                ),
                causal_batch,
                megatron(_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB, also=_EXPERTS_TP),
            ),
            Family(
                # multi-head latent attention; layer 0 dense, layer 1 routed experts + a shared one
                "deepseek_v3",
                _llama_like(
                    T.DeepseekV3Config,
                    T.DeepseekV3ForCausalLM,
                    moe_intermediate_size=FFN,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    n_shared_experts=1,
                    first_k_dense_replace=1,
                    n_group=1,
                    topk_group=1,
                    q_lora_rank=16,
                    kv_lora_rank=16,
                    qk_rope_head_dim=4,
                    qk_nope_head_dim=4,
                    v_head_dim=8,
                ),
                causal_batch,
                megatron(r"q_b_proj|kv_b_proj|gate_proj|up_proj", _LLAMA_ROW, _LLAMA_VOCAB, also=_EXPERTS_TP),
            ),
            Family(
                # OLMoE: softmax routing, top-k gates not renormalised, q and k normed
                "olmoe",
                _llama_like(T.OlmoeConfig, T.OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2, eos_token_id=0),
                causal_batch,
                megatron(_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB, also=_EXPERTS_TP),
            ),
            Family(
                # GLM-4.5: sigmoid routing with DeepSeek-V3's score-correction bias, partial rotary
                # embeddings, q and k normed; layer 0 dense, layer 1 routed experts + a shared one
                "glm4_moe",
                _llama_like(
                    T.Glm4MoeConfig,
                    T.Glm4MoeForCausalLM,
                    moe_intermediate_size=FFN,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    n_shared_experts=1,
                    first_k_dense_replace=1,
                    use_qk_norm=True,
                    head_dim=HIDDEN // HEADS,
                ),
                causal_batch,
                megatron(_LLAMA_COLUMN, _LLAMA_ROW, _LLAMA_VOCAB, also=_EXPERTS_TP),
            ),
            Family("mistral", _llama_like(T.MistralConfig, T.MistralForCausalLM), causal_batch, _LLAMA_TP),
            Family("qwen2", _llama_like(T.Qwen2Config, T.Qwen2ForCausalLM), causal_batch, _LLAMA_TP),
            Family(
                "gemma",
                _llama_like(T.GemmaConfig, T.GemmaForCausalLM, head_dim=HIDDEN // HEADS),
                causal_batch,
                _LLAMA_TP,
            ),
            Family(
                "phi",
                lambda: T.PhiForCausalLM(
                    T.PhiConfig(
                        vocab_size=VOCAB,
                        hidden_size=HIDDEN,
                        intermediate_size=FFN,
                        num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS,
                        max_position_embeddings=2 * SEQ,
                        resid_pdrop=0.0,
                        embd_pdrop=0.0,
                        attention_dropout=0.0,
                    )
                ),
                causal_batch,
                megatron(
                    r"q_proj|k_proj|v_proj|fc1",
                    r"self_attn\.dense|fc2",
                    r"model\.embed_tokens|lm_head",
                    also=((r"lm_head\.bias", P("tp")),),
                ),
            ),
            Family(
                # its SDPA call passes the causal mask it builds (a [batch, 1, T, T] broadcast), so SDPA's
                # CPU flash kernel runs with a mask argument; one key/value head a query head
                # (``multi_query`` off: with one shared head SDPA takes its math path)
                "falcon",
                lambda: T.FalconForCausalLM(
                    T.FalconConfig(
                        vocab_size=VOCAB,
                        hidden_size=HIDDEN,
                        num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS,
                        multi_query=False,
                        max_position_embeddings=2 * SEQ,
                    )
                ),
                causal_batch,
                megatron(
                    r"query_key_value|dense_h_to_4h",
                    r"self_attention\.dense|dense_4h_to_h",
                    r"transformer\.word_embeddings",
                ),
            ),
            Family(
                "gpt_neox",
                lambda: T.GPTNeoXForCausalLM(
                    T.GPTNeoXConfig(
                        vocab_size=VOCAB,
                        hidden_size=HIDDEN,
                        intermediate_size=FFN,
                        num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS,
                        max_position_embeddings=2 * SEQ,
                        hidden_dropout=0.0,
                        attention_dropout=0.0,
                    )
                ),
                causal_batch,
                megatron(
                    r"query_key_value|dense_h_to_4h", r"attention\.dense|dense_4h_to_h", r"gpt_neox\.embed_in|embed_out"
                ),
            ),
        ]
    }


def llama(layers: int, *, checkpointed: bool = False, **config: Any) -> Family:
    """The zoo's Llama with ``layers`` decoder layers; ``checkpointed``: with Hugging Face's
    activation checkpointing (``gradient_checkpointing_enable()``: each layer recomputed in the
    backward); ``config``: other settings of its ``LlamaConfig`` (``use_cache=False``)."""
    import transformers as T

    plain = _llama_like(T.LlamaConfig, T.LlamaForCausalLM, num_hidden_layers=layers, **config)

    def build() -> torch.nn.Module:
        model = plain()
        if checkpointed:
            model.gradient_checkpointing_enable()
        return model

    return dataclasses.replace(families()["llama"], build=build)


def uncached(family: Family) -> Family:
    """``family`` with its model's ``config.use_cache`` off: each layer is no longer handed a
    ``DynamicCache`` to write its keys into, so its layers can be stamped from one trace."""

    def build() -> torch.nn.Module:
        model = family.build()
        model.config.use_cache = False
        return model

    return dataclasses.replace(family, build=build)


def built(family: Family) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """The family's model (seeded random weights) and one batch per step (seeded)."""
    torch.manual_seed(0)
    model = family.build()
    g = torch.Generator().manual_seed(1)
    return model, [family.batch(g) for _ in range(STEPS)]


def torch_run(family: Family) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The oracle: the model trained by plain PyTorch on one device (``torch.optim.AdamW``): the
    loss of each step and every param after the last."""
    model, batches = built(family)
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = family.loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def not_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``got`` whose params differ from the oracle's ``want`` by more than the zoo's
    tolerances (what a worker process reports for the tests to assert empty)."""
    return [k for k in got if not torch.allclose(got[k], want[k], rtol=PARAMS_RTOL, atol=PARAMS_ATOL)]


def adamw() -> optim.GradientTransformation:
    """The oracle's AdamW (:func:`torch_run`) as a vsf optimizer."""
    return optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)


def train_step(
    model: torch.nn.Module, tx: optim.GradientTransformation, loss_fn: Callable[..., torch.Tensor] = model_loss
) -> Callable[..., Any]:
    """The vsf training step of ``model`` (``loss_fn`` of a batch dict, the model's own by default),
    to run under ``vsf.jit``: ``(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, torch.Tensor]:
        loss, grads = vsf.value_and_grad(lambda p: loss_fn(functools.partial(vsf.tree.apply, model, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return step


# layout: (mesh shape, axis names, params' layout, batch spec)
LAYOUTS = {
    "dp": ((2,), ("dp",), "replicated", P("dp")),
    "fsdp": ((2,), ("fsdp",), "fsdp", P("fsdp")),
    "tp": ((2,), ("tp",), "tp", P()),
    "dp_tp": ((2, 2), ("dp", "tp"), "tp", P("dp")),
    "5d": ((1, 1, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"), "fsdp_tp", P(("dp", "fsdp"))),
}


def specs(params: dict[str, torch.Tensor], kind: str, family: Family) -> dict[str, P]:
    """Each param's spec in a layout of ``kind``: ``replicated``; ``fsdp`` (dim 0 split where it
    divides); ``tp`` (the family's Megatron rules); ``fsdp_tp`` (those, and ``fsdp`` on the first
    dim they leave whole)."""
    if kind == "replicated":
        return {k: P() for k in params}
    if kind == "fsdp":
        return {k: P("fsdp") if v.ndim and v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    tp = vsf.sharding.match(params, list(family.tp_rules))
    return tp if kind == "tp" else {k: _with_fsdp(tp[k], params[k].shape) for k in params}


def _with_fsdp(spec: P, shape: torch.Size) -> P:
    """``spec`` with ``fsdp`` on the first dim that it leaves whole and that divides."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = next((d for d, e in enumerate(entries) if e is None and shape[d] % 2 == 0), None)
    if free is not None:
        entries[free] = "fsdp"
    return P(*entries)


def jit_train(
    family: Family,
    layout: str,
    simulate: Callable[[int], Any],
    *,
    check: bool = False,
    shape: tuple[int, ...] | None = None,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], Any]:
    """``family`` trained one step per batch of :func:`built` through ``vsf.jit`` on ``layout``
    (over a mesh of ``shape`` if given), on ranks that ``simulate(n)`` starts (the ``sim`` fixture;
    after the model is built, which would otherwise hold simulated tensors): each step's loss,
    every param after the last step (gathered), and the jitted step. ``check``: the first step in
    checking mode (``step.check``: it raises at the first op whose sharded result differs from one
    device's)."""
    model, batches = built(family)
    tx = adamw()
    simulate(math.prod(shape or LAYOUTS[layout][0]))
    mesh, p, s, batch_spec = _on_mesh(family, model, tx, layout, shape)
    step = vsf.jit(train_step(model, tx, family.loss))
    losses = []
    for i, batch in enumerate(batches):
        run = step.check if check and i == 0 else step
        p, s, loss = run(p, s, vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec)))
        losses.append(vsf.device_get(loss))
    return losses, vsf.device_get(p), step


def lowered(family: Family, layout: str = "5d", shape: tuple[int, ...] | None = None) -> tuple[dict[str, Any], Any]:
    """The AdamW step of ``family`` on ``layout`` (over a mesh of ``shape`` if given) planned for its
    first batch, not run (the caller has started the simulation): what one trace of it stamped
    (``Traced.stamped``), and its ``Lowered``."""
    model, batches = built(family)
    tx = adamw()
    mesh, p, s, batch_spec = _on_mesh(family, model, tx, layout, shape)
    batch = vsf.device_put(batches[0], vsf.NamedSharding(mesh, batch_spec))
    step = vsf.jit(train_step(model, tx, family.loss))
    return step.trace(p, s, batch).stamped, step.lower(p, s, batch)


def copied_and_one_by_one(monkeypatch: Any, family: Family, layout: str = "5d") -> tuple[int, Any, Any]:
    """``family``'s step planned (:func:`lowered`, its model of as many blocks as ``LAYERS`` says)
    with its blocks' runs of ops placed once and copied to the runs like them
    (:mod:`vsf.jit.copies`), how many runs were copied, and the step planned with every op placed
    one by one."""
    solver = importlib.import_module("vsf.jit.solver")
    copied: list[int] = []
    copy_run = solver.AxisSolver._copy_run
    with monkeypatch.context() as m:
        m.setattr(
            solver.AxisSolver,
            "_copy_run",
            lambda self, run, done: copied.append(run.start) or copy_run(self, run, done),
        )
        _, plan = lowered(family, layout)
        m.setattr(solver, "runs_of", lambda *args: {})
        _, one_by_one = lowered(family, layout)
    return len(copied), plan, one_by_one


def _on_mesh(
    family: Family,
    model: torch.nn.Module,
    tx: optim.GradientTransformation,
    layout: str,
    shape: tuple[int, ...] | None = None,
) -> tuple[Any, Any, Any, P]:
    """The mesh of ``layout`` (of ``shape`` if given), ``model``'s params placed on it as ``layout``
    specs them, ``tx``'s sharded state of them, and the batch's spec."""
    default, axes, kind, batch_spec = LAYOUTS[layout]
    mesh = vsf.make_mesh(shape or default, axes)
    params = vsf.tree.from_module(model)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs(params, kind, family)))
    return mesh, p, optim.init_sharded(tx, p), batch_spec


def fsdp_bytes(tensors: Iterable[torch.Tensor], n: int) -> float:
    """What FSDP's plan sends a rank on ``n`` fsdp ranks, by hand (ring model): ``(n-1)/n`` of the
    params' bytes gathered once and their gradients' reduced to their shards once, and two float
    scalar all-reduces (a mean loss's sum and count)."""
    ring = (n - 1) / n
    return ring * 2 * sum(t.numel() * t.element_size() for t in tensors) + 2 * (2 * ring * 4)


def assert_like_oracle(
    what: str,
    losses: list[torch.Tensor],
    params: dict[str, torch.Tensor],
    oracle: tuple[list[torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Each loss within 1e-4 (relative) of the oracle's (:func:`torch_run`), every param within
    :data:`PARAMS_RTOL` / :data:`PARAMS_ATOL`; ``what`` names the run in a failure."""
    want_losses, want_params = oracle
    torch.testing.assert_close(
        torch.stack(losses), torch.stack(want_losses), rtol=1e-4, atol=0, msg=lambda m: f"{what} losses: {m}"
    )
    assert params.keys() == want_params.keys()
    for k, want in want_params.items():
        torch.testing.assert_close(
            params[k], want, rtol=PARAMS_RTOL, atol=PARAMS_ATOL, msg=lambda m: f"{what} {k}: {m}"
        )


def train_pipelined(
    pipe: Any,
    tx: optim.GradientTransformation,
    placed: tuple[Any, Any],
    batches: list[dict[str, torch.Tensor]] | list[tuple[torch.Tensor, torch.Tensor]],
    state: tuple[Any, Any] | None = None,
) -> tuple[Any, ...]:
    """The params ``pipe.place`` returned with their layout (``placed``) trained one step per batch through the pipeline
    (a batch: ``(inputs, targets)``, or a causal-LM batch, its labels the targets): the params after the last step
    and each step's loss; with ``state`` (the buffers the stages write and their layout, as ``pipe.place(buffers,
    state=True)`` returned them) also the state after the last step."""
    params, layout = placed
    opt_state, losses = tx.init(params), []
    for batch in batches:
        x, target = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else batch
        result, grads = pipe.value_and_grad(params, x, target, layout=layout, state=state)
        loss, state = (result, None) if state is None else result
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        losses.append(vsf.device_get(loss))
    return (params, losses) if state is None else (params, losses, state[0])


def _sub(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: each position predicts the next label (the last none)."""
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def _gpt2_stages(model: Any) -> tuple[list[Any], list[list[str]], tuple[str, ...]]:
    """GPT-2 in two stages (embeddings + block 0 | block 1 + final norm + the tied output layer),
    as ``GPT2Model.forward`` runs them."""
    from transformers.masking_utils import create_causal_mask

    tr = model.transformer

    def make(s: int) -> Any:
        def stage(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            if s == 0:
                x = functional_call(tr.wte, _sub(params, "transformer.wte."), (x,)) + functional_call(
                    tr.wpe, _sub(params, "transformer.wpe."), (positions,)
                )
            mask = create_causal_mask(
                config=tr.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
            )
            x = functional_call(
                tr.h[s], _sub(params, f"transformer.h.{s}."), (x,), {"attention_mask": mask, "position_ids": positions}
            )
            if s == 1:
                x = (
                    functional_call(tr.ln_f, _sub(params, "transformer.ln_f."), (x,))
                    @ params["transformer.wte.weight"].t()
                )
            return x

        return stage

    prefixes = [
        ["transformer.wte.", "transformer.wpe.", "transformer.h.0."],
        ["transformer.h.1.", "transformer.ln_f.", "transformer.wte."],
    ]
    return [make(0), make(1)], prefixes, ("transformer.wte.weight",)


def _llama_stages(model: Any) -> tuple[list[Any], list[list[str]], tuple[str, ...]]:
    """Llama in two stages (embedding + layer 0 | layer 1 + final norm + output layer), as
    ``LlamaModel.forward`` runs them: each stage makes the causal mask and the rotary tables."""
    from transformers.masking_utils import create_causal_mask

    m = model.model

    def make(s: int) -> Any:
        def stage(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            if s == 0:
                x = functional_call(m.embed_tokens, _sub(params, "model.embed_tokens."), (x,))
            mask = create_causal_mask(
                config=m.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions
            )
            rotary = m.rotary_emb(x, position_ids=positions)
            x = functional_call(
                m.layers[s],
                _sub(params, f"model.layers.{s}."),
                (x,),
                {"attention_mask": mask, "position_ids": positions, "position_embeddings": rotary},
            )
            if s == 1:
                x = functional_call(
                    model.lm_head,
                    _sub(params, "lm_head."),
                    (functional_call(m.norm, _sub(params, "model.norm."), (x,)),),
                )
            return x

        return stage

    prefixes = [["model.embed_tokens.", "model.layers.0."], ["model.layers.1.", "model.norm.", "lm_head."]]
    return [make(0), make(1)], prefixes, ()


def pipeline_stages(
    name: str, model: torch.nn.Module
) -> tuple[list[Callable[..., torch.Tensor]], list[list[str]], tuple[str, ...]]:
    """``model`` of family ``name`` (``gpt2``, ``llama`` or ``mixtral``, whose modules are Llama's,
    ``LAYERS`` = 2) cut into two pipeline stages of one decoder layer each, as a user writes them:
    the stage functions, each stage's key-path prefixes, and the tied params (GPT-2's embedding,
    which its output layer reuses). The loss of the last stage's logits is :func:`causal_lm_loss`."""
    return {"gpt2": _gpt2_stages, "llama": _llama_stages, "mixtral": _llama_stages}[name](model)


def moe(name: str, experts: int = 8) -> Family:
    """The zoo's mixture-of-experts family ``name`` with ``experts`` routed experts (top-2)."""
    family = families()[name]
    key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts", "glm4_moe": "n_routed_experts"}.get(
        name, "num_experts"
    )

    def build() -> torch.nn.Module:
        model = family.build()
        setattr(model.config, key, experts)
        return type(model)(model.config)

    return dataclasses.replace(family, build=build)
