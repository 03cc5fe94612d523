"""vsf.pipeline on models no one here wrote: Hugging Face GPT-2 (learned positions, Conv1D layers,
output layer tied to the token embedding) and Llama (rotary positions, grouped-query attention,
RMSNorm, untied head) from the zoo's tiny configs, cut into two stages of one decoder layer each
the way a user would (``zoo.pipeline_stages``: stage functions over the model's own submodules and
mask code), trained a few steps with 1F1B over ``pp`` with ``dp`` and with Megatron ``tp`` inside the
stages under vsf.simulate, and over ``pp`` on 2 real gloo processes by torch's
Schedule1F1B, against the whole model trained by plain PyTorch (``torch.optim.AdamW``) on one
device."""

from __future__ import annotations

import functools

import pytest
import torch
import zoo

import vsf
from vsf import P

pytestmark = pytest.mark.models

# layout: (mesh shape, axis names, params split by the family's Megatron rules, batch spec)
LAYOUTS = {  # (pp alone: on real processes below)
    "pp_dp": ((2, 2), ("pp", "dp"), False, P("dp")),
    "pp_tp": ((2, 2), ("pp", "tp"), True, P()),
}
# by default GPT-2 (tied head) on pp x Megatron tp and Llama on pp x dp; the other two in the sweep
CASES = [
    pytest.param(
        f, l, id=f"{f}-{l}", marks=() if (f, l) in {("gpt2", "pp_tp"), ("llama", "pp_dp")} else pytest.mark.sweep
    )
    for f in ("gpt2", "llama")
    for l in LAYOUTS
]
MICROBATCHES = 2


@functools.cache
def _oracle(name: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return zoo.torch_run(zoo.families()[name])


@pytest.mark.parametrize("name, layout", CASES)
def test_pipelined_training_equals_torch_on_one_device(sim, name, layout):
    assert zoo.LAYERS == 2  # (one decoder layer a stage)
    family = zoo.families()[name]
    want_losses, want_params = _oracle(name)
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    fns, prefixes, tied = zoo.pipeline_stages(name, model)

    shape, axes, megatron, batch_spec = LAYOUTS[layout]
    sim(int(torch.tensor(shape).prod()))
    mesh = vsf.make_mesh(shape, axes)
    pipe = vsf.pipeline.Pipeline(
        fns,
        zoo.causal_lm_loss,
        prefixes,
        mesh=mesh,
        microbatches=MICROBATCHES,
        schedule="1f1b",
        batch=batch_spec,
        tied=tied,
    )
    placed = pipe.place(params, vsf.sharding.match(params, list(family.tp_rules)) if megatron else None)
    p, losses = zoo.train_pipelined(pipe, zoo.adamw(), placed, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-4, atol=0)
    got = vsf.device_get(p)
    assert got.keys() == want_params.keys()
    for k, want in want_params.items():
        torch.testing.assert_close(
            got[k], want, rtol=zoo.PARAMS_RTOL, atol=zoo.PARAMS_ATOL, msg=lambda m: f"{name} {layout} {k}: {m}"
        )
    # each param lives on its stage's pp coordinate only
    for k, v in p.items():
        stage = next(i for i, pre in enumerate(prefixes) if k.startswith(tuple(pre)))
        assert vsf.sharding.named.sharding_of(v).mesh == mesh.at("pp", stage), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.world("pipeline_hf.py", "gpt2", nproc=2)
@pytest.mark.world("pipeline_hf.py", "llama", nproc=2)
def test_pipelined_training_on_real_processes_equals_torch_on_one_device(world, name):
    """The same cut on 2 real gloo processes, run by torch's Schedule1F1B (tests/workers/pipeline_hf.py):
    each process trains its stage with the one-device losses and params."""
    reports = world("pipeline_hf.py", name, nproc=2)
    model, _ = zoo.built(zoo.families()[name])
    _, prefixes, tied = zoo.pipeline_stages(name, model)
    every = sorted(vsf.tree.from_module(model))
    for stage, r in enumerate(reports):  # (process r runs stage r)
        torch.testing.assert_close(r["losses"], r["want_losses"], rtol=1e-4, atol=0)
        assert r["held"] == [
            k for k in every if k.startswith(tuple(prefixes[stage])) and not (stage > 0 and k in tied)
        ], stage  # (a tied param: its first stage's)
        assert r["not_close"] == [], (stage, r["max_param_err"])
