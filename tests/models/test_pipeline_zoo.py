"""vsf.pipeline on models no one here wrote: Hugging Face GPT-2 (learned positions, Conv1D layers,
output layer tied to the token embedding) and Llama (rotary positions, grouped-query attention,
RMSNorm, untied head) from the zoo's tiny configs, cut into two stages of one decoder layer each
the way a user would (the stage functions below call the model's own submodules and mask code),
trained a few steps with 1F1B over ``pp`` alone, with ``dp`` and with Megatron ``tp`` inside the
stages, against the whole model trained by plain PyTorch (``torch.optim.AdamW``) on one device."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch.func import functional_call

import vsf
from vsf import P, optim

pytestmark = pytest.mark.models

# layout: (mesh shape, axis names, params split by the family's Megatron rules, batch spec)
LAYOUTS = {
    "pp": ((2,), ("pp",), False, P()),
    "pp_dp": ((2, 2), ("pp", "dp"), False, P("dp")),
    "pp_tp": ((2, 2), ("pp", "tp"), True, P()),
}
CASES = [(f, l) for f in ("gpt2", "llama") for l in LAYOUTS]
MICROBATCHES = 2


@functools.cache
def _oracle(name: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return zoo.torch_run(zoo.families()[name])


def _sub(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
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
                x = functional_call(tr.wte, _sub(params, "transformer.wte."), (x,)) + functional_call(tr.wpe, _sub(params, "transformer.wpe."), (positions,))
            mask = create_causal_mask(config=tr.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)
            x = functional_call(tr.h[s], _sub(params, f"transformer.h.{s}."), (x,), {"attention_mask": mask, "position_ids": positions})
            if s == 1:
                x = functional_call(tr.ln_f, _sub(params, "transformer.ln_f."), (x,)) @ params["transformer.wte.weight"].t()
            return x

        return stage

    prefixes = [["transformer.wte.", "transformer.wpe.", "transformer.h.0."], ["transformer.h.1.", "transformer.ln_f.", "transformer.wte."]]
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
            mask = create_causal_mask(config=m.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)
            rotary = m.rotary_emb(x, position_ids=positions)
            x = functional_call(m.layers[s], _sub(params, f"model.layers.{s}."), (x,), {"attention_mask": mask, "position_ids": positions, "position_embeddings": rotary})
            if s == 1:
                x = functional_call(model.lm_head, _sub(params, "lm_head."), (functional_call(m.norm, _sub(params, "model.norm."), (x,)),))
            return x

        return stage

    prefixes = [["model.embed_tokens.", "model.layers.0."], ["model.layers.1.", "model.norm.", "lm_head."]]
    return [make(0), make(1)], prefixes, ()


STAGES = {"gpt2": _gpt2_stages, "llama": _llama_stages}


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_pipelined_training_equals_torch_on_one_device(sim, name, layout):
    assert zoo.LAYERS == 2   # (one decoder layer a stage)
    family = zoo.families()[name]
    want_losses, want_params = _oracle(name)
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    fns, prefixes, tied = STAGES[name](model)
    tx = optim.adamw(zoo.LR, b1=zoo.BETAS[0], b2=zoo.BETAS[1], eps=zoo.EPS, weight_decay=zoo.WEIGHT_DECAY)

    shape, axes, megatron, batch_spec = LAYOUTS[layout]
    sim(int(torch.tensor(shape).prod()))
    mesh = vsf.make_mesh(shape, axes)
    pipe = vsf.pipeline.Pipeline(fns, _causal_lm_loss, prefixes, mesh=mesh, microbatches=MICROBATCHES, schedule="1f1b", batch=batch_spec, tied=tied)
    p = pipe.place(params, vsf.sharding.match(params, list(family.tp_rules)) if megatron else None)
    s = tx.init(p)
    losses = []
    for batch in batches:
        loss, grads = pipe.value_and_grad(p, batch["input_ids"], batch["labels"])
        updates, s = tx.update(grads, s, p)
        p = optim.apply_updates(p, updates)
        losses.append(vsf.device_get(loss))
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-4, atol=0)
    got = vsf.device_get(p)
    assert got.keys() == want_params.keys()
    for k, want in want_params.items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {layout} {k}: {m}")
    # each param lives on its stage's pp coordinate only
    for k, v in p.items():
        stage = next(i for i, pre in enumerate(prefixes) if k.startswith(tuple(pre)))
        assert vsf.sharding.named.sharding_of(v).mesh == mesh.at("pp", stage), k
